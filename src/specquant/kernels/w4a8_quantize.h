// The w4a8 family's activation quantization in plain C, for the variants with no vector quantization of their own
// (w4a8_portable.cpp). It does the same IEEE fp32 operations as the vector variants' quantization (a max, one
// division, one reciprocal, one multiply and a round-half-even per element), so q and d are the same bit for bit.
// The rounding is (v + 1.5·2^23) - 1.5·2^23, exact round-half-even for |v| < 2^22 (here |v| <= 127) under the
// default rounding mode: nearbyintf was a library call per element (it saves and restores the FP environment), which
// made quantizing a row cost about as much as the GEMM streaming its weights.
#pragma once

#include <math.h>
#include <stdint.h>

namespace {

constexpr float MAGIC = 12582912.0f;  // 1.5 * 2^23

void quantize_rows(const float* __restrict x, int64_t M, int64_t K, int8_t* __restrict q, float* __restrict d,
                   int32_t* __restrict qsum) {
  for (int64_t b = 0; b < M * K / BLOCK; ++b) {
    const float* xb = x + b * BLOCK;
    float amax = 0.0f;
    for (int i = 0; i < BLOCK; ++i) amax = fmaxf(amax, fabsf(xb[i]));
    const float db = amax / 127.0f, inv = db != 0.0f ? 1.0f / db : 0.0f;
    int32_t s = 0;
    for (int i = 0; i < BLOCK; ++i) {
      // three fp32 roundings, never fused or reassociated (build.py compiles with -ffp-contract=off, no fast-math)
      const int32_t v = static_cast<int32_t>((xb[i] * inv + MAGIC) - MAGIC);
      q[b * BLOCK + i] = static_cast<int8_t>(v);
      s += v;
    }
    d[b] = db;
    qsum[b] = s;
  }
}

}  // namespace
