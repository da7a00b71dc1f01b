// Helpers of the AVX2 + FMA variants (w4_bf16_avx2.cpp, w4a8_avx2.cpp); compiled only with their flags. A 16-output
// tile of the families' layout is two halves of 8 outputs, one ymm of fp32 results each.
#pragma once

#include <immintrin.h>
#include <stdint.h>

namespace specquant {

// Scales of 8 outputs as fp32: stored fp32, or bf16 (widening is exact), as avx512.h's load_scales for 16.
inline __m256 load_scales8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_scales8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

}  // namespace specquant
