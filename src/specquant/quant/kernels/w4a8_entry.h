// The w4a8 family's C entry points and its activation quantization in plain C, for the variants that need no
// vector quantization of their own (w4a8_avx2.cpp, w4a8_portable.cpp). Include after defining, in an anonymous
// namespace, `template <typename S> void gemm(q, d, qsum, M, K, wp, sp, N, group, y, nthreads)`.
//
// The quantization does the same IEEE fp32 operations as w4a8_avx512_vnni.cpp's vector code (a max, one division,
// one reciprocal, one multiply and a round-half-even per element), so q and d are the same bit for bit.
#pragma once

#include <math.h>
#include <stdint.h>

#include <vector>

namespace {

void quantize_rows(const float* __restrict x, int64_t M, int64_t K, int8_t* __restrict q, float* __restrict d,
                   int32_t* __restrict qsum) {
  for (int64_t b = 0; b < M * K / BLOCK; ++b) {
    const float* xb = x + b * BLOCK;
    float amax = 0.0f;
    for (int i = 0; i < BLOCK; ++i) amax = fmaxf(amax, fabsf(xb[i]));
    const float db = amax / 127.0f, inv = db != 0.0f ? 1.0f / db : 0.0f;
    int32_t s = 0;
    for (int i = 0; i < BLOCK; ++i) {
      const int32_t v = static_cast<int32_t>(nearbyintf(xb[i] * inv));  // default rounding mode: half to even
      q[b * BLOCK + i] = static_cast<int8_t>(v);
      s += v;
    }
    d[b] = db;
    qsum[b] = s;
  }
}

}  // namespace

extern "C" {

// x: fp32 [M, K] -> q int8 [M, K], d fp32 [M, K/32], qsum int32 [M, K/32]. Returns 1 unless K % 32 == 0.
int specquant_q8_quantize(const float* x, int64_t M, int64_t K, int8_t* q, float* d, int32_t* qsum) {
  if (K % BLOCK || M < 1) return 1;
  quantize_rows(x, M, K, q, d, qsum);
  return 0;
}

// The same contract as w4a8_avx512_vnni.cpp's specquant_w4a8_gemm.
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
