"""The decoder's small fp32 ops as native calls (ops.cpp), each beside its torch reference, for eager CPU steps.

  op            computes                                                   reference here (what the model runs else)
  rms_norm      x·rsqrt(mean x² + eps)·(w + offset) [·silu(gate)],        rms_norm_reference
                after an optional residual add (returned too)
  swiglu        silu(gate)·up from a fused gate_up output [..., 2f]        swiglu_reference
  norm_rope     per head: optional RMSNorm, then RoPE on the first rot     norm_rope_reference
                dims; [b, t, heads, d] -> [b, heads, t, d]
  delta_step    the gated delta rule token by token (state read once)   model/gated_delta.py step_rule
  delta_replay  the state after the first j tokens of a delta_step        delta_replay_reference (gated_delta.py's
                record, bit-equal to the stepped state                    state_after: one matmul)
  delta_gates   DeltaNet's g and beta from in_proj_a / in_proj_b          delta_gates_reference
  delta_conv    DeltaNet's causal depthwise conv, SiLU and q / k L2        delta_conv_reference
                norms, for a chain or a tree's windows
  sigmoid_mul   gated attention's a·sigmoid(gate), in place               sigmoid_mul_reference
  attention     softmax(q·kᵀ·scale, causal and windowed by position)·v,   attention_reference
                GQA, few queries over a K/V cache, out [b, t, heads, d]
  linear        x·wᵀ (+ b) for the few fp32 rows of a decode / verify      F.linear (a bf16 w: F.linear
                step, rows batch- and thread-invariant; w fp32 or bf16     on w widened to fp32)
                (widened exactly in registers: half the bytes streamed)
  decoder_layer a whole attention decoder layer (norms, fused projections   the layer's modules, each
                on their own kernels, q/k norm + RoPE, K/V cache write,    making the calls above itself
                attention, the output gate, SwiGLU, residuals) in one call (model/native_layer.py)
  deltanet_layer a whole Gated DeltaNet decoder layer (norms, projections, the same
                conv, gates, rule, gated norm, the rollback record, MLP)

Why: a one-row eager step runs each of these as 4-10 torch ops of 2-5 us each (dispatch, not arithmetic), and
torch's CPU flash-attention kernel spends about 200 us per layer on one query over 128 cached keys; the profile and
the before / after step times are in docs/BENCH.md ("Smaller CPU wins").

`usable(*tensors)` says when a call may take the native path: fp32 CPU tensors with a contiguous last dimension,
no autograd, not inside torch.compile / torch.export tracing (a compiled or AOT-packaged step keeps the reference
ops, which Inductor fuses itself), and the library built for this CPU. Results match the references to float
rounding, not bit for bit (ops.cpp's comment says why); tests/test_native_ops.py compares every variant this CPU
runs with them. SPECQUANT_NATIVE=off (or a variant list without these) leaves the model on the references.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
import torch.nn.functional as F

from specquant.kernels.build import AVX2_CPU, AVX2_FLAGS, AVX512_CPU, AVX512_FLAGS, Variant
from specquant.kernels.family import Library

_I64, _PTR, _F32, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
VARIANTS = (  # best first; one source, the compiler vectorizes it for each instruction set
    Variant("avx512", "ops.cpp", AVX512_FLAGS, AVX512_CPU),
    Variant("avx2", "ops.cpp", AVX2_FLAGS, AVX2_CPU),
    Variant("portable", "ops.cpp", (), ()),
)
FUNCTIONS = {
    "specquant_rms_norm": [_PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR, _F32, _PTR, _F32, _PTR, _INT],
    "specquant_swiglu": [_PTR, _I64, _I64, _PTR, _INT],
    "specquant_linear": [_PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _INT],
    "specquant_linear_bf16w": [_PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _INT],
    "specquant_norm_rope": [_PTR, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _INT, _PTR, _I64, _F32, _F32, _PTR, _PTR,
                            _I64, _PTR, _INT],
    "specquant_delta_step": [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _F32, _PTR,
                             _PTR, _PTR, _INT],
    "specquant_delta_replay": [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _PTR, _INT],
    "specquant_delta_gates": [_PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR],
    "specquant_attention": [_PTR, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64,
                            _I64, _I64, _I64, _I64, _F32, _PTR, _INT],
    "specquant_decoder_layer": [_PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64,
                                _I64, _I64, _PTR, _PTR, _INT],
    "specquant_sigmoid_mul": [_PTR, _I64, _I64, _I64, _PTR, _I64, _I64],
    "specquant_delta_conv": [_PTR, _I64, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64, _I64, _F32, _PTR, _PTR, _PTR, _INT],
    "specquant_deltanet_work": [_PTR, _I64, _I64, _PTR],
    "specquant_deltanet_layer": [_PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _PTR, _I64,
                                 _PTR, _I64, _PTR, _PTR, _INT],
}
LIBRARY = Library("ops", VARIANTS, FUNCTIONS)


def usable(*tensors: torch.Tensor | None) -> bool:
    """Whether these tensors may go through the native ops (module docstring); None entries are skipped."""
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in tensors)):
        return False
    for t in tensors:
        # is_cpu, not device.type: a step makes ~200 of these checks and device.type builds an object each time
        if t is not None and (t.dtype is not torch.float32 or not t.is_cpu or t.stride(-1) != 1):
            return False
    return LIBRARY.library() is not None


def _check(status: int, name: str, detail: Callable[[], str]):
    """detail is called only on failure: formatting shapes on every call cost ~0.6 us of a ~4 us op."""
    if status:
        raise ValueError(f"native {name} rejected its arguments (status {status}): {detail()}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
             residual: torch.Tensor | None = None, gate: torch.Tensor | None = None,
             variant: Variant | None = None):
    """rms_norm_reference, natively: y (x's shape), or (x + residual, y) when residual is given. x, residual and
    gate contiguous and of one shape."""
    shape, dim = x.shape, x.shape[-1]
    rows = x.numel() // dim
    for t in (residual, gate):
        if t is not None and (t.shape != shape or not t.is_contiguous()):
            raise ValueError(f"rms_norm: residual / gate of shape {tuple(t.shape)} against x {tuple(shape)}")
    x = x.contiguous()
    y = torch.empty(shape, dtype=torch.float32)
    total = torch.empty(shape, dtype=torch.float32) if residual is not None else None
    w = weight.contiguous()
    status = LIBRARY.lib_for(variant).specquant_rms_norm(
        x.data_ptr(), None if residual is None else residual.data_ptr(), None if total is None else total.data_ptr(),
        rows, dim, dim, w.data_ptr(), offset, None if gate is None else gate.data_ptr(), eps, y.data_ptr(),
        torch.get_num_threads())
    _check(status, "rms_norm", lambda: f"rows {rows} dim {dim}")
    return y if residual is None else (total, y)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
                       residual: torch.Tensor | None = None, gate: torch.Tensor | None = None):
    """The torch ops rms_norm fuses, as model/modules.py and model/norms.py write them for fp32."""
    if residual is not None:
        x = x + residual
    w = weight.float() + offset if offset else weight
    y = w * F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    if gate is not None:
        y = y * F.silu(gate.float())
    return y if residual is None else (x, y)


def swiglu(gate_up: torch.Tensor, variant: Variant | None = None) -> torch.Tensor:
    """swiglu_reference, natively; gate_up contiguous [..., 2f] -> [..., f]."""
    f2 = gate_up.shape[-1]
    if f2 % 2 or not gate_up.is_contiguous():
        raise ValueError(f"swiglu takes a contiguous [..., 2f] tensor, got {tuple(gate_up.shape)}")
    rows = gate_up.numel() // f2
    y = torch.empty(*gate_up.shape[:-1], f2 // 2, dtype=torch.float32)
    _check(LIBRARY.lib_for(variant).specquant_swiglu(gate_up.data_ptr(), rows, f2 // 2, y.data_ptr(),
                                                     torch.get_num_threads()),
           "swiglu", lambda: f"shape {tuple(gate_up.shape)}")
    return y


def swiglu_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           variant: Variant | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), natively: x [..., K], weight [N, K] and bias [N] contiguous -> [..., N]. Each
    row's result is the same whatever the other rows or the thread count. A bf16 weight is widened exactly in
    registers: the result is the fp32 linear's on weight.float(), from half the bytes."""
    k, n = x.shape[-1], weight.shape[0]
    if weight.shape[-1] != k or not weight.is_contiguous() or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"linear: x [..., {k}] against weight {tuple(weight.shape)}"
                         + ("" if bias is None else f", bias {tuple(bias.shape)}"))
    x = x.contiguous()
    bias = None if bias is None else bias.contiguous()  # held here: a temporary's pointer would dangle in the call
    y = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    lib = LIBRARY.lib_for(variant)
    fn = lib.specquant_linear_bf16w if weight.dtype is torch.bfloat16 else lib.specquant_linear
    _check(fn(x.data_ptr(), x.numel() // k, k, weight.data_ptr(), n, None if bias is None else bias.data_ptr(),
              y.data_ptr(), torch.get_num_threads()),
           "linear", lambda: f"x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    return y


@torch.library.custom_op("specquant::linear_bf16w", mutates_args=())
def linear_bf16w_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`linear` on a bf16 weight as a torch operator, for torch.compile and AOT packages: a traced step then reads
    the bf16 weight as the eager one does (the reference product, on weight.float(), would write and read an fp32
    copy of the whole matrix every step). Without the library (SPECQUANT_NATIVE=off since), that reference."""
    if LIBRARY.library() is None:
        return F.linear(x, weight.float())
    return linear(x.contiguous(), weight)


@linear_bf16w_op.register_fake
def _(x, weight):
    return x.new_empty(*x.shape[:-1], weight.shape[0], dtype=torch.float32)


def norm_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor | None = None,
              eps: float = 1e-6, offset: float = 0.0, normalize: bool = True,
              variant: Variant | None = None) -> torch.Tensor:
    """norm_rope_reference, natively: x [b, t, heads, d] (any strides with d contiguous), cos / sin [t, rot] (rope
    tables' rows, signed sin), weight [d] or [heads, d] (with normalize) -> [b, heads, t, d] contiguous."""
    b, t, heads, d = x.shape
    rot = cos.shape[-1]
    cos, sin = cos.contiguous(), sin.contiguous()
    w = None
    if normalize:
        w = weight.contiguous()
        if w.shape[-1] != d or w.numel() not in (d, heads * d):
            raise ValueError(f"norm_rope: weight {tuple(weight.shape)} for {heads} heads of {d}")
    if cos.shape != (t, rot) or sin.shape != (t, rot):
        raise ValueError(f"norm_rope: cos / sin {tuple(cos.shape)} / {tuple(sin.shape)} for {t} positions")
    out = torch.empty(b, heads, t, d, dtype=torch.float32)
    status = LIBRARY.lib_for(variant).specquant_norm_rope(
        x.data_ptr(), b, t, heads, d, x.stride(0), x.stride(1), x.stride(2), int(normalize),
        None if w is None else w.data_ptr(), 0 if w is None else w.numel() // d, offset, eps, cos.data_ptr(),
        sin.data_ptr(), rot, out.data_ptr(), torch.get_num_threads())
    _check(status, "norm_rope", lambda: f"x {tuple(x.shape)}, rot {rot}")
    return out


def norm_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor | None = None,
                        eps: float = 1e-6, offset: float = 0.0, normalize: bool = True) -> torch.Tensor:
    """The torch ops norm_rope fuses: model/attention.py's per-head norm, then model/rope.py's apply_rope on the
    first rot dims (gated_attention.apply_partial_rope)."""
    d, rot = x.shape[-1], cos.shape[-1]
    if normalize:
        w = weight.float() + offset if offset else weight
        x = w * F.rms_norm(x.float(), (d,), None, eps)
    x = x.transpose(1, 2)
    head = x[..., :rot]
    head = head * cos + head.roll(rot // 2, -1) * sin
    return (head if rot == d else torch.cat([head, x[..., rot:]], -1)).contiguous()


def delta_step(q, k, v, g, beta, state, scale: float, variant: Variant | None = None, keep_delta: bool = True):
    """model/gated_delta.py's step_rule natively, for T >= 1 tokens: q, k [b, T, key_heads, K], v [b, T, heads, V],
    g, beta [b, T, heads], state [b, heads, K, V] (not modified) -> (out [b, T, heads, V], new state, delta [b, T,
    heads, V], or None with keep_delta=False: a prefill's, which no rollback reads), all fp32. V must be a multiple
    of 16."""
    b, t, hk, kd = q.shape
    h, vd = v.shape[2], v.shape[3]
    args = [a.contiguous() for a in (q, k, v, g, beta, state)]
    new_state = torch.empty_like(args[5])
    out = torch.empty(b, t, h, vd)
    delta = torch.empty(b, t, h, vd) if keep_delta else None
    status = LIBRARY.lib_for(variant).specquant_delta_step(*(a.data_ptr() for a in args), b, t, hk, h, kd, vd, scale,
                                                new_state.data_ptr(), out.data_ptr(),
                                                None if delta is None else delta.data_ptr(), torch.get_num_threads())
    _check(status, "delta_step", lambda: f"q {tuple(q.shape)}, v {tuple(v.shape)}")
    return out, new_state, delta


def delta_replay(state, k, delta, g, variant: Variant | None = None) -> torch.Tensor:
    """The state after the tokens of a delta_step record, from the state before them: state [b, heads, K, V]
    (not modified), k [b, j, key_heads, K], delta [b, j, heads, V], g [b, j, heads], fp32 -> new state. Bit-equal
    to the state delta_step returned after those j tokens (ops.cpp says why); V a multiple of 16."""
    b, h, kd, vd = state.shape
    args = [a.contiguous() for a in (state, k, delta, g)]
    out = torch.empty_like(args[0])
    status = LIBRARY.lib_for(variant).specquant_delta_replay(*(a.data_ptr() for a in args), b, k.shape[1], k.shape[2],
                                                             h, kd, vd, out.data_ptr(), torch.get_num_threads())
    _check(status, "delta_replay",
           lambda: f"state {tuple(state.shape)}, k {tuple(k.shape)}, delta {tuple(delta.shape)}")
    return out


def delta_replay_reference(state, k, delta, g) -> torch.Tensor:
    """delta_replay in torch, token by token: S = e^g S + k deltaᵀ per value head (key heads grouped)."""
    heads = delta.shape[2]
    keys = k.repeat_interleave(heads // k.shape[2], dim=2)
    for t in range(k.shape[1]):
        state = state * g[:, t].exp()[..., None, None] + keys[:, t, :, :, None] * delta[:, t, :, None, :]
    return state


def delta_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                variant: Variant | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) = (-exp(a_log)·softplus(a + dt_bias), sigmoid(b)) for a, b [..., heads] fp32, each element alike
    whatever the tensor's size (ops.cpp says why torch's are not)."""
    h = a.shape[-1]
    if b.shape != a.shape or a_log.shape != (h,) or dt_bias.shape != (h,):
        raise ValueError(f"delta_gates: a {tuple(a.shape)}, b {tuple(b.shape)}, A_log {tuple(a_log.shape)}, "
                         f"dt_bias {tuple(dt_bias.shape)}")
    a, b, a_log, dt_bias = (x.contiguous() for x in (a, b, a_log, dt_bias))
    g, beta = torch.empty_like(a), torch.empty_like(a)
    _check(LIBRARY.lib_for(variant).specquant_delta_gates(a.data_ptr(), b.data_ptr(), a.numel() // h, h,
                                                          a_log.data_ptr(), dt_bias.data_ptr(), g.data_ptr(),
                                                          beta.data_ptr()),
           "delta_gates", lambda: f"a {tuple(a.shape)}")
    return g, beta


def delta_gates_reference(a, b, a_log, dt_bias) -> tuple[torch.Tensor, torch.Tensor]:
    return -a_log.float().exp() * F.softplus(a.float() + dt_bias.float()), b.sigmoid().float()


CONV_MAX_KERNEL, CONV_MAX_CHANNELS = 8, 32768  # delta_conv's bounds (ops.cpp)


def delta_conv_fits(kernel: int, channels: int) -> bool:
    return kernel <= CONV_MAX_KERNEL and channels <= CONV_MAX_CHANNELS


def delta_conv(hist: torch.Tensor, weight: torch.Tensor, key_heads: int, key_dim: int, t: int,
               windows: torch.Tensor | None = None, eps: float = 1e-6,
               variant: Variant | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """delta_conv_reference, natively: hist [b, R, C] fp32 (each sequence's kernel-1 earlier inputs, then its new
    ones), weight nn.Conv1d's [C, 1, kernel]; t outputs per sequence, output n from the rows windows[n] ([t, kernel]
    int64; None: n .. n + kernel - 1) -> (q, k [b, t, key_heads, key_dim] L2-normalised, v [b, t, C - 2 qk])."""
    b, rows_in, c = hist.shape
    kernel = weight.shape[-1]
    qk = key_heads * key_dim
    if weight.shape != (c, 1, kernel) or c < 2 * qk or (windows is not None and windows.shape != (t, kernel)):
        raise ValueError(f"delta_conv: hist {tuple(hist.shape)}, weight {tuple(weight.shape)}, {key_heads} key heads "
                         f"of {key_dim}" + ("" if windows is None else f", windows {tuple(windows.shape)}"))
    hist, w = hist.contiguous(), weight.contiguous()
    win = None if windows is None else windows.to(torch.int64).contiguous()
    q, k = torch.empty(b, t, key_heads, key_dim), torch.empty(b, t, key_heads, key_dim)
    v = torch.empty(b, t, c - 2 * qk)
    _check(LIBRARY.lib_for(variant).specquant_delta_conv(
        hist.data_ptr(), b, rows_in, t, c, w.data_ptr(), kernel, None if win is None else win.data_ptr(), key_heads,
        key_dim, eps, q.data_ptr(), k.data_ptr(), v.data_ptr(), torch.get_num_threads()),
           "delta_conv", lambda: f"hist {tuple(hist.shape)}, weight {tuple(weight.shape)}, t {t}")
    return q, k, v


def delta_conv_reference(hist, weight, key_heads: int, key_dim: int, t: int, windows=None, eps: float = 1e-6):
    """delta_conv in torch: model/deltanet.py's fast path wherever the native call does not run (the conv as kernel
    multiply-adds in fp32, or float64 for a double model; SiLU; q's and k's heads L2-normalised in fp32, as
    gated_delta.l2_normalize). Why not F.conv1d: oneDNN's depthwise conv costs several times its arithmetic at
    decode sizes (one output per channel), and a bf16 one rounds its output; the reference form (fast=False) runs it.
    Returns (q, k, v [b, t, C - 2 qk]) like delta_conv."""
    b = hist.shape[0]
    kernel, qk = weight.shape[-1], key_heads * key_dim
    taps = ([hist[:, j : j + t] for j in range(kernel)] if windows is None
            else [hist.index_select(1, windows[:, j]) for j in range(kernel)])
    dtype = torch.promote_types(hist.dtype, torch.float32)
    # w [kernel, C], a transposed view: each tap is a strided vector (a kept contiguous copy measured ~2 us faster
    # per multiply-add, 0.2 ms of a 4B step: not worth a cache that must follow the weight)
    w = weight.to(dtype)[:, 0].t()
    out = taps[0].to(dtype) * w[0]
    for j in range(1, kernel):
        out = out.addcmul_(taps[j].to(dtype), w[j])
    y = F.silu(out)  # [b, t, C], contiguous: the norms' sums run over contiguous rows, alike for any t
    heads = y[..., : 2 * qk].reshape(b, t, 2 * key_heads, key_dim).float()
    heads = heads * torch.rsqrt((heads * heads).sum(-1, keepdim=True) + eps)
    return heads[:, :, :key_heads], heads[:, :, key_heads:], y[..., 2 * qk :]


def sigmoid_mul(a: torch.Tensor, gate: torch.Tensor, variant: Variant | None = None) -> torch.Tensor:
    """a·sigmoid(gate), natively, in place on a: a [..., heads, d] contiguous, gate of a's shape, any strides (the
    gate halves of a [query | gate] projection are read where they are). Returns a."""
    heads, d = a.shape[-2:]
    if gate.shape != a.shape or not a.is_contiguous():
        raise ValueError(f"sigmoid_mul: a {tuple(a.shape)} (contiguous), gate {tuple(gate.shape)}")
    rows = a.numel() // (heads * d)
    g = gate.reshape(rows, heads, d)  # a view where the rows are evenly strided, as a projection's are
    if g.stride(-1) != 1:
        g = g.contiguous()
    _check(LIBRARY.lib_for(variant).specquant_sigmoid_mul(a.data_ptr(), rows, heads, d, g.data_ptr(), g.stride(0),
                                                          g.stride(1)),
           "sigmoid_mul", lambda: f"a {tuple(a.shape)}")
    return a


def sigmoid_mul_reference(a: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return a * torch.sigmoid(gate)


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_pos: int, k_pos: int,
              window: int | None, scale: float | None = None, variant: Variant | None = None,
              block: bool = False) -> torch.Tensor:
    """attention_reference, natively. q [b, heads, t, d] (any strides with d contiguous); keys, values [b, kv_heads,
    S, d] with S >= the keys used and position stride d (a K/V cache buffer or a slice of its positions): key j is at
    position k_pos + j, for j < k_len = q_pos + t - k_pos. block: every query also sees all t queries' own keys (a
    block drafter's block). Returns [b, t, heads, d] contiguous."""
    b, heads, t, d = q.shape
    kv_heads = keys.shape[1]
    k_len = q_pos + t - k_pos
    if (keys.shape[0] != b or keys.shape[-1] != d or keys.stride(2) != d or values.stride() != keys.stride()
            or values.shape != keys.shape or keys.shape[2] < k_len or heads % kv_heads):
        raise ValueError(f"attention: q {tuple(q.shape)} against keys {tuple(keys.shape)} / values "
                         f"{tuple(values.shape)} (strides {keys.stride()} / {values.stride()}), {k_len} keys")
    out = torch.empty(b, t, heads, d, dtype=torch.float32)
    status = LIBRARY.lib_for(variant).specquant_attention(
        q.data_ptr(), b, heads, t, d, q.stride(0), q.stride(1), q.stride(2), keys.data_ptr(), values.data_ptr(),
        kv_heads, k_len, keys.stride(0), keys.stride(1), q_pos, k_pos, window or 0, int(block),
        d ** -0.5 if scale is None else scale, out.data_ptr(), torch.get_num_threads())
    _check(status, "attention", lambda: f"q {tuple(q.shape)} at {q_pos}, {k_len} keys from {k_pos}, window {window}")
    return out


