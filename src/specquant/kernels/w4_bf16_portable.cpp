// The w4_bf16 family in plain C++, compiled with no instruction-set flag: the native kernel of a CPU without AVX2
// (an old x86, or ARM until a NEON variant exists). Arithmetic in w4_bf16_entry.h; layout in w4_bf16_avx512.cpp:
// output j = 4L + i of a tile reads, in each 64-byte chunk of 8 inputs, bytes 16L + 8h + 2i + e for input
// k = 2h + e (low nibble) and k + 4 (high nibble), h, e in {0, 1}. It computes what the AVX2 variant does, in the
// same order, so the two agree bit for bit.
#include <math.h>
#include <stdint.h>

#include "common.h"

namespace {

inline float scale_at(const float* p) { return *p; }
inline float scale_at(const uint16_t* p) { return specquant::bf16_to_float(*p); }

template <typename S>
void tile(const float* x, const float* nsum, int64_t ldx, int64_t K, const uint8_t* wt, const S* st, int64_t group,
          float* y, int64_t ldy, int64_t mr) {
  const int64_t groups = K / group;
  for (int64_t r = 0; r < mr; ++r) {
    for (int j = 0; j < 16; ++j) {
      const int L = j / 4, i = j % 4;
      float acc = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        float dot[2] = {0.0f, 0.0f};  // even and odd inputs
        for (int64_t k8 = g * group / 8; k8 < (g + 1) * group / 8; ++k8) {
          const uint8_t* chunk = wt + k8 * 64 + 16 * L + 2 * i;
          const float* xk = x + r * ldx + k8 * 8;  // pre-scaled by 2^-W4_SHIFT[k]
          for (int k = 0; k < 8; ++k) {
            const uint8_t byte = chunk[8 * ((k & 3) >> 1) + (k & 1)];
            const int u = k < 4 ? byte & 15 : byte >> 4;
            const float w = static_cast<float>(u << specquant::W4_SHIFT[k]);  // exact
            dot[k & 1] = fmaf(w, xk[k], dot[k & 1]);
          }
        }
        acc = fmaf(dot[0] + dot[1] + nsum[r * groups + g], scale_at(st + g * 16 + j), acc);
      }
      y[r * ldy + j] = acc;
    }
  }
}

template <typename S>
void gemm(const float* xf, const float* nsum, int64_t M, int64_t K, const uint8_t* wp, const S* sp, int64_t N,
          int64_t group, float* y, int nthreads) {
  const int64_t groups = K / group;
  specquant::for_each_tile(N / 16, M, nthreads, [&](int64_t t, int64_t m, int64_t mr) {
    tile<S>(xf + m * K, nsum + m * groups, K, K, wp + t * (K / 8) * 64, sp + t * groups * 16, group,
            y + m * N + t * 16, N, mr);
  });
}

}  // namespace

#include "w4_bf16_entry.h"
