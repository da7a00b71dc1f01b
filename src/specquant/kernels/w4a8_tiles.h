// The register-blocked w4a8 variants' row dispatch and tile loop (w4a8_avx2.cpp, w4a8_avx512_vnni.cpp): a table of
// tile<MR, S> for 1..8 rows and the gemm that walks the output tiles. Include inside the variant's anonymous
// namespace, after its `template <int MR, typename S> void tile(...)`.
#pragma once

template <typename S>
using tile_fn = void (*)(const int8_t*, int64_t, const float*, const int32_t*, int64_t, const uint8_t*, const S*,
                         int64_t, float*, int64_t);
template <typename S>
const tile_fn<S> TILES[9] = {nullptr,       tile<1, S>, tile<2, S>, tile<3, S>, tile<4, S>,
                             tile<5, S>,    tile<6, S>, tile<7, S>, tile<8, S>};

template <typename S>
void gemm(const int8_t* q, const float* d, const int32_t* qsum, int64_t M, int64_t K, const uint8_t* wp,
          const S* sp, int64_t N, int64_t group, float* y, int nthreads) {
  const int64_t blocks = K / BLOCK, groups = K / group;
  specquant::for_each_tile(N / 16, M, nthreads, [&](int64_t t, int64_t m, int64_t mr) {
    TILES<S>[mr](q + m * K, K, d + m * blocks, qsum + m * blocks, blocks, wp + t * (K / 8) * 64, sp + t * groups * 16,
                 group / BLOCK, y + m * N + t * 16, N);
  });
}
