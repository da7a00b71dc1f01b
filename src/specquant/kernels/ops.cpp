// The decoder's small fp32 ops, fused: the RMSNorm family (with the residual add before it, or DeltaNet's SiLU gate
// after it), SwiGLU, and attention for a few queries over a K/V cache. kernels/ops.py has the torch reference of
// each and the conditions under which the model calls these; tests/test_native_ops.py compares the two.
//
// Why native: in an eager decode step each of these is 4-10 torch ops of 2-5 us apiece on one-row tensors (the
// dispatcher, not the arithmetic), about a fifth of a 0.6B W4 step, and torch's flash-attention kernel takes
// ~80-250 us for one query over 128 keys per layer. One call here is one ctypes call.
//
// One source for every variant: plain loops written so that g++ vectorizes them (per-lane partial sums, no
// reassociation needed), built with the variant's instruction-set flags (kernels/ops.py VARIANTS) and
// -ffp-contract=off. Results match the torch reference to float rounding, not bit for bit: sums run in 16 lanes
// and exp is the polynomial below (within 2 ulp of expf over the range used). Each row's result does not depend on
// the other rows or the thread count (rows are independent; attention splits work by (batch, KV head) only).
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

namespace {

constexpr int LANES = 16;
constexpr int VCHUNK = 64;  // attention: output columns accumulated together (4 zmm / 8 ymm)

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
    const float mean = dot(x, x, dim) / static_cast<float>(dim);
    const float inv = 1.0f / sqrtf(mean + eps);
    if (gate) {
      const float* g = gate + r * stride;
      for (int64_t i = 0; i < dim; ++i) out[i] = (x[i] * inv) * (w[i] + offset) * silu(g[i]);
    } else {
      for (int64_t i = 0; i < dim; ++i) out[i] = (x[i] * inv) * (w[i] + offset);
    }
  }
  return 0;
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
// window. Every head of one KV head and every query position is done by one task (one thread), row by row, so the
// KV head's keys and values come from DRAM once and from cache for the other rows. Returns 0, 1 for a bad shape, 2 when a query sees no key, 3 when out of memory.
int specquant_attention(const float* q, int64_t batch, int64_t heads, int64_t t, int64_t d, int64_t q_sb,
                        int64_t q_sh, int64_t q_st, const float* keys, const float* values, int64_t kv_heads,
                        int64_t k_len, int64_t kv_sb, int64_t kv_sh, int64_t q_pos, int64_t k_pos, int64_t window,
                        float scale, float* out, int threads) {
  if (batch <= 0 || heads <= 0 || t <= 0 || d <= 0 || kv_heads <= 0 || heads % kv_heads || k_len <= 0) return 1;
  const int64_t group = heads / kv_heads, rows = group * t, tasks = batch * kv_heads;
  for (int64_t i = 0; i < t; ++i) {  // the first and last key each query sees must exist
    const int64_t p = q_pos + i;
    const int64_t lo = window > 0 && p - window + 1 > k_pos ? p - window + 1 : k_pos;
    if (p < k_pos || lo > k_pos + k_len - 1) return 2;
  }
  int status = 0;
#pragma omp parallel for num_threads(threads) schedule(static) if (tasks > 1 && threads > 1)
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t b = task / kv_heads, kvh = task % kv_heads;
    const float* kb = keys + b * kv_sb + kvh * kv_sh;
    const float* vb = values + b * kv_sb + kvh * kv_sh;
    float* s = static_cast<float*>(malloc(sizeof(float) * k_len));  // one row's scores, then its weights
    if (!s) {
#pragma omp atomic write
      status = 3;
      continue;
    }
    for (int64_t r = 0; r < rows; ++r) {  // row by row: its keys and values stream from L1 / L2 after the first
      const int64_t h = kvh * group + r / t, i = r % t, p = q_pos + i;
      const int64_t first = (window > 0 && p - window + 1 > k_pos ? p - window + 1 : k_pos) - k_pos;
      const int64_t last = (p < k_pos + k_len - 1 ? p : k_pos + k_len - 1) - k_pos;  // keys [first, last]
      const float* qr = q + b * q_sb + h * q_sh + i * q_st;
      float m = -INFINITY;
      for (int64_t j = first; j <= last; ++j) {
        s[j] = dot(qr, kb + j * d, d) * scale;
        m = s[j] > m ? s[j] : m;
      }
      float sum = 0.0f;
      for (int64_t j = first; j <= last; ++j) {
        s[j] = exp_poly(s[j] - m);
        sum += s[j];
      }
      const float inv = 1.0f / sum;
      float* o = out + ((b * t + i) * heads + h) * d;
      int64_t c0 = 0;
      for (; c0 + VCHUNK <= d; c0 += VCHUNK) {  // VCHUNK accumulators held in registers across the keys
        float part[VCHUNK] = {0};
        for (int64_t j = first; j <= last; ++j) {
          const float w = s[j];
          const float* vj = vb + j * d + c0;
          for (int l = 0; l < VCHUNK; ++l) part[l] += w * vj[l];
        }
        for (int l = 0; l < VCHUNK; ++l) o[c0 + l] = part[l] * inv;
      }
      if (c0 < d) {
        for (int64_t c = c0; c < d; ++c) o[c] = 0.0f;
        for (int64_t j = first; j <= last; ++j) {
          const float w = s[j];
          const float* vj = vb + j * d;
          for (int64_t c = c0; c < d; ++c) o[c] += w * vj[c];
        }
        for (int64_t c = c0; c < d; ++c) o[c] *= inv;
      }
    }
    free(s);
  }
  return status;
}

}  // extern "C"
