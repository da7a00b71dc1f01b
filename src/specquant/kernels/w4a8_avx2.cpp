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

constexpr int64_t BLOCK = 32;  // activation block (Q8_0), as w4a8_avx512_vnni.cpp

// The integer dot on AVX2: vpmaddubsw sums code x activation pairs into int16 (a chunk adds at most 2·2·15·127 =
// 7620, four chunks 30480 < 2^15: no saturation), vpmaddwd widens the block's sums to int32.
struct Dot {
  static constexpr bool UNROLL = false;
  static __m256i add(__m256i s, __m256i lo, __m256i a, __m256i hi, __m256i e) {
    return _mm256_add_epi16(s, _mm256_add_epi16(_mm256_maddubs_epi16(lo, a), _mm256_maddubs_epi16(hi, e)));
  }
  static __m256i widen(__m256i s) { return _mm256_madd_epi16(s, _mm256_set1_epi16(1)); }
};

#include "w4a8_avx2_common.h"
#include "w4a8_tiles.h"

}  // namespace

#include "w4a8_entry.h"
