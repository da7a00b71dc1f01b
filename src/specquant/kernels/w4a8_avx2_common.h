// What the two 256-bit w4a8 variants share (w4a8_avx2.cpp: vpmaddubsw / vpmaddwd; w4a8_avx_vnni.cpp: vpdpbusd on
// ymm): the AVX2 activation quantizer, the register tile of up to 4 rows (weight unpacking, scales, fp32 steps),
// and the split of a block of up to 8 rows into such tiles. The variants differ only in the integer dot of a chunk:
// include inside the variant's anonymous namespace, after <immintrin.h>, avx2.h, common.h, its BLOCK and its
// `struct Dot` (rows() below says what it provides).
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

// R <= 4 rows of one tile, all blocks: y[r][0..16) = sum over blocks of (dot · (sw · d)) in k order. The variant's
// Dot gives the integer part: Dot::add(s, lo, a, hi, e) adds a chunk's products of codes lo / hi with broadcast
// activations a / e into the running sums s of one half (8 outputs), Dot::widen(s) turns them into the int32
// block dot before the 8·sum q offset; Dot::UNROLL lets g++ unroll the 4 chunks of a block (it spills the
// AVX2 route's int16 products when it does).
template <int R, typename S>
inline void rows(const int8_t* __restrict q, int64_t ldq, const float* __restrict d, const int32_t* __restrict qsum,
                 int64_t blocks, const uint8_t* __restrict wt, const S* __restrict st, int64_t blocks_per_group,
                 float* __restrict y, int64_t ldy) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const int64_t groups = blocks / blocks_per_group;
  const uint8_t* wb = wt;
  int64_t b = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const __m256 sw0 = specquant::load_scales8(st + g * 16), sw1 = specquant::load_scales8(st + g * 16 + 8);
    for (int64_t j = 0; j < blocks_per_group; ++j, ++b, wb += 256) {
      __m256i sums[R][2];
      for (int r = 0; r < R; ++r) sums[r][0] = sums[r][1] = _mm256_setzero_si256();
      const auto chunk = [&](int c) {
        specquant::prefetch(wb + 64 * c + specquant::PREFETCH);
        const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * c));
        const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * c + 32));
        const __m256i l0 = _mm256_and_si256(v0, low4), h0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low4);
        const __m256i l1 = _mm256_and_si256(v1, low4), h1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low4);
        for (int r = 0; r < R; ++r) {
          const int32_t* qr = reinterpret_cast<const int32_t*>(q + r * ldq + b * BLOCK) + 2 * c;
          const __m256i a = _mm256_set1_epi32(qr[0]), e = _mm256_set1_epi32(qr[1]);  // k 8c..8c+3, 8c+4..8c+7
          sums[r][0] = Dot::add(sums[r][0], l0, a, h0, e);
          sums[r][1] = Dot::add(sums[r][1], l1, a, h1, e);
        }
      };
      if constexpr (Dot::UNROLL) {
        for (int c = 0; c < 4; ++c) chunk(c);
      } else {
#pragma GCC unroll 1  // unrolled, g++ 12 schedules all 16 products of 4 rows first and spills them to the stack
        for (int c = 0; c < 4; ++c) chunk(c);
      }
      for (int r = 0; r < R; ++r) {
        const int64_t rb = r * blocks + b;
        const __m256i off = _mm256_set1_epi32(8 * qsum[rb]);
        const __m256 dr = _mm256_set1_ps(d[rb]);
        const __m256i dot0 = _mm256_sub_epi32(Dot::widen(sums[r][0]), off);
        const __m256i dot1 = _mm256_sub_epi32(Dot::widen(sums[r][1]), off);
        acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot0), _mm256_mul_ps(sw0, dr), acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot1), _mm256_mul_ps(sw1, dr), acc[r][1]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(y + r * ldy, acc[r][0]);
    _mm256_storeu_ps(y + r * ldy + 8, acc[r][1]);
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

