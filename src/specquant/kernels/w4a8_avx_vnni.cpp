// The w4a8 family on CPUs with AVX-VNNI but no AVX-512 (Intel client cores from Alder Lake on, and the AVX2 mode of
// AMD Zen 4 / Zen 5): w4a8_avx2.cpp with each chunk's vpmaddubsw / vpaddw / vpmaddwd chain replaced by vpdpbusd on
// ymm, which multiplies the 4 unsigned codes of a dword by 4 int8 activations and adds them into int32 in one
// instruction. Same layout, quantizer (w4a8_avx2_common.h) and fp32 steps, so the results are bit-equal to the
// other variants': every (row, output, block of 32) integer dot is exact in int32 on both routes (|sum| < 2^15), and
// the fp32 part is the same (weight scale · d) rounded once, one fused multiply-add per block in k order.
// Why a variant: on the AVX2 route a 4-row verify step is bound by vpmaddubsw's throughput (4 per 64-byte chunk and
// row, plus 4 int16 adds); here the 4 multiply-adds per chunk and row are the whole inner loop.
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
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const int64_t groups = blocks / blocks_per_group;
  const uint8_t* wb = wt;
  int64_t b = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const __m256 sw0 = load_scales8(st + g * 16), sw1 = load_scales8(st + g * 16 + 8);
    for (int64_t j = 0; j < blocks_per_group; ++j, ++b, wb += 256) {
      __m256i s32[R][2];
      for (int r = 0; r < R; ++r) s32[r][0] = s32[r][1] = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        specquant::prefetch(wb + 64 * c + PREFETCH);
        const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * c));
        const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * c + 32));
        const __m256i l0 = _mm256_and_si256(v0, low4), h0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low4);
        const __m256i l1 = _mm256_and_si256(v1, low4), h1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low4);
        for (int r = 0; r < R; ++r) {
          const int32_t* qr = reinterpret_cast<const int32_t*>(q + r * ldq + b * BLOCK) + 2 * c;
          const __m256i a = _mm256_set1_epi32(qr[0]), e = _mm256_set1_epi32(qr[1]);  // k 8c..8c+3, 8c+4..8c+7
          s32[r][0] = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(s32[r][0], l0, a), h0, e);
          s32[r][1] = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(s32[r][1], l1, a), h1, e);
        }
      }
      for (int r = 0; r < R; ++r) {
        const int64_t rb = r * blocks + b;
        const __m256i off = _mm256_set1_epi32(8 * qsum[rb]);
        const __m256 dr = _mm256_set1_ps(d[rb]);
        const __m256i dot0 = _mm256_sub_epi32(s32[r][0], off), dot1 = _mm256_sub_epi32(s32[r][1], off);
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