def attention_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_pos: int, k_pos: int,
                        window: int | None, scale: float | None = None, block: bool = False) -> torch.Tensor:
    """SDPA with enable_gqa under the position mask (causal, windowed; block: the queries' own keys all visible):
    [b, t, heads, d]."""
    t = q.shape[2]
    k_len = q_pos + t - k_pos
    qp = torch.arange(q_pos, q_pos + t)[:, None]
    kp = torch.arange(k_pos, k_pos + k_len)[None, :]
    mask = (kp <= qp) & ((kp > qp - window) if window else True)
    if block:
        mask = mask | (kp >= q_pos)
    out = F.scaled_dot_product_attention(q, keys[:, :, :k_len], values[:, :, :k_len], attn_mask=mask,
                                         enable_gqa=keys.shape[1] != q.shape[1], scale=scale)
    return out.transpose(1, 2).contiguous()


class Projection(ctypes.Structure):
    """ops.cpp's Projection: one fused projection of a decoder_layer plan. kind 0: fp32 weight [n, k] (linear),
    1: bf16 weight, 2: a W4 family's GEMM `fn` (kernels/family.py GEMM_ARGS) on packed codes `w` and `scales`, 3:
    the same on activations rounded to bf16 (w4_bf16's)."""
    _fields_ = [("kind", _I64), ("n", _I64), ("k", _I64), ("group", _I64), ("bf16_scales", _I64), ("fn", _PTR),
                ("w", _PTR), ("scales", _PTR), ("bias", _PTR)]


