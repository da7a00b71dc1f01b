// Helpers of the AVX-512 variants (w4_bf16_avx512.cpp, w4a8_avx512_vnni.cpp); compiled only with their flags.
#pragma once

#include <immintrin.h>
#include <stdint.h>

namespace specquant {

// Scales of 16 outputs as fp32: stored fp32, or bf16 (the checkpoints' usual dtype; widening is exact, and half the
// bytes: at group 32 the scales are a fifth of what one step streams).
inline __m512 load_scales(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_scales(const uint16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

}  // namespace specquant
