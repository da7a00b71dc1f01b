// W4 x int8-activation GEMM for few rows (decode / verify steps) on AVX-512 VNNI CPUs: GGUF's Q4_0 x Q8_0 route.
//
// Why a second kernel family beside w4_bf16: from about 4 rows a verify step is compute-bound there, because
// vdpbf16ps does 32 multiply-adds per instruction at about half of vpdpbusd's throughput (64 u8 x s8 multiply-adds
// per instruction), measured on this machine's CPU: the int8 route does about 3x the multiply-adds per second,
// which is what lets an 8-row verify step cost little more than a 1-row decode step that streams the weights.
// llama.cpp runs Q4_0 weights against Q8_0-quantized activations on CPU for the same reason.
//
// Numerics (tests/test_native_w4a8.py checks each step):
//   * activations: each row is cut into blocks of 32; per block d = max|x| / 127 (fp32), q = rint(x · (1/d)) in
//     [-127, 127] (round half to even), so x ≈ d · q. This is the only approximation beyond fp32 rounding, the
//     same one as GGUF's Q8_0 (which stores d in fp16; here it stays fp32). kernels/w4a8.py's
//     quantize_activations is the torch reference and must give the same q and d bit for bit.
//   * weights: the exact codes c in [-8, 7], stored unsigned u = c + 8 (vpdpbusd multiplies u8 by s8).
//   * per (row, output, block of 32): the integer dot sum c·q = sum u·q - 8·sum q, exact in int32.
//   * that integer, converted to fp32 (exact: |sum| < 2^15), times (weight scale · d) in fp32, accumulated over the
//     blocks in k order with one fused multiply-add each.
// Every output is computed by one thread in that fixed order whatever the row count or thread count, so rows are
// batch-invariant: a verify step's row i equals the decode step on the same prefix bit for bit, which is what keeps
// speculative decoding exact when decode and verify run this kernel.
//
// Packed weight layout (the w4a8 family's pack_codes, kernels/w4a8.py): for every tile of 16 outputs o_j
// (j < 16) and every 8 input columns k0..k7, 64 bytes; byte 4j + t holds u[o_j, k0+t] in its low nibble and
// u[o_j, k4+t] in its high nibble. A 64-byte load masked with 0x0F is then, in dword j, the 4 codes u[o_j, k0..k3]
// that vpdpbusd multiplies with the broadcast activations q[k0..k3]; shifted right by 4, the codes for k4..k7. Same
// N·K/2 bytes as the checkpoint's packing. Scales: [N/16][K/group][16], fp32 or bf16, as w4_bf16_avx512.cpp.
#include <immintrin.h>
#include <stdint.h>

#include <vector>

#include "avx512.h"
#include "common.h"

namespace {

using specquant::load_scales;
using specquant::PREFETCH;

constexpr int64_t BLOCK = 32;  // activation block: one scale per 32 inputs (Q8_0)

// q, d and the integer block sums of x[M, K] (K % 32 == 0): the same arithmetic as the torch reference.
void quantize_rows(const float* __restrict x, int64_t M, int64_t K, int8_t* __restrict q, float* __restrict d,
                   int32_t* __restrict qsum) {
  for (int64_t b = 0; b < M * K / BLOCK; ++b) {
    const float* xb = x + b * BLOCK;
    const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const float db = amax / 127.0f, inv = db != 0.0f ? 1.0f / db : 0.0f;
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(x0, vinv), _MM_FROUND_TO_NEAREST_INT));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(x1, vinv), _MM_FROUND_TO_NEAREST_INT));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * BLOCK), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * BLOCK + 16), _mm512_cvtsepi32_epi8(q1));
    d[b] = db;
    qsum[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  }
}

template <int MR, typename S>
inline void tile(const int8_t* __restrict q, int64_t ldq, const float* __restrict d, const int32_t* __restrict qsum,
                 int64_t blocks, const uint8_t* __restrict wt, const S* __restrict st, int64_t blocks_per_group,
                 float* __restrict y, int64_t ldy) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = wt + b * 256;
    __m512i w[8];
    for (int s = 0; s < 4; ++s) {
      specquant::prefetch(wb + 64 * s + PREFETCH);
      const __m512i v = _mm512_loadu_si512(wb + 64 * s);
      w[2 * s] = _mm512_and_si512(v, low4);
      w[2 * s + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    }
    const __m512 sw = load_scales(st + (b / blocks_per_group) * 16);
    for (int r = 0; r < MR; ++r) {
      const int32_t* qr = reinterpret_cast<const int32_t*>(q + r * ldq + b * BLOCK);
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();  // two chains; integer sums are exact
      for (int i = 0; i < 8; i += 2) {
        s0 = _mm512_dpbusd_epi32(s0, w[i], _mm512_set1_epi32(qr[i]));
        s1 = _mm512_dpbusd_epi32(s1, w[i + 1], _mm512_set1_epi32(qr[i + 1]));
      }
      const int64_t rb = r * blocks + b;
      const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(s0, s1), _mm512_set1_epi32(8 * qsum[rb]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(sw, _mm512_set1_ps(d[rb])), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

#include "w4a8_tiles.h"

}  // namespace

#include "w4a8_entry.h"