class LayerPlan(ctypes.Structure):
    """ops.cpp's LayerPlan: an attention decoder layer's shapes, weights and constants (model/native_layer.py fills
    it). gated: Qwen3.5's gated attention ([query | gate] per head, own q / k norms: qk_norm is q's, k_norm k's)."""
    _fields_ = [("hidden", _I64), ("heads", _I64), ("kv_heads", _I64), ("head_dim", _I64), ("inter", _I64),
                ("rot", _I64), ("qk_norm_rows", _I64), ("min_parallel_macs", _I64), ("input_norm", _PTR),
                ("post_norm", _PTR), ("qk_norm", _PTR), ("norm_offset", _F32), ("norm_eps", _F32), ("qk_eps", _F32),
                ("scale", _F32), ("qkv", Projection), ("o", Projection), ("gate_up", Projection),
                ("down", Projection), ("gated", _I64), ("k_norm", _PTR), ("qk_offset", _F32)]


class DeltaPlan(ctypes.Structure):
    """ops.cpp's DeltaPlan: a Gated DeltaNet decoder layer's shapes, weights and constants (model/native_layer.py)."""
    _fields_ = [("hidden", _I64), ("inter", _I64), ("key_heads", _I64), ("key_dim", _I64), ("value_heads", _I64),
                ("value_dim", _I64), ("kernel", _I64), ("min_parallel_macs", _I64), ("input_norm", _PTR),
                ("post_norm", _PTR), ("conv", _PTR), ("a_log", _PTR), ("dt_bias", _PTR), ("out_norm", _PTR),
                ("norm_offset", _F32), ("norm_eps", _F32), ("out_eps", _F32), ("l2_eps", _F32), ("scale", _F32),
                ("qkv", Projection), ("z", Projection), ("a", Projection), ("b", Projection), ("out", Projection),
                ("gate_up", Projection), ("down", Projection)]


