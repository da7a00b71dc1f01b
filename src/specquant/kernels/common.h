// What every native W4 kernel variant shares, with no instruction set in it (each variant's .cpp brings its own
// intrinsics, or none: the portable variants): the weight stream's prefetch distance and the loop that hands every
// 16-output tile and block of rows to a variant's register tile. kernels/build.py hashes every header here
// into every build, so an edit rebuilds them all.
#pragma once

#include <stdint.h>

namespace specquant {

// Software prefetch distance in bytes: the weight is one sequential stream per thread (tiles are contiguous), and
// fetching ahead of the hardware prefetcher kept the streamed one-row case at the int4pack kernel's speed or better.
constexpr int64_t PREFETCH = 4096;

inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }

// w4_bf16 layout: the bit offset of input k % 8's nibble in the dword w4_bf16_avx2.cpp gathers per output (input
// k = b in the low nibble of byte b, k = b + 4 in its high nibble; k = 7 is read after a 4-bit right shift, so that
// u * 2^s stays a positive int32), and the activation pre-scales 2^-s (w4_bf16_entry.h).
constexpr int W4_SHIFT[8] = {0, 8, 16, 24, 4, 12, 20, 24};
constexpr float W4_INV_SHIFT[8] = {1.0f, 1.0f / (1 << 8), 1.0f / (1 << 16), 1.0f / (1 << 24),
                                   1.0f / (1 << 4), 1.0f / (1 << 12), 1.0f / (1 << 20), 1.0f / (1 << 24)};

// The fp32 value of bf16 bits (exact).
inline float bf16_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  __builtin_memcpy(&f, &wide, 4);
  return f;
}

// run(t, m, mr) for every tile t of 16 outputs and every block of mr <= 8 rows starting at row m. Tiles are split
// statically over the threads, so each output is computed by one thread in one order whatever M or the thread count
// (the kernels' batch invariance), and each thread reads one contiguous stretch of the weight.
template <typename F>
inline void for_each_tile(int64_t tiles, int64_t M, int nthreads, F&& run) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t t = 0; t < tiles; ++t) {
    for (int64_t m = 0; m < M; m += 8) run(t, m, M - m < 8 ? M - m : 8);
  }
}

}  // namespace specquant
