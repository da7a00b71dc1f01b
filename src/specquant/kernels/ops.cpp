// The decoder's small fp32 ops, fused: the RMSNorm family (with the residual add before it, or DeltaNet's SiLU gate
// after it), SwiGLU, the per-head norm with RoPE, the gated delta rule's token step and DeltaNet's conv, gated
// attention's output gate, attention for a few queries over a K/V cache, the few-row fp32 linear, and whole decoder
// layers made of these (decoder_layer, deltanet_layer). kernels/ops.py has the torch reference of each and the conditions
// under which the model calls these; tests/test_native_ops.py compares the two.
//
// Why native: in an eager decode step each of these is 4-10 torch ops of 2-5 us apiece on one-row tensors (the
// dispatcher, not the arithmetic), about a fifth of a 0.6B W4 step, and torch's flash-attention kernel takes
// ~80-250 us for one query over 128 keys per layer. One call here is one ctypes call.
//
// One source for every variant, built with the variant's instruction-set flags (kernels/ops.py VARIANTS) and
// -ffp-contract=off: the elementwise loops are left to g++'s vectorizer, the reductions and the attention / delta
// rule inner loops use the v16 type below (explicit SIMD at the build's native width). Results match the torch
// reference to float rounding, not bit for bit: sums run in 16 lanes and exp is the polynomial below (within 2 ulp
// of expf over the range used). Each row's result does not depend on the other rows or the thread count (rows are
// independent; attention and the delta rule split work by (batch, head) only).
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

namespace {

constexpr int LANES = 16;
// attention: query rows done together, and output columns accumulated together per row (ROWS x VCHUNK floats in
// registers: 16 zmm with AVX-512, 8 ymm with AVX2)
constexpr int ROWS = 4;  // attend_rows<1..4> below: change both together
#ifdef __AVX512F__
constexpr int VCHUNK = 64;
#else
constexpr int VCHUNK = 16;
#endif

// exp(x) for x <= 88 (x below -87 gives about 1e-38 rather than 0, harmless where it is used: a softmax term or a
// SiLU denominator): x = n·ln2 + r, |r| <= ln2/2, exp(r) by its degree-7 Taylor polynomial (truncation below 6e-9
// relative), times 2^n built in the exponent bits. Branch-free, so loops over it vectorize.
inline float exp_poly(float x) {
  x = x < 88.0f ? x : 88.0f;
  x = x > -87.0f ? x : -87.0f;
  const float shifter = 12582912.0f;  // 1.5 * 2^23: (v + shifter) - shifter rounds v half-even for |v| < 2^22
  const float n = (x * 1.44269504088896341f + shifter) - shifter;
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  memcpy(&scale, &bits, 4);
  return p * scale;
}

inline float silu(float x) { return x / (1.0f + exp_poly(-x)); }

// sum of a[i]·b[i] in LANES partial sums, added pairwise at the end (a fixed order for a given n, whatever the
// instruction set; the pairwise tree keeps the reduction's dependency chain at log2(LANES) adds)
inline float dot(const float* a, const float* b, int64_t n) {
  float acc[LANES] = {0};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int l = 0; l < LANES; ++l) acc[l] += a[i + l] * b[i + l];
  float h8[8], h4[4];
  for (int l = 0; l < 8; ++l) h8[l] = acc[l] + acc[l + 8];
  for (int l = 0; l < 4; ++l) h4[l] = h8[l] + h8[l + 4];
  float sum = (h4[0] + h4[2]) + (h4[1] + h4[3]);
  float tail = 0.0f;  // n % LANES elements (none for the usual head dims)
  for (; i < n; ++i) tail += a[i] * b[i];
  return sum + tail;
}

// 16 floats as one value, held as 16 / W native vectors of W lanes (W = 16 with AVX-512, 8 with AVX2, 4 with the
// baseline's SSE2): one source is explicit SIMD in every variant, and lane l of a 16-float group is the same lane,
// with the same arithmetic, whatever W (so variants differ only where noted). g++ keeps these in registers once
// the always-inline helpers are inlined.
#if defined(__AVX512F__)
constexpr int W = 16;
#elif defined(__AVX__)
constexpr int W = 8;
#else
constexpr int W = 4;
#endif
typedef float vf __attribute__((vector_size(W * 4)));
constexpr int NV = 16 / W;
struct v16 {
  vf p[NV];
};
#define SQ_INLINE inline __attribute__((always_inline))

// one native load / store per vector (a single 64-byte memcpy of the struct is split by g++ into 16-byte moves,
// and the wider loads that follow then stall on store forwarding: 5x slower with AVX2)
SQ_INLINE v16 load16(const float* ptr) {
  v16 v;
  for (int u = 0; u < NV; ++u) memcpy(&v.p[u], ptr + u * W, sizeof(vf));
  return v;
}
SQ_INLINE void store16(float* ptr, const v16& v) {
  for (int u = 0; u < NV; ++u) memcpy(ptr + u * W, &v.p[u], sizeof(vf));
}
// bf16 values (the upper half of an fp32's bits) widened exactly: a bf16-weight linear reads half the bytes and
// computes with the same fp32 values as the widened matrix would
typedef uint16_t vh __attribute__((vector_size(W * 2)));
typedef uint32_t vu __attribute__((vector_size(W * 4)));
SQ_INLINE v16 load16(const uint16_t* ptr) {
  v16 v;
  for (int u = 0; u < NV; ++u) {
    vh h;
    memcpy(&h, ptr + u * W, sizeof(vh));
    const vu bits = __builtin_convertvector(h, vu) << 16;
    memcpy(&v.p[u], &bits, sizeof(vf));
  }
  return v;
}
SQ_INLINE float widen(float x) { return x; }
SQ_INLINE float widen(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}
SQ_INLINE v16 operator+(const v16& a, const v16& b) {
  v16 r;
  for (int u = 0; u < NV; ++u) r.p[u] = a.p[u] + b.p[u];
  return r;
}
SQ_INLINE v16 operator-(const v16& a, const v16& b) {
  v16 r;
  for (int u = 0; u < NV; ++u) r.p[u] = a.p[u] - b.p[u];
  return r;
}
SQ_INLINE v16 operator*(const v16& a, const v16& b) {
  v16 r;
  for (int u = 0; u < NV; ++u) r.p[u] = a.p[u] * b.p[u];
  return r;
}
SQ_INLINE v16 operator*(const v16& a, float b) {
  v16 r;
  for (int u = 0; u < NV; ++u) r.p[u] = a.p[u] * b;
  return r;
}
SQ_INLINE v16 operator*(float b, const v16& a) { return a * b; }
SQ_INLINE v16& operator+=(v16& a, const v16& b) { return a = a + b; }
SQ_INLINE v16 zero16() {
  v16 r;
  for (int u = 0; u < NV; ++u) r.p[u] = vf{} ;
  return r;
}

// the 16 lanes of a, added in dot's order (h8[l] = a[l] + a[l + 8], h4[l] = h8[l] + h8[l + 4], then
// (h4[0] + h4[2]) + (h4[1] + h4[3])), as vector adds of halves: the same adds in the same order as dot's scalar
// tree, without the store and 15 dependent scalar loads a lane-by-lane sum costs per call
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
SQ_INLINE float sum_lanes(const v16& a) {
  vf8 h8;
#if defined(__AVX512F__)
  vf8 lo, hi;
  memcpy(&lo, &a.p[0], 32);
  memcpy(&hi, reinterpret_cast<const char*>(&a.p[0]) + 32, 32);
  h8 = lo + hi;
#elif defined(__AVX__)
  h8 = a.p[0] + a.p[1];
#else
  const vf4 h8lo = a.p[0] + a.p[2], h8hi = a.p[1] + a.p[3];
  const vf4 h4 = h8lo + h8hi;
  return (h4[0] + h4[2]) + (h4[1] + h4[3]);
#endif
#if defined(__AVX__)
  vf4 lo4, hi4;
  memcpy(&lo4, &h8, 16);
  memcpy(&hi4, reinterpret_cast<const char*>(&h8) + 16, 16);
  const vf4 h4 = lo4 + hi4;
  const vf4 h2 = h4 + __builtin_shufflevector(h4, h4, 2, 3, 0, 1);  // (h4[0] + h4[2], h4[1] + h4[3], ...)
  return h2[0] + h2[1];
#endif
}