def dense_projection(weight: torch.Tensor, bias: torch.Tensor | None) -> Projection | None:
    """The Projection of a dense fp32 or bf16 weight [n, k] (what `linear` takes), or None for another one."""
    if (weight.dtype not in (torch.float32, torch.bfloat16) or not weight.is_contiguous() or not weight.is_cpu
            or (bias is not None and (bias.dtype is not torch.float32 or not bias.is_contiguous()))):
        return None
    return Projection(kind=0 if weight.dtype is torch.float32 else 1, n=weight.shape[0], k=weight.shape[1],
                      w=weight.data_ptr(), bias=None if bias is None else bias.data_ptr())


def layer_work(plan: LayerPlan, rows: int, ring_keys: int = 0) -> int:
    """Floats of scratch a decoder_layer call of this many rows (batch x positions) needs; ring_keys: a ring cache's
    batch x capacity (its window's keys and values are gathered there)."""
    width = ((2 if plan.gated else 1) * plan.heads + 2 * plan.kv_heads) * plan.head_dim
    widest = max(plan.hidden, plan.heads * plan.head_dim, plan.inter)  # a bf16-activation GEMM's rounded input
    return (rows * (3 * plan.hidden + width + 2 * plan.heads * plan.head_dim + 3 * plan.inter + widest)
            + 2 * ring_keys * plan.kv_heads * plan.head_dim)


