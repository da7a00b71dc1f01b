// The w4a8 family on AVX2 + FMA CPUs (no AVX-512): GGUF's Q4_0 x Q8_0 through vpmaddubsw / vpmaddwd, llama.cpp's
// route on these CPUs. Same layout, same activation quantization and the same arithmetic as w4a8_avx512_vnni.cpp
// (whose comment has both), so its results are bit-equal to that variant's:
//   * the integer dot of every (row, output, block of 32) is exact: vpmaddubsw's int16 pair sums are at most
//     2·15·127 = 3810, eight of them add up to at most 30480 < 2^15 without saturating, and vpmaddwd widens to int32;
//   * then the same fp32 steps per output lane: (weight scale · d) rounded once, one fused multiply-add per block in
//     k order.
// A 16-output tile is two halves of 8 outputs (one ymm each): bytes 0..31 of every 64-byte chunk hold outputs 0..7
// (byte 4j + t), bytes 32..63 outputs 8..15. Both halves are done in one pass over the tile, so every 64-byte line
// of the weight stream is loaded once, consumed whole and prefetched once (an earlier version walked the tile once
// per half: on a Zen 3 it streamed a one-row step at about half the bandwidth torch.sum reads). Up to 4 rows share
// each unpacked chunk (4 rows' int16 sums, two per row, and the unpacked nibbles fill the 16 ymm registers); 5..8
// rows are two such passes over the tile, the second reading it from L1/L2.
#include <immintrin.h>
#include <stdint.h>

#include "avx2.h"
#include "common.h"

namespace {

using specquant::load_scales8;
using specquant::PREFETCH;

constexpr int64_t BLOCK = 32;  // activation block (Q8_0), as w4a8_avx512_vnni.cpp

// R <= 4 rows of one tile, all blocks: y[r][0..16) = sum over blocks of (dot · (sw · d)) in k order.
template <int R, typename S>
inline void rows(const int8_t* __restrict q, int64_t ldq, const float* __restrict d, const int32_t* __restrict qsum,
                 int64_t blocks, const uint8_t* __restrict wt, const S* __restrict st, int64_t blocks_per_group,
                 float* __restrict y, int64_t ldy) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const int64_t groups = blocks / blocks_per_group;
  const uint8_t* wb = wt;
  int64_t b = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const __m256 sw0 = load_scales8(st + g * 16), sw1 = load_scales8(st + g * 16 + 8);
    for (int64_t j = 0; j < blocks_per_group; ++j, ++b, wb += 256) {
      __m256i s16[R][2];
      for (int r = 0; r < R; ++r) s16[r][0] = s16[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 1  // unrolled, g++ 12 schedules all 16 products of 4 rows first and spills them to the stack
      for (int c = 0; c < 4; ++c) {
        specquant::prefetch(wb + 64 * c + PREFETCH);
        const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * c));
        const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * c + 32));
        const __m256i l0 = _mm256_and_si256(v0, low4), h0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low4);
        const __m256i l1 = _mm256_and_si256(v1, low4), h1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low4);
        for (int r = 0; r < R; ++r) {
          const int32_t* qr = reinterpret_cast<const int32_t*>(q + r * ldq + b * BLOCK) + 2 * c;
          const __m256i a = _mm256_set1_epi32(qr[0]), e = _mm256_set1_epi32(qr[1]);  // k 8c..8c+3, 8c+4..8c+7
          const __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(l0, a), _mm256_maddubs_epi16(h0, e));
          const __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(l1, a), _mm256_maddubs_epi16(h1, e));
          s16[r][0] = _mm256_add_epi16(s16[r][0], p0);
          s16[r][1] = _mm256_add_epi16(s16[r][1], p1);
        }
      }
      for (int r = 0; r < R; ++r) {
        const int64_t rb = r * blocks + b;
        const __m256i off = _mm256_set1_epi32(8 * qsum[rb]);
        const __m256 dr = _mm256_set1_ps(d[rb]);
        const __m256i dot0 = _mm256_sub_epi32(_mm256_madd_epi16(s16[r][0], ones), off);
        const __m256i dot1 = _mm256_sub_epi32(_mm256_madd_epi16(s16[r][1], ones), off);
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

#include "w4a8_avx2_common.h"
#include "w4a8_tiles.h"

}  // namespace

#include "w4a8_entry.h"