// sum_lanes of four values at once, out[r] = sum_lanes(a[r]) bit for bit (the same adds of the same lanes in the
// same order, four rows per vector add): four separate trees cost about three times the shuffles and adds, which a
// few-row dot (attention's scores, a 4-row linear) pays once per output. AVX-512 only; elsewhere four sum_lanes.
SQ_INLINE void sum_lanes4(const v16* a, float* out) {
#if defined(__AVX512F__)
  const vf h01 = __builtin_shufflevector(a[0].p[0], a[1].p[0], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                 __builtin_shufflevector(a[0].p[0], a[1].p[0], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                         30, 31);  // [h8 of a0 | h8 of a1]: lane l + lane l + 8
  const vf h23 = __builtin_shufflevector(a[2].p[0], a[3].p[0], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                 __builtin_shufflevector(a[2].p[0], a[3].p[0], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                         30, 31);
  const vf h4 = __builtin_shufflevector(h01, h23, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                __builtin_shufflevector(h01, h23, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const vf h2 = h4 + __builtin_shufflevector(h4, h4, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  const vf h1 = h2 + __builtin_shufflevector(h2, h2, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  for (int r = 0; r < 4; ++r) out[r] = h1[4 * r];
#else
  for (int r = 0; r < 4; ++r) out[r] = sum_lanes(a[r]);
#endif
}

// The largest of x[0..n) (exact in any order, so in 16 lanes: a serial compare-and-select chain costs ~3 cycles an
// element, and g++ does not vectorize it without fast-math's NaN rules), and the sum of x[0..n) as dot sums: 16 lane
// sums in order, the pairwise tree, then the n % 16 tail. A softmax row's max and denominator over its keys.
SQ_INLINE float max_of(const float* x, int64_t n) {
  float m = -INFINITY;
  int64_t i = 0;
  if (n >= LANES) {
    v16 acc = load16(x);
    for (i = LANES; i + LANES <= n; i += LANES) {
      const v16 v = load16(x + i);
      for (int u = 0; u < NV; ++u) acc.p[u] = v.p[u] > acc.p[u] ? v.p[u] : acc.p[u];
    }
    float lanes[LANES];
    store16(lanes, acc);
    for (int l = 0; l < LANES; ++l) m = lanes[l] > m ? lanes[l] : m;
  }
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}
SQ_INLINE float sum_of(const float* x, int64_t n) {
  v16 acc = zero16();
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) acc += load16(x + i);
  float tail = 0.0f;
  for (; i < n; ++i) tail += x[i];
  return sum_lanes(acc) + tail;
}

// dot(q[rr], k, n) for NR query rows at once, bit for bit as dot: k is loaded once for all of them. With
// ahead_k / ahead_q > 0, each 16-float step also prefetches that many floats beyond k / each q[rr] (the linear's
// weight stream: the hardware prefetcher alone left a one-row GEMV at about 2/3 of the streamed bandwidth).
template <int NR, typename TQ = float, typename TK = float>  // TQ, TK: float or uint16_t (bf16, widened exactly)
SQ_INLINE void dot_rows(const TQ* const* q, const TK* k, int64_t n, float* out, int64_t ahead_k = 0,
                        int64_t ahead_q = 0) {
  v16 acc[NR];
  for (int rr = 0; rr < NR; ++rr) acc[rr] = zero16();
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    if (ahead_k) __builtin_prefetch(k + i + ahead_k, 0, 3);
    const v16 kv = load16(k + i);
    for (int rr = 0; rr < NR; ++rr) {
      if (ahead_q) __builtin_prefetch(q[rr] + i + ahead_q, 0, 3);
      acc[rr] += load16(q[rr] + i) * kv;
    }
  }
  float sums[NR];
  if constexpr (NR == 4) {
    sum_lanes4(acc, sums);
  } else {
    for (int rr = 0; rr < NR; ++rr) sums[rr] = sum_lanes(acc[rr]);
  }
  for (int rr = 0; rr < NR; ++rr) {
    float tail = 0.0f;
    for (int64_t c = i; c < n; ++c) tail += widen(q[rr][c]) * widen(k[c]);
    out[rr] = sums[rr] + tail;
  }
}

// Attention for NR (1..ROWS) query rows of one KV head: rows rr see keys [first[rr], last[rr]] (offsets into kb /
// vb, row stride d), s[rr] is k_len floats of scratch. Scores for the keys any row sees, a softmax per row (weight 0
// for the keys the row does not see), then NR x VCHUNK output columns accumulated in registers across the keys.
// Templated on NR so a block of fewer rows (a GQA group of 2 at one query) computes only the rows it has.
template <int NR>
void attend_rows(const float* const* qr, float* const* o, float* const* s, const int64_t* first, const int64_t* last,
                 const float* kb, const float* vb, int64_t d, float scale) {
  int64_t lo = first[0], hi = last[0];
  for (int rr = 1; rr < NR; ++rr) {
    lo = first[rr] < lo ? first[rr] : lo;
    hi = last[rr] > hi ? last[rr] : hi;
  }
  for (int64_t j = lo; j <= hi; ++j) {
    float dots[NR];
    dot_rows<NR>(qr, kb + j * d, d, dots);
    for (int rr = 0; rr < NR; ++rr) s[rr][j] = dots[rr] * scale;
  }
  for (int rr = 0; rr < NR; ++rr) {  // softmax over the row's own keys
    float* sr = s[rr];
    const float m = max_of(sr + first[rr], last[rr] - first[rr] + 1);
    for (int64_t j = first[rr]; j <= last[rr]; ++j) sr[j] = exp_poly(sr[j] - m);  // its own loop: it vectorizes
    const float inv = 1.0f / sum_of(sr + first[rr], last[rr] - first[rr] + 1);
    for (int64_t j = first[rr]; j <= last[rr]; ++j) sr[j] *= inv;
    for (int64_t j = lo; j < first[rr]; ++j) sr[j] = 0.0f;
    for (int64_t j = last[rr] + 1; j <= hi; ++j) sr[j] = 0.0f;
  }
  int64_t c0 = 0;
  for (; c0 + VCHUNK <= d; c0 += VCHUNK) {
    v16 part[NR][VCHUNK / 16];
    for (int rr = 0; rr < NR; ++rr)
      for (int c = 0; c < VCHUNK / 16; ++c) part[rr][c] = zero16();
    for (int64_t j = lo; j <= hi; ++j) {
      v16 vv[VCHUNK / 16];
      for (int c = 0; c < VCHUNK / 16; ++c) vv[c] = load16(vb + j * d + c0 + 16 * c);
      for (int rr = 0; rr < NR; ++rr) {
        const float w = s[rr][j];
        for (int c = 0; c < VCHUNK / 16; ++c) part[rr][c] += w * vv[c];
      }
    }
    for (int rr = 0; rr < NR; ++rr)
      for (int c = 0; c < VCHUNK / 16; ++c) store16(o[rr] + c0 + 16 * c, part[rr][c]);
  }
  for (int rr = 0; rr < NR && c0 < d; ++rr) {  // the d % VCHUNK columns left
    for (int64_t c = c0; c < d; ++c) o[rr][c] = 0.0f;
    for (int64_t j = lo; j <= hi; ++j) {
      const float w = s[rr][j];
      const float* vj = vb + j * d;
      for (int64_t c = c0; c < d; ++c) o[rr][c] += w * vj[c];
    }
  }
}

// 1 / sqrt(mean(x²) + eps), the sum of squares in double (16 lanes): the one reduction of the norms, kept exact
// enough that the result is torch's correctly rounded value or next to it (its own fp32 sum is cascaded)
inline float inv_rms(const float* x, int64_t n, float eps) {
  double acc[LANES] = {0};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int l = 0; l < LANES; ++l) acc[l] += static_cast<double>(x[i + l]) * x[i + l];
  double sum = 0.0;
  for (; i < n; ++i) sum += static_cast<double>(x[i]) * x[i];
  for (int l = 0; l < LANES; ++l) sum += acc[l];
  const float mean = static_cast<float>(sum / static_cast<double>(n));
  return 1.0f / sqrtf(mean + eps);
}

// One head vector of norm_rope (below): o = RoPE(normalize ? x·rsqrt(mean x² + eps)·(w + offset) : x) on its
// first rot dims (c / s: its position's rows of the tables), the rest as normalized; w null: no norm. x and o may
// not overlap.
inline void norm_rope_vector(const float* xv, float* o, int64_t d, const float* w, float offset, float eps,
                             const float* c, const float* s, int64_t rot) {
  if (w) {  // the normalized vector is built in place, then rotated from a copy of its first rot dims
    const float inv = inv_rms(xv, d, eps);
    for (int64_t i = 0; i < d; ++i) o[i] = (xv[i] * inv) * (w[i] + offset);
  } else {
    memcpy(o, xv, sizeof(float) * d);
  }
  if (rot) {
    float rotated[1024];  // rot <= 1024, checked by the callers
    memcpy(rotated, o, sizeof(float) * rot);
    const int64_t half = rot / 2;
    for (int64_t i = 0; i < half; ++i) o[i] = rotated[i] * c[i] + rotated[i + half] * s[i];
    for (int64_t i = half; i < rot; ++i) o[i] = rotated[i] * c[i] + rotated[i - half] * s[i];
  }
}

// One token's write into a K x 16 block of the state: S = d·S + k deltaᵀ. The one copy of this arithmetic, shared by
// delta_step and delta_replay, so that a replayed state equals the stepped one bit for bit.
SQ_INLINE void decay_write(float* s, int64_t kd, int64_t vd, const float* kv, float dec, const v16& delta) {
  for (int64_t i = 0; i < kd; ++i) store16(s + i * vd, load16(s + i * vd) * dec + kv[i] * delta);
}

// Below this much work (multiply-adds, or state updates) a kernel runs on one thread: an OpenMP region's fork and
// join cost more than the work, and a join stalls for a time slice when the other thread is not running (a shared
// machine). linear, walk_state and attention use it; kernels/family.py's PARALLEL_MIN_MACS is the same bound.
constexpr int64_t kParallelMinWork = 1 << 16;

// The walk delta_step and delta_replay share: one task per (batch, value head), the state copied in and carried in
// blocks of 16 columns (K x 16 floats, in L1) through every token, so it is read once and written once.
// token(b, hh, kh, tt, c0, s) does token tt's work on the block s of columns c0.. (value head hh, key head
// kh). Returns 1 for a bad
// shape (t may be 0: the state is copied), else 0.
template <typename Token>
int walk_state(const float* state_in, float* state_out, int64_t batch, int64_t t, int64_t hk, int64_t h, int64_t kd,
               int64_t vd, int threads, const Token& token) {
  if (batch <= 0 || t < 0 || hk <= 0 || h <= 0 || h % hk || kd <= 0 || vd <= 0 || vd % 16) return 1;
  const int64_t tasks = batch * h, per_key = h / hk;
  // one thread below ~64K state updates (a tiny model's decode step): a parallel region's fork and join cost more
  // than the work, and a join stalls for a time slice when the other thread is not running (a shared machine)
  const bool parallel = tasks > 1 && threads > 1 && tasks * (t > 0 ? t : 1) * kd * vd >= kParallelMinWork;
#pragma omp parallel for num_threads(threads) schedule(static) if (parallel)
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t b = task / h, hh = task % h, kh = hh / per_key;
    const float* s_in = state_in + (b * h + hh) * kd * vd;
    float* s_out = state_out + (b * h + hh) * kd * vd;
    for (int64_t c0 = 0; c0 < vd; c0 += 16) {
      for (int64_t i = 0; i < kd; ++i) memcpy(s_out + i * vd + c0, s_in + i * vd + c0, 64);
      for (int64_t tt = 0; tt < t; ++tt) token(b, hh, kh, tt, c0, s_out + c0);
    }
  }
  return 0;
}

}  // namespace

extern "C" {

// y = x·rsqrt(mean(x²) + eps)·(w + offset) per row of dim, optionally ·silu(gate) (GatedRMSNorm), where x is
// in + residual when residual is given (then also written to sum_out, which may alias in). offset 0: RMSNorm, 1:
// Qwen3.5's zero-centred norm. Rows of in / residual / gate / sum_out / y are `stride` floats apart (dim <= stride);
// w is dim floats. Returns 0, or 1 for a bad shape.
int specquant_rms_norm(const float* in, const float* residual, float* sum_out, int64_t rows, int64_t dim,
                       int64_t stride, const float* w, float offset, const float* gate, float eps, float* y,
                       int threads) {
  if (rows < 0 || dim <= 0 || stride < dim) return 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * dim >= (1 << 17) && threads > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = in + r * stride;
    float* out = y + r * stride;
    if (residual) {
      float* s = sum_out + r * stride;
      const float* res = residual + r * stride;
      for (int64_t i = 0; i < dim; ++i) s[i] = x[i] + res[i];
      x = s;
    }
    const float inv = inv_rms(x, dim, eps);
    if (gate) {
      const float* g = gate + r * stride;
      // libm's expf here, not exp_poly: the gate's rounding is what a hybrid's logits are most sensitive to (one
      // gated norm per DeltaNet layer; measured against transformers in tests/test_qwen35_model.py)
      for (int64_t i = 0; i < dim; ++i) out[i] = (x[i] * inv) * (w[i] + offset) * (g[i] / (1.0f + expf(-g[i])));
    } else {
      for (int64_t i = 0; i < dim; ++i) out[i] = (x[i] * inv) * (w[i] + offset);
    }
  }
  return 0;
}

// Per head vector of x [batch, t, heads, d] (strides sb, st, sh; d contiguous): optionally RMSNorm it (normalize:
// x·rsqrt(mean x² + eps)·(w_h + offset), w_h = w + (h % w_rows)·d: one weight for every head, or one per head), then
// rotate its first rot dims by RoPE at its position p < t: y[i] = n[i]·cos[p, i] + n[(i + rot/2) % rot]·sin[p, i]
// (sin: the signed table, model/rope.py), the rest copied. out is [batch, heads, t, d] contiguous: the layout
// attention reads, so no transpose follows. rot even, <= d; cos / sin are [t, rot] contiguous.
int specquant_norm_rope(const float* x, int64_t batch, int64_t t, int64_t heads, int64_t d, int64_t sb,
                        int64_t st, int64_t sh, int normalize, const float* w, int64_t w_rows, float offset,
                        float eps, const float* cos, const float* sin, int64_t rot, float* out, int threads) {
  if (batch <= 0 || t <= 0 || heads <= 0 || d <= 0 || rot < 0 || rot > d || rot > 1024 || rot % 2 ||
      (normalize && w_rows <= 0))
    return 1;
  const int64_t vectors = batch * t * heads;
#pragma omp parallel for num_threads(threads) schedule(static) if (vectors * d >= (1 << 17) && threads > 1)
  for (int64_t n = 0; n < vectors; ++n) {
    const int64_t b = n / (t * heads), p = (n / heads) % t, h = n % heads;
    norm_rope_vector(x + b * sb + p * st + h * sh, out + ((b * heads + h) * t + p) * d, d,
                     normalize ? w + (h % w_rows) * d : nullptr, offset, eps, cos + p * rot, sin + p * rot, rot);
  }
  return 0;
}

// The gated delta rule token by token (model/gated_delta.py's step_rule, its torch twin), for T tokens from
// state_in [batch, H, K, V] into state_out (a separate buffer: the cache keeps the state before): per value head h
// (key head h / (H / Hk)) and token t, with S read before its decay,
//   read_q = S^T q·scale, read_k = S^T k, d = e^g, delta = beta·(v - d·read_k), out = d·read_q + (q·k·scale)·delta,
//   S = d·S + k deltaᵀ.
// q, k [batch, T, Hk, K]; v, out, deltas [batch, T, H, V]; g, beta [batch, T, H]; all contiguous fp32. The state
// is read once and written once (walk_state).
int specquant_delta_step(const float* q, const float* k, const float* v, const float* g, const float* beta,
                         const float* state_in, int64_t batch, int64_t t, int64_t hk, int64_t h, int64_t kd,
                         int64_t vd, float scale, float* state_out, float* out, float* deltas, int threads) {
  if (t <= 0) return 1;
  return walk_state(state_in, state_out, batch, t, hk, h, kd, vd, threads,
                    [&](int64_t b, int64_t hh, int64_t kh, int64_t tt, int64_t c0, float* s) {
    const float* qv = q + ((b * t + tt) * hk + kh) * kd;
    const float* kv = k + ((b * t + tt) * hk + kh) * kd;
    const int64_t gi = (b * t + tt) * h + hh;
    const float dec = exp_poly(g[gi]), bt = beta[gi];
    v16 rq = zero16(), rk = zero16();
    for (int64_t i = 0; i < kd; ++i) {
      const v16 row = load16(s + i * vd);
      rq += row * (qv[i] * scale);
      rk += row * kv[i];
    }
    const float qk = dot(qv, kv, kd) * scale;
    const v16 vv = load16(v + gi * vd + c0);
    const v16 delta = bt * (vv - dec * rk);
    const v16 o = dec * rq + qk * delta;
    store16(out + gi * vd + c0, o);
    if (deltas) store16(deltas + gi * vd + c0, delta);  // null: a prefill keeps no record
    decay_write(s, kd, vd, kv, dec, delta);
  });
}

// The state after the first t tokens of a delta_step record, from the state before them and the record's keys,
// deltas and gates (k [batch, t, Hk, K], deltas [batch, t, H, V], g [batch, t, H], contiguous): the step's own
// state writes replayed in its order, so the result is bit-equal to the state delta_step reached after those t
// tokens (model/gated_delta.py's state_after computes the same sum as one matmul, equal only to rounding). A
// speculative verify rolled back to an accepted prefix so continues on exactly the state a one-token-at-a-time
// decode would hold. Reads the state once and writes it once, as state_after does.
int specquant_delta_replay(const float* state_in, const float* k, const float* deltas, const float* g, int64_t batch,
                           int64_t t, int64_t hk, int64_t h, int64_t kd, int64_t vd, float* state_out,
                           int threads) {
  return walk_state(state_in, state_out, batch, t, hk, h, kd, vd, threads,
                    [&](int64_t b, int64_t hh, int64_t kh, int64_t tt, int64_t c0, float* s) {
    const int64_t gi = (b * t + tt) * h + hh;
    decay_write(s, kd, vd, k + ((b * t + tt) * hk + kh) * kd, exp_poly(g[gi]), load16(deltas + gi * vd + c0));
  });
}

// Gated DeltaNet's gates from its projections a, b [rows, h] (contiguous): beta = sigmoid(b) and
// g = -exp(A_log)·softplus(a + dt_bias) (softplus(x) = x above 20, as torch's), into g_out, beta_out [rows, h]. Each
// element through scalar libm, so a row's gates do not depend on how many rows came with it: torch's vectorized
// sigmoid / softplus round differently from the scalar loop that finishes a tensor, so a one-token decode and a
// verify row differed in the last bit for models with fewer than 32 value heads.
int specquant_delta_gates(const float* a, const float* b, int64_t rows, int64_t h,
                          const float* a_log, const float* dt_bias, float* g_out, float* beta_out) {
  if (rows < 0 || h <= 0) return 1;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < h; ++i) {
      const float x = a[r * h + i] + dt_bias[i];
      const float sp = x > 20.0f ? x : log1pf(expf(x));
      g_out[r * h + i] = -expf(a_log[i]) * sp;
      beta_out[r * h + i] = 1.0f / (1.0f + expf(-b[r * h + i]));
    }
  }
  return 0;
}

