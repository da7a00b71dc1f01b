// What both native W4 kernels (w4_bf16.cpp, w4a8_vnni.cpp) share: the weight stream's prefetch distance, the scale
// loads, and the loop that hands every 16-output tile and block of rows to a kernel's register tile. Each kernel is
// still its own translation unit and library (each needs its own CPU extension); quant/native.py hashes this header
// into both builds, so an edit here rebuilds both.
#pragma once

#include <immintrin.h>
#include <stdint.h>

namespace specquant {

// Software prefetch distance in bytes: the weight is one sequential stream per thread (tiles are contiguous), and
// fetching ahead of the hardware prefetcher kept the streamed one-row case at the int4pack kernel's speed or better.
constexpr int64_t PREFETCH = 4096;

// Scales of 16 outputs as fp32: stored fp32, or bf16 (the checkpoints' usual dtype; widening is exact, and half the
// bytes: at group 32 the scales are a fifth of what one step streams).
inline __m512 load_scales(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_scales(const uint16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
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
