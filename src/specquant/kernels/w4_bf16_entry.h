// The w4_bf16 family's C entry point for the variants that sum in fp32 with fused multiply-adds instead of
// vdpbf16ps (w4_bf16_avx2.cpp, w4_bf16_portable.cpp). Include after defining, in an anonymous namespace,
// `template <typename S> void gemm(xf, nsum, M, K, wp, sp, N, group, y, nthreads)` over the pre-scaled fp32
// activations xf [M, K] and the group terms nsum [M, K / group].
//
// Their arithmetic, in the "offset" form: with u = c + 8 in [0, 15] the stored nibble, a group's dot is
//   sum_k u_k x_k  -  8 sum_k x_k,
// the first sum by fused multiply-adds into two running sums (even and odd inputs, each in k order: two independent
// chains, so a one-row step is not bound by the FMA latency), the second (NSUM: -8 times the group's sum of x in k
// order, exact scaling) added once, and the dot times its scale added by one more fused multiply-add. The AVX2
// variant reads u_k times 2^s_k (s_k: the nibble's bit offset in its dword) straight from the weight with one AND
// and one int-to-float conversion, so the activations are given to both variants pre-scaled by 2^-s_k (a power of
// two: the product u_k 2^s_k x_k 2^-s_k is the real number u_k x_k, so the FMA rounds the same as with u_k x_k).
// Every intermediate is about twice the "code" form's c_k x_k sums, far inside the bf16 rounding of the
// activations. So these variants agree with each other bit for bit; against the AVX-512 BF16 variant (another
// summation order) they agree to fp32 rounding, and every one keeps rows batch- and thread-invariant.
#pragma once

#include <stdint.h>

#include <vector>

#include "common.h"

extern "C" {

// x: bf16 bits [M, K] row-major; wp: packed weight [N/16][K/8][64] (w4_bf16_avx512.cpp's layout); sp: scales
// [N/16][K/group][16], fp32 or (scale_bf16) bf16 bits; y: fp32 [M, N]. Requires N % 16 == 0, group % 8 == 0,
// K % group == 0.
int specquant_w4_bf16_gemm(const uint16_t* x, int64_t M, int64_t K, const uint8_t* wp, const void* sp, int64_t N,
                           int64_t group, int scale_bf16, float* y, int nthreads) {
  if (N % 16 || group % 8 || K % group || M < 1) return 1;
  const int64_t groups = K / group;
  std::vector<float> xf(M * K), nsum(M * groups);
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      float sum = 0.0f;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) {
        const float v = specquant::bf16_to_float(x[r * K + k]);
        sum += v;
        xf[r * K + k] = v * specquant::W4_INV_SHIFT[k % 8];
      }
      nsum[r * groups + g] = -8.0f * sum;
    }
  }
  if (scale_bf16)
    gemm(xf.data(), nsum.data(), M, K, wp, static_cast<const uint16_t*>(sp), N, group, y, nthreads);
  else
    gemm(xf.data(), nsum.data(), M, K, wp, static_cast<const float*>(sp), N, group, y, nthreads);
  return 0;
}

}  // extern "C"