// Gated attention's output gate: a[r, h, i] *= sigmoid(gate[r·g_rs + h·g_hs + i]) for rows r < rows, heads h, i <
// d (a contiguous [rows, heads, d]; gate rows and heads strided: the gate halves of a [query | gate] projection).
// Scalar libm expf per element, as the gated norm's gate above. model/gated_attention.py's step and the native layer
// both call this, so their outputs agree bit for bit (torch.sigmoid's vectorized bits cannot be matched from here).
int specquant_sigmoid_mul(float* a, int64_t rows, int64_t heads, int64_t d, const float* gate, int64_t g_rs,
                          int64_t g_hs) {
  if (rows < 0 || heads <= 0 || d <= 0) return 1;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < heads; ++h) {
      float* o = a + (r * heads + h) * d;
      const float* g = gate + r * g_rs + h * g_hs;
      for (int64_t i = 0; i < d; ++i) o[i] = o[i] * (1.0f / (1.0f + expf(-g[i])));
    }
  return 0;
}

// Gated DeltaNet's causal depthwise conv, SiLU and the q / k L2 norms (model/deltanet.py, fast path), for t outputs
// per sequence: hist [batch, rows_in, C] holds each sequence's kernel-1 earlier inputs then its new ones; output n
// reads the kernel rows windows[n·kernel + j] (null: n + j, a chain), conv_n[c] = Σ_j hist[r_j, c]·w[c·kernel + j]
// (w: nn.Conv1d's [C, 1, kernel] weight; summed in j order, one multiply and one add each), then y = silu(conv_n).
// q, k [batch, t, hk, kd] are y's first 2·hk·kd channels, each head vector times 1 / sqrt(Σ x² + eps) (dot's order);
// v [batch, t, C - 2·hk·kd] the rest. kernel <= 8, C <= 32768. A row's result does not depend on the other rows.
int specquant_delta_conv(const float* hist, int64_t batch, int64_t rows_in, int64_t t, int64_t C, const float* w,
                         int64_t kernel, const int64_t* windows, int64_t hk, int64_t kd, float eps, float* q,
                         float* k, float* v, int threads) {
  const int64_t qk = hk * kd, vc = C - 2 * qk;
  if (batch <= 0 || t <= 0 || kernel <= 0 || kernel > 8 || hk <= 0 || kd <= 0 || vc < 0 || C > 32768 ||
      (!windows && rows_in < t + kernel - 1))
    return 1;
  if (windows)
    for (int64_t i = 0; i < t * kernel; ++i)
      if (windows[i] < 0 || windows[i] >= rows_in) return 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (batch * t * C >= (1 << 17) && threads > 1)
  for (int64_t n = 0; n < batch * t; ++n) {
    const int64_t b = n / t, i = n % t;
    const float* rows[8];
    for (int64_t j = 0; j < kernel; ++j)
      rows[j] = hist + (b * rows_in + (windows ? windows[i * kernel + j] : i + j)) * C;
    float y[32768 / 16][16];  // the row's activations, 16 channels at a time (C <= 32768, checked above)
    int64_t c0 = 0;
    for (; c0 + 16 <= C; c0 += 16) {
      float wt[8][16];  // the block's taps, transposed: the channel loops below vectorize
      for (int cc = 0; cc < 16; ++cc)
        for (int64_t j = 0; j < kernel; ++j) wt[j][cc] = w[(c0 + cc) * kernel + j];
      float acc[16];
      for (int cc = 0; cc < 16; ++cc) acc[cc] = rows[0][c0 + cc] * wt[0][cc];
      for (int64_t j = 1; j < kernel; ++j)
        for (int cc = 0; cc < 16; ++cc) acc[cc] = acc[cc] + rows[j][c0 + cc] * wt[j][cc];
      for (int cc = 0; cc < 16; ++cc) y[c0 / 16][cc] = silu(acc[cc]);
    }
    for (; c0 < C; ++c0) {  // C % 16 channels, the same arithmetic one at a time
      float acc = rows[0][c0] * w[c0 * kernel];
      for (int64_t j = 1; j < kernel; ++j) acc = acc + rows[j][c0] * w[c0 * kernel + j];
      y[c0 / 16][c0 % 16] = silu(acc);
    }
    const float* yr = &y[0][0];
    for (int64_t hh = 0; hh < 2 * hk; ++hh) {
      const float* x = yr + hh * kd;
      const float inv = 1.0f / sqrtf(dot(x, x, kd) + eps);
      float* o = (hh < hk ? q + (n * hk + hh) * kd : k + (n * hk + hh - hk) * kd);
      for (int64_t c = 0; c < kd; ++c) o[c] = x[c] * inv;
    }
    memcpy(v + n * vc, yr + 2 * qk, sizeof(float) * vc);
  }
  return 0;
}

}  // extern "C"

