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

constexpr int64_t BLOCK = 32;  // activation block (Q8_0), as w4a8_avx512_vnni.cpp

// The integer dot with AVX-VNNI: vpdpbusd adds each dword's 4 code x activation products straight into int32.
struct Dot {
  static constexpr bool UNROLL = true;
  static __m256i add(__m256i s, __m256i lo, __m256i a, __m256i hi, __m256i e) {
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(s, lo, a), hi, e);
  }
  static __m256i widen(__m256i s) { return s; }
};

#include "w4a8_avx2_common.h"
#include "w4a8_tiles.h"

}  // namespace

#include "w4a8_entry.h"
