// What the two 256-bit w4a8 variants share (w4a8_avx2.cpp: vpmaddubsw / vpmaddwd; w4a8_avx_vnni.cpp: vpdpbusd on
// ymm): the AVX2 activation quantizer and the split of a block of up to 8 rows into register tiles of 4. Include
// inside the variant's anonymous namespace, after its BLOCK and `template <int R, typename S> void rows(...)`, for
// R <= 4 rows of one 16-output tile over all blocks (and after <immintrin.h>).
#pragma once

// q, d and the integer block sums of x[M, K] (K % 32 == 0) with the same IEEE fp32 steps as the AVX-512 variant's
// vector quantization and the torch reference: max|x| (exact in any order), one division, one reciprocal, one
// multiply and round-half-even per element (vroundps in nearest mode). Vector code because the plain C loop
// (w4a8_quantize.h) costs more than the GEMM it feeds at 8 rows.
void quantize_rows(const float* __restrict x, int64_t M, int64_t K, int8_t* __restrict q, float* __restrict d,
                   int32_t* __restrict qsum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < M * K / BLOCK; ++b) {
    const float* xb = x + b * BLOCK;
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xb + 8 * i);
    const __m256 m8 = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                    _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const float amax = _mm_cvtss_f32(m4);
    const float db = amax / 127.0f, inv = db != 0.0f ? 1.0f / db : 0.0f;
    const __m256 vinv = _mm256_set1_ps(inv);
    __m256i qi[4];
    for (int i = 0; i < 4; ++i)
      qi[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], vinv), _MM_FROUND_TO_NEAREST_INT |
                                                                             _MM_FROUND_NO_EXC));
    // int32 -> int8 (|q| <= 127: no saturation); the packs interleave 128-bit lanes, the permute restores k order
    const __m256i q16 = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * BLOCK), _mm256_permutevar8x32_epi32(q16, order));
    const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    d[b] = db;
    qsum[b] = _mm_cvtsi128_si32(s4);
  }
}

template <int MR, typename S>
inline void tile(const int8_t* q, int64_t ldq, const float* d, const int32_t* qsum, int64_t blocks,
                 const uint8_t* wt, const S* st, int64_t blocks_per_group, float* y, int64_t ldy) {
  constexpr int first = MR < 4 ? MR : 4;
  rows<first, S>(q, ldq, d, qsum, blocks, wt, st, blocks_per_group, y, ldy);
  if constexpr (MR > 4)
    rows<MR - 4, S>(q + 4 * ldq, ldq, d + 4 * blocks, qsum + 4 * blocks, blocks, wt, st, blocks_per_group,
                    y + 4 * ldy, ldy);
}

