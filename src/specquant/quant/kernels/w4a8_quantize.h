// The w4a8 family's activation quantization in plain C, for the variants with no vector quantization of their own
// (w4a8_avx2.cpp, w4a8_portable.cpp). It does the same IEEE fp32 operations as w4a8_avx512_vnni.cpp's vector code
// (a max, one division, one reciprocal, one multiply and a round-half-even per element), so q and d are the same
// bit for bit.
#pragma once

#include <math.h>
#include <stdint.h>

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