namespace {

// dot(x[r], w[j], n) for an MR x NR tile of x rows and weight rows, bit for bit as dot_rows (the same lane-wise
// products and sums per pair; x·w and w·x round alike): each weight vector is loaded (and a bf16 one widened) once
// for MR rows of x, and the MR·NR independent sums keep the adds' latency hidden (-ffp-contract=off: a multiply
// and an add per lane, no FMA). MR·NR accumulators stay in registers: 16 zmm with AVX-512, 4 x 2 ymm with AVX2.
#if defined(__AVX512F__)
constexpr int TILE_M = 4, TILE_N = 4;
#else
constexpr int TILE_M = 2, TILE_N = 2;
#endif
template <int MR, int NR, typename TW>
SQ_INLINE void dot_tile(const float* const* x, const TW* const* w, int64_t n, float (*out)[TILE_N],
                        int64_t ahead = 0) {  // ahead > 0: prefetch that many elements beyond each weight row
  v16 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = zero16();
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    v16 wv[NR];
    for (int j = 0; j < NR; ++j) {
      if (ahead) __builtin_prefetch(w[j] + i + ahead, 0, 3);
      wv[j] = load16(w[j] + i);
    }
    for (int r = 0; r < MR; ++r) {
      const v16 xv = load16(x[r] + i);
      for (int j = 0; j < NR; ++j) acc[r][j] += xv * wv[j];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) {
      float tail = 0.0f;
      for (int64_t c = i; c < n; ++c) tail += widen(x[r][c]) * widen(w[j][c]);
      out[r][j] = sum_lanes(acc[r][j]) + tail;
    }
}

// y[m, n] = x[m, ·] · w[n, ·] (+ bias[n]) for the few fp32 rows of a decode or verify step: x [M, K], w [N, K]
// row-major (nn.Linear's weight), y [M, N]. Each output is dot()'s sum (16 lanes in k order, pairwise at the end;
// x·w and w·x round alike), so a row's result does not depend on M, on the layout below or on the thread count (a
// verify row equals the one-row step bit for bit, which F.linear does not promise). Weight rows are split statically
// over the threads (each streams one contiguous stretch of w), and w comes from DRAM once per step whatever M:
// - while x is small (M <= 4, or all of x fits in L1), weight row by weight row, up to 4 rows of x against each
//   one: w is read as one sequential stream, prefetched LINEAR_AHEAD floats ahead (at 1 thread this streamed 1.4x
//   the bytes per second of the 4-row tiles below; docs/BENCH.md, git history);
// - else in tiles of TILE_N weight rows, every row of x against a tile while it is in L1/L2 (x is read from cache
//   once per tile rather than once per weight row), TILE_M rows of x at a time (dot_tile: a tile's weights are
//   loaded once per TILE_M rows; a block drafter's 16-row block and a wide verify are compute-bound here).
// Why not F.linear: for one row it streams the weight at about half the bandwidth, and barely faster on two threads
// than on one (docs/BENCH.md).
constexpr int64_t LINEAR_AHEAD = 1024;  // floats: 4 KB, one 1024-wide weight row

template <typename TW>  // the weight's element: float, or uint16_t for bf16 (widened exactly; see load16)
int linear(const float* x, int64_t M, int64_t K, const TW* w, int64_t N, const float* bias, float* y, int threads) {
  if (M <= 0 || K <= 0 || N <= 0) return 1;
  const bool parallel = N * K >= kParallelMinWork && threads > 1;
  if (M <= 4 || M * K <= 8192) {
#pragma omp parallel for num_threads(threads) schedule(static) if (parallel)
    for (int64_t n = 0; n < N; ++n) {
      const TW* wn = w + n * K;
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int mr = M - m0 < 4 ? static_cast<int>(M - m0) : 4;
        const float* xr[4];
        float dots[4];
        for (int r = 0; r < mr; ++r) xr[r] = x + (m0 + r) * K;
        const int64_t ahead = m0 == 0 ? LINEAR_AHEAD : 0;  // the later blocks find wn in L1
        switch (mr) {
          case 4: dot_rows<4>(xr, wn, K, dots, ahead); break;
          case 3: dot_rows<3>(xr, wn, K, dots, ahead); break;
          case 2: dot_rows<2>(xr, wn, K, dots, ahead); break;
          default: dot_rows<1>(xr, wn, K, dots, ahead); break;
        }
        for (int r = 0; r < mr; ++r) y[(m0 + r) * N + n] = bias ? dots[r] + bias[n] : dots[r];
      }
    }
    return 0;
  }
  constexpr int NT = TILE_N;
  const int64_t tiles = (N + NT - 1) / NT;
#pragma omp parallel for num_threads(threads) schedule(static) if (parallel)
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const int64_t n0 = tile * NT, nt = N - n0 < NT ? N - n0 : NT;
    const TW* wr[NT];
    for (int j = 0; j < NT; ++j) wr[j] = w + (n0 + (j < nt ? j : nt - 1)) * K;  // a short tile repeats its last row
    for (int64_t m0 = 0; m0 < M; m0 += TILE_M) {
      const int mr = M - m0 < TILE_M ? static_cast<int>(M - m0) : TILE_M;
      const float* xr[TILE_M];
      for (int r = 0; r < mr; ++r) xr[r] = x + (m0 + r) * K;
      float dots[TILE_M][TILE_N];
      const int64_t ahead = m0 == 0 ? NT * K : 0;  // while on the first rows of x, the next tile comes in
      switch (mr) {  // the tile's rows against rows m0.. of x
        case TILE_M: dot_tile<TILE_M, NT>(xr, wr, K, dots, ahead); break;
#if defined(__AVX512F__)
        case 3: dot_tile<3, NT>(xr, wr, K, dots, ahead); break;
        case 2: dot_tile<2, NT>(xr, wr, K, dots, ahead); break;
#endif
        default: dot_tile<1, NT>(xr, wr, K, dots, ahead); break;
      }
      for (int r = 0; r < mr; ++r)
        for (int j = 0; j < nt; ++j) y[(m0 + r) * N + n0 + j] = bias ? dots[r][j] + bias[n0 + j] : dots[r][j];
    }
  }
  return 0;
}

