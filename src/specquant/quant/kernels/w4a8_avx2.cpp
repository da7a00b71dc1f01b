// The w4a8 family on AVX2 + FMA CPUs (no AVX-512): GGUF's Q4_0 x Q8_0 through vpmaddubsw / vpmaddwd, llama.cpp's
// route on these CPUs. Same layout, same activation quantization and the same arithmetic as w4a8_avx512_vnni.cpp
// (whose comment has both), so its results are bit-equal to that variant's:
//   * the integer dot of every (row, output, block of 32) is exact: vpmaddubsw's int16 pair sums are at most
//     2·15·127 = 3810, eight of them add up to at most 30480 < 2^15 without saturating, and vpmaddwd widens to int32;
//   * then the same fp32 steps per output lane: (weight scale · d) rounded once, one fused multiply-add per block in
//     k order.
// A 16-output tile is done as two halves of 8 outputs (one ymm each): bytes 0..31 of every 64-byte chunk hold
// outputs 0..7 (byte 4j + t), bytes 32..63 outputs 8..15.
#include <immintrin.h>
#include <stdint.h>

#include "avx2.h"
#include "common.h"

namespace {

using specquant::load_scales8;
using specquant::PREFETCH;

constexpr int64_t BLOCK = 32;  // activation block (Q8_0), as w4a8_avx512_vnni.cpp

template <int MR, typename S>
inline void half_tile(const int8_t* __restrict q, int64_t ldq, const float* __restrict d,
                      const int32_t* __restrict qsum, int64_t blocks, const uint8_t* __restrict wt,
                      const S* __restrict st, int64_t blocks_per_group, float* __restrict y, int64_t ldy) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = wt + b * 256;
    __m256i w[8];
    for (int s = 0; s < 4; ++s) {
      specquant::prefetch(wb + 64 * s + PREFETCH);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * s));
      w[2 * s] = _mm256_and_si256(v, low4);
      w[2 * s + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    }
    const __m256 sw = load_scales8(st + (b / blocks_per_group) * 16);
    for (int r = 0; r < MR; ++r) {
      const int32_t* qr = reinterpret_cast<const int32_t*>(q + r * ldq + b * BLOCK);
      __m256i s16 = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(qr[0]));
      for (int i = 1; i < 8; ++i) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[i], _mm256_set1_epi32(qr[i])));
      const int64_t rb = r * blocks + b;
      const __m256i dot = _mm256_sub_epi32(_mm256_madd_epi16(s16, ones), _mm256_set1_epi32(8 * qsum[rb]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(sw, _mm256_set1_ps(d[rb])), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm256_storeu_ps(y + r * ldy, acc[r]);
}

template <int MR, typename S>
inline void tile(const int8_t* q, int64_t ldq, const float* d, const int32_t* qsum, int64_t blocks,
                 const uint8_t* wt, const S* st, int64_t blocks_per_group, float* y, int64_t ldy) {
  for (int h = 0; h < 2; ++h)
    half_tile<MR, S>(q, ldq, d, qsum, blocks, wt + 32 * h, st + 8 * h, blocks_per_group, y + 8 * h, ldy);
}

#include "w4a8_tiles.h"

}  // namespace

#include "w4a8_quantize.h"
#include "w4a8_entry.h"
