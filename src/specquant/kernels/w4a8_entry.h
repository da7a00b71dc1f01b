// The w4a8 family's C entry points, shared by every variant. Include after defining, in an anonymous namespace,
// `quantize_rows(x, M, K, q, d, qsum)` (w4a8_quantize.h, or a variant's vector version) and
// `template <typename S> void gemm(q, d, qsum, M, K, wp, sp, N, group, y, nthreads)`.
#pragma once

#include <stdint.h>

#include <vector>

extern "C" {

// x: fp32 [M, K] -> q int8 [M, K], d fp32 [M, K/32], qsum int32 [M, K/32]. Returns 1 unless K % 32 == 0.
int specquant_q8_quantize(const float* x, int64_t M, int64_t K, int8_t* q, float* d, int32_t* qsum) {
  if (K % BLOCK || M < 1) return 1;
  quantize_rows(x, M, K, q, d, qsum);
  return 0;
}

// x: fp32 [M, K] row-major; wp: packed weight [N/16][K/8][64]; sp: scales [N/16][K/group][16], fp32 or
// (scale_bf16) bf16 bits; y: fp32 [M, N]. Requires N % 16 == 0, group % 32 == 0, K % group == 0.
int specquant_w4a8_gemm(const float* x, int64_t M, int64_t K, const uint8_t* wp, const void* sp, int64_t N,
                        int64_t group, int scale_bf16, float* y, int nthreads) {
  if (N % 16 || group % BLOCK || K % group || M < 1) return 1;
  const int64_t blocks = K / BLOCK;
  std::vector<int8_t> q(M * K);
  std::vector<float> d(M * blocks);
  std::vector<int32_t> qsum(M * blocks);
  quantize_rows(x, M, K, q.data(), d.data(), qsum.data());
  if (scale_bf16)
    gemm(q.data(), d.data(), qsum.data(), M, K, wp, static_cast<const uint16_t*>(sp), N, group, y, nthreads);
  else
    gemm(q.data(), d.data(), qsum.data(), M, K, wp, static_cast<const float*>(sp), N, group, y, nthreads);
  return 0;
}

}  // extern "C"