// One projection of a decoder layer as specquant_decoder_layer runs it: y [m, n] = x [m, k]·wᵀ (+ bias), by kind
//   0: linear (w fp32 [n, k]), 1: linear on a bf16 w, 2: a W4 family's GEMM on fp32 x (fn, with kernels/family.py's
//   GEMM_ARGS: packed codes w, scales, group, bf16_scales), 3: the same on x rounded to bf16 (into scratch, as
//   torch's .to(torch.bfloat16) rounds: to nearest, ties to even); a GEMM's bias added after its sum.
// Each is the call the layer's module makes on its own (model.modules.dense_linear, quant/linear.py's native
// backend), on the same thread rule, so every output is the same bit for bit.
typedef int (*GemmFn)(const float* x, int64_t m, int64_t k, const void* packed, const void* scales, int64_t n,
                      int64_t group, int bf16_scales, float* y, int threads);
struct Projection {
  int64_t kind, n, k, group, bf16_scales;
  GemmFn fn;
  const void* w;
  const void* scales;
  const float* bias;
};

// An attention decoder layer (model/decoder.py's DecoderLayer over model/attention.py's Attention or
// model/gated_attention.py's GatedAttention, q/k/v and gate/up fused): shapes, weights and constants, filled once by
// model/native_layer.py (its ctypes twin: kernels/ops.py).
struct LayerPlan {
  int64_t hidden, heads, kv_heads, head_dim, inter, rot, qk_norm_rows;  // qk_norm_rows 0: no q / k norm
  int64_t min_parallel_macs;  // a W4 GEMM below this many multiply-adds runs on one thread (family.PARALLEL_MIN_MACS)
  const float* input_norm;
  const float* post_norm;
  // [qk_norm_rows, head_dim]: a row per q head then per k head, or one row for every head; with k_norm, q's rows
  const float* qk_norm;
  float norm_offset, norm_eps, qk_eps, scale;
  Projection qkv, o, gate_up, down;
  // gated (Qwen3.5): the q projection's row is [query | gate] per head, and the attention output is multiplied by
  // sigmoid(gate) (specquant_sigmoid_mul) before o
  int64_t gated;
  const float* k_norm;  // null: k's norm rows follow q's in qk_norm; else k's own (qk_norm_rows of them)
  float qk_offset;      // the q / k norms' weight offset (1: zero-centred)
};

