// The w4_bf16 family's C entry point for the variants that sum in fp32 with fused multiply-adds instead of
// vdpbf16ps (w4_bf16_avx2.cpp, w4_bf16_portable.cpp). Include after defining, in an anonymous namespace,
// `template <typename S> void gemm(xf, M, K, wp, sp, N, group, y, nthreads)` over fp32 activations xf [M, K].
//
// Their arithmetic: the bf16 activations widened to fp32 (exact), each times the exact code c in [-8, 7] (exact in
// fp32) and summed per group by fused multiply-adds in k order, each group's sum times its scale added the same
// way. So these variants agree with each other bit for bit; against the AVX-512 BF16 variant (another summation
// order) they agree to fp32 rounding, and every one keeps rows batch- and thread-invariant.
#pragma once

#include <stdint.h>

#include <vector>

extern "C" {

// x: bf16 bits [M, K] row-major; wp: packed weight [N/16][K/8][64] (w4_bf16_avx512.cpp's layout); sp: scales
// [N/16][K/group][16], fp32 or (scale_bf16) bf16 bits; y: fp32 [M, N]. Requires N % 16 == 0, group % 8 == 0,
// K % group == 0.
int specquant_w4_bf16_gemm(const uint16_t* x, int64_t M, int64_t K, const uint8_t* wp, const void* sp, int64_t N,
                           int64_t group, int scale_bf16, float* y, int nthreads) {
  if (N % 16 || group % 8 || K % group || M < 1) return 1;
  std::vector<float> xf(M * K);
  for (int64_t i = 0; i < M * K; ++i) xf[i] = specquant::bf16_to_float(x[i]);
  if (scale_bf16)
    gemm(xf.data(), M, K, wp, static_cast<const uint16_t*>(sp), N, group, y, nthreads);
  else
    gemm(xf.data(), M, K, wp, static_cast<const float*>(sp), N, group, y, nthreads);
  return 0;
}

}  // extern "C"
