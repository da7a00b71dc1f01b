// The w4_bf16 family on AVX2 + FMA CPUs (no AVX-512 BF16): the arithmetic of w4_bf16_entry.h, 8 outputs per ymm.
// The layout (w4_bf16_avx512.cpp's) puts, in each 64-byte chunk of 8 inputs, outputs 0..7 in bytes 0..31 and 8..15
// in bytes 32..63, one 128-bit lane per 4 outputs. One byte shuffle per half gathers each output's four bytes into
// one dword (input k = b in the low nibble of byte b, k = b + 4 in its high nibble). Each input's 8 weights are then
// one AND with that nibble's mask and one int-to-float conversion: u * 2^s, exact, against activations pre-scaled by
// 2^-s (w4_bf16_entry.h), so the FMA that takes the product is the only other instruction per input and row. (An
// earlier widening moved each byte to a dword with four lane shuffles per 4 inputs and summed one chain per half:
// a one-row step ran at about a quarter of the bandwidth.)
//
// Two running sums per group and output (even and odd inputs) make two independent chains per row and half: a
// one-row step runs both halves at once (4 chains in flight behind the FMA latency); more rows run one half at a
// time, up to 4 rows per pass (their sums and the gathered weights fill the 16 ymm registers).
#include <immintrin.h>
#include <stdint.h>

#include "avx2.h"
#include "common.h"

namespace {

using specquant::load_scales8;
using specquant::PREFETCH;

// bytes 2i, 2i+1, 8+2i, 9+2i of each lane -> dword i (output i of the lane): (k0|k4), (k1|k5), (k2|k6), (k3|k7)
inline __m256i gather(const uint8_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_shuffle_epi8(v, _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15, 0, 1, 8, 9, 2,
                                                 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15));
}

// u * 2^s (exact fp32) of the 8 outputs of a gathered half for input k (s = W4_SHIFT[k])
template <int k>
inline __m256 weight(__m256i d) {
  constexpr int s = specquant::W4_SHIFT[k];
  if constexpr (k == 7) d = _mm256_srli_epi32(d, 4);  // the top nibble, as a positive int32
  return _mm256_cvtepi32_ps(_mm256_and_si256(d, _mm256_set1_epi32(15 << s)));
}

// input k of the 8 at i: every half's weights times every row's x[i + k], into the even or odd sums (one base
// pointer per row and one shared index, so the broadcasts need no address arithmetic of their own)
template <int k, int H, int R>
inline void input(const __m256i (&d)[H], const float* const (&xr)[R], int64_t i, __m256 (&even)[H][R],
                  __m256 (&odd)[H][R]) {
  for (int h = 0; h < H; ++h) {
    const __m256 w = weight<k>(d[h]);
    for (int r = 0; r < R; ++r) {
      const __m256 xk = _mm256_broadcast_ss(xr[r] + i + k);
      if constexpr (k % 2 == 0) even[h][r] = _mm256_fmadd_ps(w, xk, even[h][r]);
      else odd[h][r] = _mm256_fmadd_ps(w, xk, odd[h][r]);
    }
  }
}

// H halves (1: the half at wt, 2: both) x R rows, the whole K: y[r][8h + 0..7].
template <int H, int R, typename S>
inline void pass(const float* __restrict x, const float* __restrict nsum, int64_t ldx, int64_t K,
                 const uint8_t* __restrict wt, const S* __restrict st, int64_t group, float* __restrict y,
                 int64_t ldy) {
  const float* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = x + r * ldx;
  __m256 acc[H][R];
  for (int h = 0; h < H; ++h)
    for (int r = 0; r < R; ++r) acc[h][r] = _mm256_setzero_ps();
  const int64_t groups = K / group, steps = group / 8;
  for (int64_t g = 0; g < groups; ++g) {
    __m256 even[H][R], odd[H][R];
    for (int h = 0; h < H; ++h)
      for (int r = 0; r < R; ++r) even[h][r] = odd[h][r] = _mm256_setzero_ps();
    const uint8_t* wg = wt + g * steps * 64;
    for (int64_t s = 0; s < steps; ++s) {
      specquant::prefetch(wg + s * 64 + PREFETCH);
      __m256i d[H];
      for (int h = 0; h < H; ++h) d[h] = gather(wg + s * 64 + 32 * h);
      const int64_t i = g * group + s * 8;
      input<0, H, R>(d, xr, i, even, odd);
      input<1, H, R>(d, xr, i, even, odd);
      input<2, H, R>(d, xr, i, even, odd);
      input<3, H, R>(d, xr, i, even, odd);
      input<4, H, R>(d, xr, i, even, odd);
      input<5, H, R>(d, xr, i, even, odd);
      input<6, H, R>(d, xr, i, even, odd);
      input<7, H, R>(d, xr, i, even, odd);
    }
    for (int h = 0; h < H; ++h) {
      const __m256 sc = load_scales8(st + g * 16 + 8 * h);
      for (int r = 0; r < R; ++r) {
        const __m256 dot = _mm256_add_ps(_mm256_add_ps(even[h][r], odd[h][r]), _mm256_set1_ps(nsum[r * groups + g]));
        acc[h][r] = _mm256_fmadd_ps(dot, sc, acc[h][r]);
      }
    }
  }
  for (int h = 0; h < H; ++h)
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ldy + 8 * h, acc[h][r]);
}

template <int R, typename S>
inline void halves(const float* x, const float* nsum, int64_t ldx, int64_t K, const uint8_t* wt, const S* st,
                   int64_t group, float* y, int64_t ldy) {
  for (int h = 0; h < 2; ++h) pass<1, R, S>(x, nsum, ldx, K, wt + 32 * h, st + 8 * h, group, y + 8 * h, ldy);
}

template <int MR, typename S>
inline void tile(const float* x, const float* nsum, int64_t ldx, int64_t K, const uint8_t* wt, const S* st,
                 int64_t group, float* y, int64_t ldy) {
  if constexpr (MR == 1) {
    pass<2, 1, S>(x, nsum, ldx, K, wt, st, group, y, ldy);
  } else if constexpr (MR <= 4) {
    halves<MR, S>(x, nsum, ldx, K, wt, st, group, y, ldy);
  } else {
    halves<4, S>(x, nsum, ldx, K, wt, st, group, y, ldy);
    halves<MR - 4, S>(x + 4 * ldx, nsum + 4 * (K / group), ldx, K, wt, st, group, y + 4 * ldy, ldy);
  }
}

template <typename S>
using tile_fn = void (*)(const float*, const float*, int64_t, int64_t, const uint8_t*, const S*, int64_t, float*,
                         int64_t);
template <typename S>
const tile_fn<S> TILES[9] = {nullptr,       tile<1, S>, tile<2, S>, tile<3, S>, tile<4, S>,
                             tile<5, S>,    tile<6, S>, tile<7, S>, tile<8, S>};

template <typename S>
void gemm(const float* xf, const float* nsum, int64_t M, int64_t K, const uint8_t* wp, const S* sp, int64_t N,
          int64_t group, float* y, int nthreads) {
  const int64_t groups = K / group;
  specquant::for_each_tile(N / 16, M, nthreads, [&](int64_t t, int64_t m, int64_t mr) {
    TILES<S>[mr](xf + m * K, nsum + m * groups, K, K, wp + t * (K / 8) * 64, sp + t * groups * 16, group,
                 y + m * N + t * 16, N);
  });
}

}  // namespace

#include "w4_bf16_entry.h"
