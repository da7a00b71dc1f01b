// W4 x bf16 GEMM for few rows (decode / verify steps) on AVX-512 BF16 CPUs: y[M, N] = x[M, K] . dequant(W)[N, K]^T
//
// Why hand-written: torch's CPU int4 kernel (aten._weight_int4pack_mm_for_cpu) streams its weight at a fraction of
// memory bandwidth and its cost grows linearly with rows; no maintained library we may depend on (oneDNN as shipped
// inside torch exposes no int4 weight-only matmul on CPU) provides a W4A16 GEMM for 1..16 rows.
//
// Numerics (what tests/test_native_w4.py checks against the dequantize-then-matmul reference):
//   * activations arrive as bf16 (the caller rounds them, as the int4pack_cpu_bf16 backend does),
//   * weights are the exact integers c in [-8, 7] as bf16 (exact), multiplied pairwise with the activations by
//     vdpbf16ps (bf16 x bf16 products are exact in fp32) and summed in fp32 per group,
//   * each group's fp32 sum is scaled by its fp32 scale and accumulated in fp32.
// So the only rounding beyond fp32 summation order is the bf16 rounding of the activations.
//
// Packed weight layout (the w4_bf16 family's pack_codes, kernels/w4_bf16.py): for every tile of 16 output
// rows (o_j, j < 16) and every 8 input columns k0..k7, 64 bytes. Output j = 4L + i (L = 128-bit lane, i < 4) owns bytes
// 16L+2i, 16L+2i+1 (pairs k0,k1 / low nibble and k4,k5 / high nibble) and 16L+8+2i, 16L+8+2i+1 (k2,k3 / k6,k7),
// each weight as its unsigned code u = c + 8. vpunpck{l,h}bw of the low / high nibbles with the byte 0x43 then
// makes, in dword j, the bf16 pair (128 + u[o_j, ka], 128 + u[o_j, kb]) that vdpbf16ps multiplies with the
// broadcast activation pair (x[ka], x[kb]): two ops per 32 weights instead of a widening plus a table lookup.
// The offset comes back out per group: sum (128 + u) x = sum c x + 136 sum x, with sum x over the same bf16 x.
// Scales: [N/16][K/group][16], fp32 or bf16 (load_scales widens bf16 exactly).
#include <immintrin.h>
#include <stdint.h>

#include <vector>

#include "avx512.h"
#include "common.h"

namespace {

using specquant::load_scales;
using specquant::PREFETCH;

template <int MR, typename S>
inline void tile(const uint16_t* __restrict x, int64_t ldx, int64_t K, const uint8_t* __restrict wt,
                 const S* __restrict st, const float* __restrict xsum, int64_t group, float* __restrict y,
                 int64_t ldy) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), magic = _mm512_set1_epi8(0x43);
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t groups = K / group, steps = group / 8;
  for (int64_t g = 0; g < groups; ++g) {
    __m512 dot[MR][2];  // two chains per row; summed in a fixed order, so every M gives the same bits
    for (int r = 0; r < MR; ++r) dot[r][0] = dot[r][1] = _mm512_setzero_ps();
    const uint8_t* wg = wt + g * steps * 64;
    const uint16_t* xg = x + g * group;
    for (int64_t s = 0; s < steps; ++s) {
      specquant::prefetch(wg + s * 64 + PREFETCH);
      const __m512i b = _mm512_loadu_si512(wg + s * 64);
      const __m512i lo = _mm512_and_si512(b, low4), hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), low4);
      const __m512bh w01 = (__m512bh)_mm512_unpacklo_epi8(lo, magic), w23 = (__m512bh)_mm512_unpackhi_epi8(lo, magic);
      const __m512bh w45 = (__m512bh)_mm512_unpacklo_epi8(hi, magic), w67 = (__m512bh)_mm512_unpackhi_epi8(hi, magic);
      for (int r = 0; r < MR; ++r) {
        const int32_t* xr = reinterpret_cast<const int32_t*>(xg + r * ldx + s * 8);
        dot[r][0] = _mm512_dpbf16_ps(dot[r][0], w01, (__m512bh)_mm512_set1_epi32(xr[0]));
        dot[r][1] = _mm512_dpbf16_ps(dot[r][1], w23, (__m512bh)_mm512_set1_epi32(xr[1]));
        dot[r][0] = _mm512_dpbf16_ps(dot[r][0], w45, (__m512bh)_mm512_set1_epi32(xr[2]));
        dot[r][1] = _mm512_dpbf16_ps(dot[r][1], w67, (__m512bh)_mm512_set1_epi32(xr[3]));
      }
    }
    const __m512 sc = load_scales(st + g * 16);
    for (int r = 0; r < MR; ++r) {
      const __m512 sum = _mm512_fnmadd_ps(_mm512_set1_ps(136.0f), _mm512_set1_ps(xsum[r * groups + g]),
                                          _mm512_add_ps(dot[r][0], dot[r][1]));
      acc[r] = _mm512_fmadd_ps(sum, sc, acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

template <typename S>
using tile_fn = void (*)(const uint16_t*, int64_t, int64_t, const uint8_t*, const S*, const float*, int64_t, float*,
                         int64_t);
template <typename S>
const tile_fn<S> TILES[9] = {nullptr,       tile<1, S>, tile<2, S>, tile<3, S>, tile<4, S>,
                             tile<5, S>,    tile<6, S>, tile<7, S>, tile<8, S>};

template <typename S>
void gemm(const uint16_t* x, int64_t M, int64_t K, const uint8_t* wp, const S* sp, int64_t N, int64_t group,
          const float* xsum, float* y, int nthreads) {
  const int64_t groups = K / group;
  specquant::for_each_tile(N / 16, M, nthreads, [&](int64_t t, int64_t m, int64_t mr) {
    TILES<S>[mr](x + m * K, K, K, wp + t * (K / 8) * 64, sp + t * groups * 16, xsum + m * groups, group,
                 y + m * N + t * 16, N);
  });
}

}  // namespace

extern "C" {

// x: bf16 bits [M, K] row-major; wp: packed weight [N/16][K/8][64]; sp: scales [N/16][K/group][16], fp32 or
// (scale_bf16) bf16 bits; y: fp32 [M, N]. Requires N % 16 == 0, group % 8 == 0, K % group == 0. Rows go in blocks
// of up to 8 (the accumulators stay in registers); a tile's weight (K/2 bytes per 16 outputs) is re-read from cache
// per block.
int specquant_w4_bf16_gemm(const uint16_t* x, int64_t M, int64_t K, const uint8_t* wp, const void* sp, int64_t N,
                           int64_t group, int scale_bf16, float* y, int nthreads) {
  if (N % 16 || group % 8 || K % group || M < 1) return 1;
  const int64_t groups = K / group;
  std::vector<float> xsum(M * groups);  // per row and group: the sum of the bf16 activations, in a fixed order
  for (int64_t i = 0; i < M * groups; ++i) {
    float s = 0.0f;
    for (int64_t k = 0; k < group; ++k) {
      s += specquant::bf16_to_float(x[i * group + k]);
    }
    xsum[i] = s;
  }
  if (scale_bf16)
    gemm(x, M, K, wp, static_cast<const uint16_t*>(sp), N, group, xsum.data(), y, nthreads);
  else
    gemm(x, M, K, wp, static_cast<const float*>(sp), N, group, xsum.data(), y, nthreads);
  return 0;
}

}  // extern "C"