def decoder_layer(plan: LayerPlan, x: torch.Tensor, q_pos: int, cos: torch.Tensor, sin: torch.Tensor,
                  keys: torch.Tensor, values: torch.Tensor, work: torch.Tensor, window: int | None = None,
                  variant: Variant | None = None, address: int | None = None, pre: torch.Tensor | None = None,
                  block: bool = False) -> torch.Tensor:
    """A dense decoder layer's step in one call (ops.cpp specquant_decoder_layer): x [b, t, hidden] contiguous at
    positions q_pos.. -> the layer's output, writing its k, v into keys / values [b, kv_heads, capacity, d] (a full
    cache's buffers, or a ring's with its window) at q_pos..; cos / sin [p + t, rot] contiguous, from position
    q_pos - p; work at least layer_work(plan, b * (p + t)) floats (a ring: layer_work(plan, b * (p + t),
    b * capacity)). A block drafter's layer: pre [b, p, hidden] contiguous, context rows whose k, v only go to the
    cache at q_pos - p.., and block, its queries see their whole block. The caller holds every tensor the plan
    points at. address: ctypes.addressof(plan), when the caller keeps it."""
    b, t, _ = x.shape
    p = 0 if pre is None else pre.shape[1]
    out = torch.empty_like(x)
    status = LIBRARY.lib_for(variant).specquant_decoder_layer(
        ctypes.addressof(plan) if address is None else address, x.data_ptr(), b, t, q_pos,
        None if pre is None else pre.data_ptr(), p, int(block), cos.data_ptr(), sin.data_ptr(), keys.data_ptr(),
        values.data_ptr(), keys.stride(0), keys.stride(1), keys.shape[2], window or 0, work.data_ptr(),
        out.data_ptr(), torch.get_num_threads())
    _check(status, "decoder_layer", lambda: f"x {tuple(x.shape)} at {q_pos} after {p} context rows, cache "
           f"{tuple(keys.shape)}")
    return out


