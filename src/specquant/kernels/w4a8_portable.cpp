// The w4a8 family in plain C++, compiled with no instruction-set flag: the native kernel of a CPU without AVX2 (an
// old x86, or ARM until a NEON variant exists). Same layout and the same arithmetic as w4a8_avx512_vnni.cpp (whose
// comment has both): exact integer dots per (row, output, block of 32), then per block (weight scale · d) rounded
// once in fp32 and one fused multiply-add (fmaf) in k order, so its results are bit-equal to the vector variants'.
#include <math.h>
#include <stdint.h>

#include "common.h"

namespace {

constexpr int64_t BLOCK = 32;  // activation block (Q8_0), as w4a8_avx512_vnni.cpp

inline float scale_at(const float* p) { return *p; }
inline float scale_at(const uint16_t* p) { return specquant::bf16_to_float(*p); }

// Rows m..m+mr of one 16-output tile; the weight bytes of block b are wt[b·256 .. b·256+256): 4 chunks of 64,
// byte 4j + t of chunk c holding u[o_j, 8c + t] (low nibble) and u[o_j, 8c + 4 + t] (high nibble).
template <typename S>
void tile(const int8_t* q, int64_t ldq, const float* d, const int32_t* qsum, int64_t blocks, const uint8_t* wt,
          const S* st, int64_t blocks_per_group, float* y, int64_t ldy, int64_t mr) {
  for (int64_t r = 0; r < mr; ++r) {
    float acc[16] = {0.0f};
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* wb = wt + b * 256;
      const int8_t* qb = q + r * ldq + b * BLOCK;
      const S* sb = st + (b / blocks_per_group) * 16;
      const int64_t rb = r * blocks + b;
      for (int j = 0; j < 16; ++j) {
        int32_t dot = 0;  // sum u·q, exact
        for (int c = 0; c < 4; ++c)
          for (int t = 0; t < 4; ++t) {
            const uint8_t byte = wb[64 * c + 4 * j + t];
            dot += (byte & 15) * qb[8 * c + t] + (byte >> 4) * qb[8 * c + 4 + t];
          }
        dot -= 8 * qsum[rb];  // sum c·q with c = u - 8
        acc[j] = fmaf(static_cast<float>(dot), scale_at(sb + j) * d[rb], acc[j]);
      }
    }
    for (int j = 0; j < 16; ++j) y[r * ldy + j] = acc[j];
  }
}

template <typename S>
void gemm(const int8_t* q, const float* d, const int32_t* qsum, int64_t M, int64_t K, const uint8_t* wp,
          const S* sp, int64_t N, int64_t group, float* y, int nthreads) {
  const int64_t blocks = K / BLOCK, groups = K / group;
  specquant::for_each_tile(N / 16, M, nthreads, [&](int64_t t, int64_t m, int64_t mr) {
    tile<S>(q + m * K, K, d + m * blocks, qsum + m * blocks, blocks, wp + t * (K / 8) * 64, sp + t * groups * 16,
            group / BLOCK, y + m * N + t * 16, N, mr);
  });
}

}  // namespace

#include "w4a8_quantize.h"
#include "w4a8_entry.h"