inline uint16_t to_bf16(float f) {
  uint32_t bits;
  memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// scratch: m·k uint16 for kind 3; min_macs: a W4 GEMM below this runs on one thread (LayerPlan.min_parallel_macs)
int project(int64_t min_macs, const Projection& p, const float* x, int64_t m, float* y, int threads,
            uint16_t* scratch) {
  if (p.kind == 0) return linear(x, m, p.k, static_cast<const float*>(p.w), p.n, p.bias, y, threads);
  if (p.kind == 1) return linear(x, m, p.k, static_cast<const uint16_t*>(p.w), p.n, p.bias, y, threads);
  if ((p.kind != 2 && p.kind != 3) || !p.fn) return 1;
  const void* in = x;
  if (p.kind == 3) {
    for (int64_t i = 0; i < m * p.k; ++i) scratch[i] = to_bf16(x[i]);
    in = scratch;
  }
  const int status = p.fn(static_cast<const float*>(in), m, p.k, p.w, p.scales, p.n, p.group,
                          static_cast<int>(p.bf16_scales), y, m * p.n * p.k >= min_macs ? threads : 1);
  if (status || !p.bias) return status;
  for (int64_t r = 0; r < m; ++r)
    for (int64_t i = 0; i < p.n; ++i) y[r * p.n + i] = y[r * p.n + i] + p.bias[i];
  return 0;
}

}  // namespace

extern "C" {

int specquant_linear(const float* x, int64_t M, int64_t K, const float* w, int64_t N, const float* bias, float* y,
                     int threads) {
  return linear(x, M, K, w, N, bias, y, threads);
}

// the same with a bf16 weight (its raw 16-bit patterns): half the bytes streamed, each output exactly the fp32
// linear's on the widened weight
int specquant_linear_bf16w(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, const float* bias,
                           float* y, int threads) {
  return linear(x, M, K, w, N, bias, y, threads);
}

// y[r, i] = silu(gu[r, i]) · gu[r, f + i] for rows of gu 2f floats long (a fused gate_up projection's output);
// y is [rows, f].
int specquant_swiglu(const float* gu, int64_t rows, int64_t f, float* y, int threads) {
  if (rows < 0 || f <= 0) return 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * f >= (1 << 17) && threads > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gu + r * 2 * f;
    const float* u = g + f;
    float* out = y + r * f;
    for (int64_t i = 0; i < f; ++i) out[i] = silu(g[i]) * u[i];
  }
  return 0;
}

// Softmax attention of t queries per head over k_len cached keys, GQA: query head h reads KV head h / (heads /
// kv_heads). q is [batch, heads, t, d] with the given batch / head / position strides (d contiguous); keys and
// values are [batch, kv_heads, >= k_len, d] with batch / head strides and position stride d (a cache's buffer);
// out is [batch, t, heads, d] contiguous (what o_proj reads, so no transpose follows). Query i is at position
// q_pos + i, key j at k_pos + j; a query sees the keys at positions <= its own and, with window > 0, > its own -
// window. block != 0 (a block drafter's queries, model/block_draft.py): every query also sees the whole block of
// queries, keys q_pos .. q_pos + t - 1, which the window does not cut. Every head of one KV head and every query
// position is done by one task (one thread), row by row, so the KV head's keys and values come from DRAM once and
// from cache for the other rows. Returns 0, 1 for a bad shape, 2 when a query sees no key, 3 when out of memory.
int specquant_attention(const float* q, int64_t batch, int64_t heads, int64_t t, int64_t d, int64_t q_sb,
                        int64_t q_sh, int64_t q_st, const float* keys, const float* values, int64_t kv_heads,
                        int64_t k_len, int64_t kv_sb, int64_t kv_sh, int64_t q_pos, int64_t k_pos, int64_t window,
                        int64_t block, float scale, float* out, int threads) {
  if (batch <= 0 || heads <= 0 || t <= 0 || d <= 0 || kv_heads <= 0 || heads % kv_heads || k_len <= 0) return 1;
  const int64_t group = heads / kv_heads, rows = group * t, tasks = batch * kv_heads;
  // the first and last key position query p sees (both must exist)
  auto lowest = [&](int64_t p) {
    const int64_t lo = window > 0 && p - window + 1 > k_pos ? p - window + 1 : k_pos;
    return block && lo > q_pos ? q_pos : lo;
  };
  auto highest = [&](int64_t p) {
    const int64_t hi = block ? q_pos + t - 1 : p;
    return hi < k_pos + k_len - 1 ? hi : k_pos + k_len - 1;
  };
  if (block && q_pos + t > k_pos + k_len) return 2;  // the block's own keys must all be there
  for (int64_t i = 0; i < t; ++i) {
    const int64_t p = q_pos + i;
    if (p < k_pos || lowest(p) > k_pos + k_len - 1) return 2;
  }
  int status = 0;
  // one thread below ~64K multiply-adds (scores and values over every key; a tiny model's decode step), as
  // walk_state above: the fork and join would cost more than the work
  const bool parallel = tasks > 1 && threads > 1 && tasks * rows * k_len * d >= kParallelMinWork;
#pragma omp parallel for num_threads(threads) schedule(static) if (parallel)
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t b = task / kv_heads, kvh = task % kv_heads;
    const float* kb = keys + b * kv_sb + kvh * kv_sh;
    const float* vb = values + b * kv_sb + kvh * kv_sh;
    float* sbuf = static_cast<float*>(malloc(sizeof(float) * ROWS * k_len));  // ROWS rows' scores, then weights
    if (!sbuf) {
#pragma omp atomic write
      status = 3;
      continue;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += ROWS) {  // up to ROWS query rows share each key and value row loaded
      const int nr = rows - r0 < ROWS ? static_cast<int>(rows - r0) : ROWS;
      const float* qr[ROWS];
      float* o[ROWS];
      float* s[ROWS];
      int64_t first[ROWS], last[ROWS];
      for (int rr = 0; rr < nr; ++rr) {
        const int64_t r = r0 + rr;
        const int64_t h = kvh * group + r / t, i = r % t, p = q_pos + i;
        first[rr] = lowest(p) - k_pos;  // row r sees keys [first, last]
        last[rr] = highest(p) - k_pos;
        qr[rr] = q + b * q_sb + h * q_sh + i * q_st;
        o[rr] = out + ((b * t + i) * heads + h) * d;
        s[rr] = sbuf + rr * k_len;
      }
      switch (nr) {
        case 4: attend_rows<4>(qr, o, s, first, last, kb, vb, d, scale); break;
        case 3: attend_rows<3>(qr, o, s, first, last, kb, vb, d, scale); break;
        case 2: attend_rows<2>(qr, o, s, first, last, kb, vb, d, scale); break;
        default: attend_rows<1>(qr, o, s, first, last, kb, vb, d, scale); break;
      }
    }
    free(sbuf);
  }
  return status;
}

}  // extern "C"

namespace {

// A layer's second half, as DecoderLayer.forward runs it after the mixer: x2 = x + mixed, h = post_norm(x2),
// out = x2 + down(swiglu(gate_up(h))). Scratch: x2, h [rows, hidden], gu [rows, 2·inter], s [rows, inter], bf.
int mlp_tail(const float* x, const float* mixed, int64_t rows, int64_t H, int64_t F, const float* post_norm,
             float offset, float eps, const Projection& gate_up, const Projection& down, int64_t min_macs, float* x2,
             float* h, float* gu, float* s, uint16_t* bf, float* out, int threads) {
  if (gate_up.k != H || gate_up.n != 2 * F || down.k != F || down.n != H) return 1;
  int status = specquant_rms_norm(x, mixed, x2, rows, H, H, post_norm, offset, nullptr, eps, h, threads);
  if (status || (status = project(min_macs, gate_up, h, rows, gu, threads, bf))) return status;
  if ((status = specquant_swiglu(gu, rows, F, s, threads)) ||
      (status = project(min_macs, down, s, rows, out, threads, bf)))
    return status;
  for (int64_t i = 0; i < rows * H; ++i) out[i] = x2[i] + out[i];
  return 0;
}

}  // namespace