def deltanet_work(plan: DeltaPlan, batch: int, t: int) -> int:
    """Floats of scratch a deltanet_layer call of batch x t tokens needs (ops.cpp lays it out)."""
    floats = ctypes.c_int64()
    _check(LIBRARY.lib_for(None).specquant_deltanet_work(ctypes.byref(plan), batch, t, ctypes.byref(floats)),
           "deltanet_work", lambda: f"batch {batch}, t {t}")
    return floats.value


def deltanet_layer(plan: DeltaPlan, x: torch.Tensor, conv_in: torch.Tensor, state_in: torch.Tensor,
                   conv_out: torch.Tensor, state_out: torch.Tensor, record: tuple[int, ...], work: torch.Tensor,
                   variant: Variant | None = None, address: int | None = None) -> torch.Tensor:
    """A Gated DeltaNet decoder layer's step in one call (ops.cpp specquant_deltanet_layer): x [b, t, hidden]
    contiguous -> the layer's output; reads conv_in [b, kernel-1, C] and state_in [b, value_heads, K, V]
    (contiguous), writes the state and conv state after the block into state_out / conv_out (contiguous, new) and
    the block's rollback record: record = (address, sequence stride in floats) of the pre-conv inputs, keys, deltas
    and g at the block's slot, flattened (DeltaNetCache.record_at; rows contiguous within each sequence). work:
    deltanet_work(plan, b, t) floats."""
    b, t, _ = x.shape
    out = torch.empty_like(x)
    status = LIBRARY.lib_for(variant).specquant_deltanet_layer(
        ctypes.addressof(plan) if address is None else address, x.data_ptr(), b, t, conv_in.data_ptr(),
        state_in.data_ptr(), conv_out.data_ptr(), state_out.data_ptr(), *record, work.data_ptr(), out.data_ptr(),
        torch.get_num_threads())
    _check(status, "deltanet_layer", lambda: f"x {tuple(x.shape)}, state {tuple(state_in.shape)}")
    return out
