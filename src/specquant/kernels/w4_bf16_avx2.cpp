// The w4_bf16 family on AVX2 + FMA CPUs (no AVX-512 BF16): the arithmetic of w4_bf16_entry.h, 8 outputs per ymm.
// The layout (w4_bf16_avx512.cpp's) puts, in each 64-byte chunk of 8 inputs, outputs 0..7 in bytes 0..31 and 8..15
// in bytes 32..63, one 128-bit lane per 4 outputs; one byte shuffle per lane and one dword permute turn a half's
// low (high) nibbles into 4 qwords: the codes of its 8 outputs for inputs k0..k3 (k4..k7), widened to fp32.
#include <immintrin.h>
#include <stdint.h>

#include "avx2.h"
#include "common.h"

namespace {

using specquant::load_scales8;
using specquant::PREFETCH;

// 4 x 8 codes (k0..k3 or k4..k7 of one half) from nibbles n: ws[k] = fp32 (u - 8) of outputs 0..7 for input k.
inline void widen(__m256i n, __m256 ws[4]) {
  const __m256i by_k = _mm256_shuffle_epi8(n, _mm256_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15,
                                                               0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15));
  const __m256i p = _mm256_permutevar8x32_epi32(by_k, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  const __m128i k01 = _mm256_castsi256_si128(p), k23 = _mm256_extracti128_si256(p, 1);
  const __m256i eight = _mm256_set1_epi32(8);
  ws[0] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(k01), eight));
  ws[1] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(k01, 8)), eight));
  ws[2] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(k23), eight));
  ws[3] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(k23, 8)), eight));
}

template <int MR, typename S>
inline void half_tile(const float* __restrict x, int64_t ldx, int64_t K, const uint8_t* __restrict wt,
                      const S* __restrict st, int64_t group, float* __restrict y, int64_t ldy) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  const int64_t groups = K / group, steps = group / 8;
  for (int64_t g = 0; g < groups; ++g) {
    __m256 dot[MR];
    for (int r = 0; r < MR; ++r) dot[r] = _mm256_setzero_ps();
    const uint8_t* wg = wt + g * steps * 64;
    const float* xg = x + g * group;
    for (int64_t s = 0; s < steps; ++s) {
      specquant::prefetch(wg + s * 64 + PREFETCH);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + s * 64));
      __m256 w[8];
      widen(_mm256_and_si256(v, low4), w);
      widen(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), w + 4);
      for (int r = 0; r < MR; ++r) {
        const float* xr = xg + r * ldx + s * 8;
        for (int k = 0; k < 8; ++k) dot[r] = _mm256_fmadd_ps(w[k], _mm256_broadcast_ss(xr + k), dot[r]);
      }
    }
    const __m256 sc = load_scales8(st + g * 16);
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_fmadd_ps(dot[r], sc, acc[r]);
  }
  for (int r = 0; r < MR; ++r) _mm256_storeu_ps(y + r * ldy, acc[r]);
}

template <int MR, typename S>
inline void tile(const float* x, int64_t ldx, int64_t K, const uint8_t* wt, const S* st, int64_t group, float* y,
                 int64_t ldy) {
  for (int h = 0; h < 2; ++h) half_tile<MR, S>(x, ldx, K, wt + 32 * h, st + 8 * h, group, y + 8 * h, ldy);
}

template <typename S>
using tile_fn = void (*)(const float*, int64_t, int64_t, const uint8_t*, const S*, int64_t, float*, int64_t);
template <typename S>
const tile_fn<S> TILES[9] = {nullptr,       tile<1, S>, tile<2, S>, tile<3, S>, tile<4, S>,
                             tile<5, S>,    tile<6, S>, tile<7, S>, tile<8, S>};

template <typename S>
void gemm(const float* xf, int64_t M, int64_t K, const uint8_t* wp, const S* sp, int64_t N, int64_t group, float* y,
          int nthreads) {
  const int64_t groups = K / group;
  specquant::for_each_tile(N / 16, M, nthreads, [&](int64_t t, int64_t m, int64_t mr) {
    TILES<S>[mr](xf + m * K, K, K, wp + t * (K / 8) * 64, sp + t * groups * 16, group, y + m * N + t * 16, N);
  });
}

}  // namespace

#include "w4_bf16_entry.h"