extern "C" {

// A whole attention decoder layer for t positions in one call: x [batch, t, hidden] at positions q_pos.. -> out (same
// shape), the sequence of calls the layer's modules make on their own in an eager fp32 step (DecoderLayer.forward):
//   h = input_norm(x); y = qkv(h); q, k = norm_rope(y's q / k heads); k, v -> the cache at q_pos..q_pos+t-1;
//   a = attention(q, cache) (gated: a·sigmoid(y's gate heads)); then mlp_tail on x and o(a),
// each by the same function on the same values, so every output is the modules' bit for bit (tested). The cache's
// buffers are [batch, kv_heads, capacity, head_dim] (batch / head strides kv_sb / kv_sh): a full cache (window 0:
// position p in slot p) or a ring (window W > 0: slot p % capacity, a query sees (p - W, p], and the window's keys
// are gathered in position order before attention, as model/cache.py does). cos / sin [pre_t + t, rot]: the
// positions' rows of the tables, from q_pos - pre_t.
// A block drafter's layer (model/block_draft.py BlockLayer) adds two things: block != 0, its queries see their whole
// block (specquant_attention's block); and pre [batch, pre_t, hidden], context rows at q_pos - pre_t .. q_pos - 1
// whose k and v only are written to the cache, projected by the same qkv call as the block's rows (no input norm:
// the drafter's hidden_norm made them), so the layer's weights stream once for both.
// work: layer_work(plan, batch·(pre_t + t)) floats (kernels/ops.py), the layout below, plus
// 2·batch·kv_heads·capacity·head_dim for a ring. Returns 0, 1 for a bad shape (or a projection's status), 2 from
// attention.
int specquant_decoder_layer(const LayerPlan* plan, const float* x, int64_t batch, int64_t t, int64_t q_pos,
                            const float* pre, int64_t pre_t, int64_t block, const float* cos, const float* sin,
                            float* cache_k, float* cache_v, int64_t kv_sb, int64_t kv_sh, int64_t capacity,
                            int64_t window, float* work, float* out, int threads) {
  const LayerPlan& L = *plan;
  const int64_t H = L.hidden, d = L.head_dim, nq = L.heads, nkv = L.kv_heads, F = L.inter, rows = batch * t;
  const int64_t all = rows + batch * pre_t;  // the block's rows, then the context rows (h, y)
  const int64_t qw = L.gated ? 2 * d : d;  // one q head's columns in a row of the fused projection (and its gate)
  const int64_t width = nq * qw + 2 * nkv * d;  // one row of the fused q / k / v projection
  const bool ring = window > 0;
  if (batch <= 0 || t <= 0 || pre_t < 0 || (pre_t && !pre) || q_pos - pre_t < 0 ||
      (ring ? window + t - 1 > capacity || pre_t + t > capacity : q_pos + t > capacity) || nq % nkv || L.rot < 0 ||
      L.rot > d || L.rot > 1024 || L.rot % 2 || L.qkv.n != width || L.qkv.k != H || L.o.k != nq * d || L.o.n != H ||
      (L.k_norm && !L.qk_norm) || L.gate_up.k != H || L.gate_up.n != 2 * F || L.down.k != F || L.down.n != H)
    return 1;
  float* h = work;
  float* y = h + all * H;
  float* q = y + all * width;
  float* a = q + all * nq * d;
  float* ob = a + all * nq * d;
  float* x2 = ob + all * H;
  float* gu = x2 + all * H;
  float* s = gu + all * 2 * F;
  uint16_t* bf = reinterpret_cast<uint16_t*>(s + all * F);  // kind 3's bf16 activations: all·widest floats' room
  const int64_t widest = H > nq * d ? (H > F ? H : F) : (nq * d > F ? nq * d : F);
  int status = specquant_rms_norm(x, nullptr, nullptr, rows, H, H, L.input_norm, L.norm_offset, nullptr, L.norm_eps,
                                  h, threads);
  if (status) return status;
  if (pre_t) memcpy(h + rows * H, pre, sizeof(float) * batch * pre_t * H);
  if ((status = project(L.min_parallel_macs, L.qkv, h, all, y, threads, bf))) return status;
  // head hh of row r (its y row, position i from q_pos - pre_t): q heads into q [batch, heads, t, d], k heads into
  // the cache; the norm weights are q's and k's own (gated attention), or rows of one [q heads; k heads] table
  auto head = [&](const float* yr, int64_t hh, int64_t i, float* o) {
    const float* w = nullptr;
    if (L.k_norm)
      w = (hh < nq ? L.qk_norm : L.k_norm) + ((hh < nq ? hh : hh - nq) % L.qk_norm_rows) * d;
    else if (L.qk_norm_rows)
      w = L.qk_norm + (hh % L.qk_norm_rows) * d;
    const float* xv = yr + (hh < nq ? hh * qw : nq * qw + (hh - nq) * d);
    norm_rope_vector(xv, o, d, w, L.qk_offset, L.qk_eps, cos + i * L.rot, sin + i * L.rot, L.rot);
  };
  auto slot = [&](int64_t position) { return ring ? position % capacity : position; };
  const int64_t vectors = rows * (nq + nkv);
#pragma omp parallel for num_threads(threads) schedule(static) if (vectors * d >= (1 << 17) && threads > 1)
  for (int64_t n = 0; n < vectors; ++n) {
    const int64_t b = n / (t * (nq + nkv)), p = (n / (nq + nkv)) % t, hh = n % (nq + nkv);
    float* o = hh < nq ? q + ((b * nq + hh) * t + p) * d
                       : cache_k + b * kv_sb + (hh - nq) * kv_sh + slot(q_pos + p) * d;
    head(y + (b * t + p) * width, hh, pre_t + p, o);
  }
  for (int64_t n = 0; n < batch * pre_t * nkv; ++n) {  // the context rows' k heads
    const int64_t b = n / (pre_t * nkv), i = (n / nkv) % pre_t, j = n % nkv;
    head(y + (rows + b * pre_t + i) * width, nq + j, i, cache_k + b * kv_sb + j * kv_sh + slot(q_pos - pre_t + i) * d);
  }
  for (int64_t r = 0; r < all; ++r) {  // v as it is
    const bool own = r < rows;
    const int64_t b = own ? r / t : (r - rows) / pre_t;
    const int64_t position = own ? q_pos + r % t : q_pos - pre_t + (r - rows) % pre_t;
    for (int64_t j = 0; j < nkv; ++j)
      memcpy(cache_v + b * kv_sb + j * kv_sh + slot(position) * d, y + r * width + nq * qw + (nkv + j) * d,
             sizeof(float) * d);
  }
  if (ring) {  // the window's keys and values in position order (model/cache.py's ring update, index_select)
    const int64_t first = q_pos - window + 1 > 0 ? q_pos - window + 1 : 0, k_len = q_pos + t - first;
    float* ks = s + all * F + all * widest;  // past the bf16 activations' floats
    float* vs = ks + batch * nkv * k_len * d;
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t j = 0; j < nkv; ++j)
        for (int64_t i = 0; i < k_len; ++i) {
          const int64_t from = b * kv_sb + j * kv_sh + slot(first + i) * d;
          const int64_t to = ((b * nkv + j) * k_len + i) * d;
          memcpy(ks + to, cache_k + from, sizeof(float) * d);
          memcpy(vs + to, cache_v + from, sizeof(float) * d);
        }
    status = specquant_attention(q, batch, nq, t, d, nq * t * d, t * d, d, ks, vs, nkv, k_len, nkv * k_len * d,
                                 k_len * d, q_pos, first, window, block, L.scale, a, threads);
  } else {
    status = specquant_attention(q, batch, nq, t, d, nq * t * d, t * d, d, cache_k, cache_v, nkv, q_pos + t, kv_sb,
                                 kv_sh, q_pos, 0, 0, block, L.scale, a, threads);
  }
  if (!status && L.gated) status = specquant_sigmoid_mul(a, rows, nq, d, y + d, width, qw);
  if (status || (status = project(L.min_parallel_macs, L.o, a, rows, ob, threads, bf))) return status;
  return mlp_tail(x, ob, rows, H, F, L.post_norm, L.norm_offset, L.norm_eps, L.gate_up, L.down, L.min_parallel_macs,
                  x2, h, gu, s, bf, out, threads);
}

// A Gated DeltaNet decoder layer (model/deltanet.py's GatedDeltaNet, fast path, in a DecoderLayer): shapes, weights
// and constants, filled once by model/native_layer.py (its ctypes twin: kernels/ops.py DeltaPlan).
struct DeltaPlan {
  int64_t hidden, inter, key_heads, key_dim, value_heads, value_dim, kernel, min_parallel_macs;
  const float* input_norm;
  const float* post_norm;
  const float* conv;      // nn.Conv1d's weight [conv_dim, 1, kernel]
  const float* a_log;     // [value_heads]
  const float* dt_bias;   // [value_heads]
  const float* out_norm;  // the gated norm's weight [value_dim]
  float norm_offset, norm_eps, out_eps, l2_eps, scale;
  Projection qkv, z, a, b, out, gate_up, down;
};

// The floats of work a deltanet_layer call needs (its layout below), into *floats. Returns 0.
int specquant_deltanet_work(const DeltaPlan* plan, int64_t batch, int64_t t, int64_t* floats) {
  const DeltaPlan& P = *plan;
  const int64_t rows = batch * t, H = P.hidden, F = P.inter, hv = P.value_heads * P.value_dim;
  const int64_t C = 2 * P.key_heads * P.key_dim + hv, qk = P.key_heads * P.key_dim;
  const int64_t widest = H > hv ? (H > F ? H : F) : (hv > F ? hv : F);
  *floats = rows * (3 * H + C + 2 * qk + 5 * hv + 4 * P.value_heads + 3 * F + widest) +
            batch * (P.kernel - 1 + t) * C;
  return 0;
}

// A whole Gated DeltaNet decoder layer for t tokens in one call: x [batch, t, hidden] -> out, the calls the layer's
// modules make on their own in an eager fp32 step (DecoderLayer.forward, GatedDeltaNet.forward with its cache):
//   h = input_norm(x); hist = [conv_in; qkv(h)] per sequence; q, k, v = delta_conv(hist); g, beta =
//   delta_gates(a(h), b(h)); o, S, delta = delta_step(q, k, v, g, beta, state_in); y = out(rms_norm(o, gate z(h)));
//   then mlp_tail on x and y,
// each by the same function on the same values, so every output is the modules' bit for bit (tested). The cache's
// part (DeltaNetCache.begin ran before, in Python): the state after the block into state_out [batch, value_heads,
// K, V] (state_in is kept: it may be the rollback anchor), the conv state after it into conv_out [batch, kernel-1,
// C] (conv_in: the one before; both contiguous), and the rollback record at the block's slot: the t pre-conv inputs
// into rec_hist, q's keys into rec_keys, the deltas into rec_delta, g into rec_g (each pointing at sequence 0's
// first row, sequences rec_*_sb floats apart). work: specquant_deltanet_work floats. Returns 0, or 1 for a bad shape
// (or a projection's status): nothing is written to the cache before every shape has been checked.
int specquant_deltanet_layer(const DeltaPlan* plan, const float* x, int64_t batch, int64_t t, const float* conv_in,
                             const float* state_in, float* conv_out, float* state_out, float* rec_hist,
                             int64_t rec_hist_sb, float* rec_keys, int64_t rec_keys_sb, float* rec_delta,
                             int64_t rec_delta_sb, float* rec_g, int64_t rec_g_sb, float* work, float* out,
                             int threads) {
  const DeltaPlan& P = *plan;
  const int64_t rows = batch * t, H = P.hidden, F = P.inter, hk = P.key_heads, kd = P.key_dim;
  const int64_t nv = P.value_heads, vd = P.value_dim, hv = nv * vd, qk = hk * kd, C = 2 * qk + hv, k1 = P.kernel - 1;
  if (batch <= 0 || t <= 0 || k1 < 0 || P.kernel > 8 || nv % hk || vd % 16 || P.qkv.k != H || P.qkv.n != C ||
      P.z.k != H || P.z.n != hv || P.a.k != H || P.a.n != nv || P.b.k != H || P.b.n != nv || P.out.k != hv ||
      P.out.n != H || P.gate_up.k != H || P.gate_up.n != 2 * F || P.down.k != F || P.down.n != H)
    return 1;
  const int64_t widest = H > hv ? (H > F ? H : F) : (hv > F ? hv : F);
  float* h = work;                                 // rows x H
  float* y = h + rows * H;                         // rows x C: qkv(h)
  float* qn = y + rows * C;                        // rows x qk
  float* kn = qn + rows * qk;                      // rows x qk
  float* v = kn + rows * qk;                       // rows x hv
  float* o = v + rows * hv;                        // rows x hv
  float* deltas = o + rows * hv;                   // rows x hv
  float* z = deltas + rows * hv;                   // rows x hv
  float* gn = z + rows * hv;                       // rows x hv
  float* ga = gn + rows * hv;                      // rows x nv: a(h), then b(h), g, beta
  float* gb = ga + rows * nv;
  float* g = gb + rows * nv;
  float* beta = g + rows * nv;
  float* mo = beta + rows * nv;                    // rows x H
  float* x2 = mo + rows * H;                       // rows x H
  float* gu = x2 + rows * H;                       // rows x 2F
  float* s = gu + rows * 2 * F;                    // rows x F
  uint16_t* bf = reinterpret_cast<uint16_t*>(s + rows * F);  // rows x widest floats' room
  float* hist = s + rows * F + rows * widest;      // batch x (k1 + t) x C
  const int64_t macs = P.min_parallel_macs;
  int status = specquant_rms_norm(x, nullptr, nullptr, rows, H, H, P.input_norm, P.norm_offset, nullptr, P.norm_eps,
                                  h, threads);
  if (status || (status = project(macs, P.qkv, h, rows, y, threads, bf)) ||
      (status = project(macs, P.a, h, rows, ga, threads, bf)) ||
      (status = project(macs, P.b, h, rows, gb, threads, bf)) ||
      (status = project(macs, P.z, h, rows, z, threads, bf)))
    return status;
  for (int64_t b = 0; b < batch; ++b) {  // each sequence's conv window: the conv state, then its new inputs
    memcpy(hist + b * (k1 + t) * C, conv_in + b * k1 * C, sizeof(float) * k1 * C);
    memcpy(hist + (b * (k1 + t) + k1) * C, y + b * t * C, sizeof(float) * t * C);
  }
  if ((status = specquant_delta_conv(hist, batch, k1 + t, t, C, P.conv, P.kernel, nullptr, hk, kd, P.l2_eps, qn, kn,
                                     v, threads)) ||
      (status = specquant_delta_gates(ga, gb, rows, nv, P.a_log, P.dt_bias, g, beta)) ||
      (status = specquant_delta_step(qn, kn, v, g, beta, state_in, batch, t, hk, nv, kd, vd, P.scale, state_out, o,
                                     deltas, threads)))
    return status;
  for (int64_t b = 0; b < batch; ++b) {  // the cache: the record's slots, and the conv state after the block
    memcpy(rec_hist + b * rec_hist_sb, y + b * t * C, sizeof(float) * t * C);
    memcpy(rec_keys + b * rec_keys_sb, kn + b * t * qk, sizeof(float) * t * qk);
    memcpy(rec_delta + b * rec_delta_sb, deltas + b * t * hv, sizeof(float) * t * hv);
    memcpy(rec_g + b * rec_g_sb, g + b * t * nv, sizeof(float) * t * nv);
    memcpy(conv_out + b * k1 * C, hist + (b * (k1 + t) + t) * C, sizeof(float) * k1 * C);
  }
  if ((status = specquant_rms_norm(o, nullptr, nullptr, rows * nv, vd, vd, P.out_norm, 0.0f, z, P.out_eps, gn,
                                   threads)) ||
      (status = project(macs, P.out, gn, rows, mo, threads, bf)))
    return status;
  return mlp_tail(x, mo, rows, H, F, P.post_norm, P.norm_offset, P.norm_eps, P.gate_up, P.down, macs, x2, h, gu, s,
                  bf, out, threads);
}

}  // extern "C"
