"""A decoder layer's eager fp32 CPU step as one native call (kernels/ops.py decoder_layer, deltanet_layer).

Why: a decode step's layer is some twenty Python-level calls (module calls, views, the cache's slice writes, a
ctypes call per op, each 10-25 us of wrapper around a few us of work), which is most of a small model's step and a
fifth of a 1.7B one's (two fifths of a Qwen3.5 hybrid's, whose DeltaNet layers make more of them); llama.cpp runs the
same layer as one graph. Here the layer's modules describe themselves once (a plan of pointers: kernels/ops.py
LayerPlan, DeltaPlan) and the step is one call that makes the same native calls in the same order on the same
values, so its output is the modules' bit for bit (tests/test_native_layer.py) and a verify row still equals the
one-row step. The speed is in docs/BENCH.md ("One native call per layer").

Layer kinds (KINDS, by mixer type): attention (model/attention.py's Attention, and Qwen3.5's GatedAttention with its
output gate and own q / k norms) over a sliced K/V cache (full or a ring; not the static layout), and Gated DeltaNet
(model/deltanet.py, its fast form) over its cache's eager layout, for blocks it keeps a rollback record of (up to
the cache's max_block). A block drafter's layer (model/block_draft.py BlockLayer, `block_step`, which its propose
calls) is the attention kind with block-wide attention, whose call also writes the K/V of the context rows that came
since the last block: their projection rides on the block's, so the layer's weights stream once per proposal. For
every kind: a DecoderLayer with gate/up fused (and q/k/v, for attention), an fp32 CPU
input of up to NATIVE_ROWS rows, gradients off (no_grad / inference_mode), not compiling, no module hooks
(Transformer.forward calls `step` in place of the layer's module call, so the layer's own hooks count too), and
projections that describe themselves (`native_projection`: a dense fp32 / bf16 Linear, a W4 QuantLinear on a native
kernel). Anything else returns None and the layer runs its modules. `ENABLED = False` turns it off (the tests, and
benchmarks/shapes.py --layer modules|ab).
"""

from __future__ import annotations

import ctypes
import threading
import weakref

import torch
from torch.nn.modules import module as torch_module

from specquant.kernels import ops
from specquant.kernels.family import PARALLEL_MIN_MACS  # a W4 GEMM's one-thread bound, as family.run_gemm's
from specquant.model.attention import Attention
from specquant.model.cache import KVCache
from specquant.model.deltanet import DeltaNetCache, GatedDeltaNet
from specquant.model.gated_attention import GatedAttention
from specquant.model.gated_delta import L2_EPS
from specquant.model.modules import NATIVE_ROWS, RMSNorm
from specquant.model.norms import GatedRMSNorm, ZeroCentredRMSNorm

ENABLED = True
NORMS = (RMSNorm, ZeroCentredRMSNorm)  # the layer norms whose forward is ops.rms_norm with their `offset`
_scratch = threading.local()  # one scratch tensor per thread, grown to the largest call: layers run one at a time
# each layer's plan, beside the layer rather than in it: a copy.deepcopy or pickle of the model never meets the
# ctypes pointers (which cannot be copied, and would point at the original's tensors)
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Plan:
    """A layer's plan (LayerPlan or DeltaPlan), the key of the tensors it points at (rebuilt when one of them moves),
    what it keeps alive, and the scratch floats a call needs: per_row per row (batch x positions) plus per_extra
    per ring slot (attention on a ring: batch x capacity) or per sequence (DeltaNet). plan None: this layer, as the
    key describes it, cannot run natively (kept too, so a step does not try to build it again until the key
    changes)."""

    __slots__ = ("address", "keep", "key", "per_extra", "per_row", "plan")

    def __init__(self, key: tuple, plan=None, keep: tuple = (), per_row: int = 0, per_extra: int = 0):
        self.key, self.plan, self.keep = key, plan, keep
        self.address = None if plan is None else ctypes.addressof(plan)
        self.per_row, self.per_extra = per_row, per_extra


def _hooked(mods) -> bool:
    return bool(torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks) or any(
        m._forward_hooks or m._forward_pre_hooks for m in mods)


# Each step asks for these: module attributes are read from the module's own dicts (_modules, _parameters,
# _buffers), since nn.Module.__getattr__ costs about a microsecond a lookup, and a layer step makes ~25 of them.
def _key(projections, tensors) -> tuple | None:
    """What the plan depends on: which modules, each projection's native_key (None: it cannot describe itself), and
    the other tensors' addresses (norm weights; None entries allowed)."""
    keys = []
    for p in projections:
        fn = getattr(p, "native_key", None)
        k = None if fn is None else fn()
        if k is None:
            return None
        keys.append((id(p), k))
    return (*keys, *(None if t is None else t.data_ptr() for t in tensors))


def _norms_fit(norms) -> bool:
    """The layer's two norms: one kind of ops.rms_norm norm, fp32 contiguous weights, one offset and eps."""
    return all(type(n) in NORMS and n.weight.dtype is torch.float32 and n.weight.is_contiguous()
               and n.offset == norms[0].offset and n.eps == norms[0].eps for n in norms)


def _fp32(*tensors) -> bool:
    return all(t.dtype is torch.float32 and t.is_contiguous() for t in tensors)


def _describe(projections):
    described = [p.native_projection() for p in projections]
    return None if any(p is None for p in described) else described


def _build_attention(attn: Attention, projections, norms, key: tuple, cos: torch.Tensor) -> _Plan:
    gated = type(attn) is GatedAttention
    if gated:  # its own zero-centred q_norm / k_norm weights (one row each)
        qn, kn = attn.q_norm, attn.k_norm
        if (type(qn) is not ZeroCentredRMSNorm or type(kn) is not ZeroCentredRMSNorm or qn.eps != kn.eps
                or not _fp32(qn.weight, kn.weight)):
            return _Plan(key)
        qk, k_norm, qk_rows, qk_eps, qk_offset = qn.weight, kn.weight, 1, qn.eps, qn.offset
    else:  # the fused [heads + kv_heads, d] weight (model/fuse.py), or none
        qk = attn._buffers.get("qk_norm_weight")
        if qk is not None and not _fp32(qk):
            return _Plan(key)
        k_norm, qk_rows, qk_eps, qk_offset = None, 0 if qk is None else qk.numel() // attn.head_dim, attn.eps, 0.0
    described = _describe(projections)
    if not _norms_fit(norms) or described is None:
        return _Plan(key)
    d = attn.head_dim
    plan = ops.LayerPlan(
        hidden=norms[0].weight.shape[0], heads=attn.n_heads, kv_heads=attn.n_kv, head_dim=d, inter=described[3].k,
        rot=cos.shape[-1], qk_norm_rows=qk_rows, min_parallel_macs=PARALLEL_MIN_MACS,
        input_norm=norms[0].weight.data_ptr(), post_norm=norms[1].weight.data_ptr(),
        qk_norm=None if qk is None else qk.data_ptr(), norm_offset=norms[0].offset, norm_eps=norms[0].eps,
        qk_eps=qk_eps, scale=d ** -0.5, qkv=described[0], o=described[1], gate_up=described[2], down=described[3],
        gated=int(gated), k_norm=None if k_norm is None else k_norm.data_ptr(), qk_offset=qk_offset)
    return _Plan(key, plan, (qk, k_norm, *(n.weight for n in norms)), ops.layer_work(plan, 1),
                 ops.layer_work(plan, 0, 1))


def _build_deltanet(mixer: GatedDeltaNet, projections, norms, key: tuple) -> _Plan:
    conv, out_norm = mixer.conv1d.weight, mixer.norm
    described = _describe(projections)
    if (not _norms_fit(norms) or described is None or type(out_norm) is not GatedRMSNorm
            or not _fp32(conv, mixer.A_log, mixer.dt_bias, out_norm.weight) or mixer.value_dim % 16
            or not ops.delta_conv_fits(mixer.kernel, mixer.conv_dim)):
        return _Plan(key)
    plan = ops.DeltaPlan(
        hidden=norms[0].weight.shape[0], inter=described[6].k, key_heads=mixer.key_heads, key_dim=mixer.key_dim,
        value_heads=mixer.value_heads, value_dim=mixer.value_dim, kernel=mixer.kernel,
        min_parallel_macs=PARALLEL_MIN_MACS, input_norm=norms[0].weight.data_ptr(),
        post_norm=norms[1].weight.data_ptr(), conv=conv.data_ptr(), a_log=mixer.A_log.data_ptr(),
        dt_bias=mixer.dt_bias.data_ptr(), out_norm=out_norm.weight.data_ptr(), norm_offset=norms[0].offset,
        norm_eps=norms[0].eps, out_eps=out_norm.eps, l2_eps=L2_EPS, scale=mixer.key_dim ** -0.5, qkv=described[0],
        z=described[1], a=described[2], b=described[3], out=described[4], gate_up=described[5], down=described[6])
    one, two = ops.deltanet_work(plan, 1, 1), ops.deltanet_work(plan, 1, 2)  # work = rows·per_row + batch·per_extra
    return _Plan(key, plan, (conv, mixer.A_log, mixer.dt_bias, out_norm.weight, *(n.weight for n in norms)),
                 two - one, 2 * one - two)


def planned(layer) -> bool:
    """Whether a step of this layer has run natively since it was built (tests)."""
    held = _PLANS.get(layer)
    return held is not None and held.plan is not None


def _work(need: int) -> torch.Tensor:
    work = getattr(_scratch, "tensor", None)
    if work is None or work.numel() < need:
        work = _scratch.tensor = torch.empty(need, dtype=torch.float32)
    return work


def _held(layer, key: tuple, build) -> _Plan:
    held = _PLANS.get(layer)
    if held is None or held.key != key:
        held = _PLANS[layer] = build()
    return held


def _attention_plan(layer, mods, attn, mlp, keys, cos, sin) -> _Plan | None:
    """The plan of an attention layer whose step can run natively on these cache buffers, or None."""
    am, mm = attn._modules, mlp._modules
    projections = (am.get("qkv_proj"), am.get("o_proj"), mm.get("gate_up_proj"), mm.get("down_proj"))
    if (projections[0] is None or projections[2] is None or keys.dtype is not torch.float32
            or not keys.is_contiguous() or not cos.is_contiguous() or not sin.is_contiguous()):
        return None
    norms = (mods["input_layernorm"], mods["post_attention_layernorm"])
    if _hooked((layer, attn, mlp, *projections, *norms)):  # the layer's own too: Transformer.forward calls this
        return None
    if type(attn) is GatedAttention:
        qk = (am["q_norm"]._parameters["weight"], am["k_norm"]._parameters["weight"])
    else:
        qk = (attn._buffers.get("qk_norm_weight"),)
    key = _key(projections, (*(n._parameters["weight"] for n in norms), *qk))
    if key is None:
        return None
    held = _held(layer, key, lambda: _build_attention(attn, projections, norms, key, cos))
    return None if held.plan is None else held


def _attention_step(layer, mods, attn, mlp, x, cos, sin, start_pos: int) -> torch.Tensor | None:
    b, t, _ = x.shape
    cache = attn._modules.get("cache")
    if type(cache) is not KVCache or cache.static:
        return None
    keys, values = cache._buffers["k"], cache._buffers["v"]
    held = _attention_plan(layer, mods, attn, mlp, keys, cos, sin)
    if held is None:
        return None
    window = cache.window
    work = _work(held.per_row * b * t + (0 if window is None else held.per_extra * b * keys.shape[2]))
    cache.claim(start_pos, t)
    return ops.decoder_layer(held.plan, x, start_pos, cos, sin, keys, values, work, window, address=held.address)


def block_step(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context: torch.Tensor | None,
               start_pos: int, window: int | None) -> torch.Tensor | None:
    """A block drafter's layer (model/block_draft.py BlockLayer) in one native call: the block x [1, B, hidden] at
    start_pos.. over its context cache, after writing the K/V of `context` [1, c, hidden] (projected features of
    positions start_pos - c ..; None: c = 0) there; cos / sin [c + B, rot] from position start_pos - c. Its queries see
    context (p - window, start_pos) and the whole block, which is written to the cache past the context (the
    drafter's context_len stays start_pos: the next append overwrites it). None where the module docstring's
    conditions do not hold (nothing written: the caller runs the modules)."""
    if not ENABLED or torch.is_grad_enabled() or x.dtype is not torch.float32 or not x.is_contiguous():
        return None
    c = 0 if context is None else context.shape[1]
    mods = layer._modules
    attn, mlp = mods["self_attn"], mods["mlp"]
    cache = attn._modules.get("context_cache")
    if (cache is None or x.shape[0] != 1 or c + x.shape[1] > NATIVE_ROWS or not ops.usable(x, cos, sin)
            or (context is not None and (not context.is_contiguous() or not ops.usable(context)))):
        return None
    keys, values = cache._buffers["k"], cache._buffers["v"]
    held = _attention_plan(layer, mods, attn, mlp, keys, cos, sin)
    if held is None:
        return None
    work = _work(held.per_row * (c + x.shape[1]) + (0 if window is None else held.per_extra * keys.shape[2]))
    return ops.decoder_layer(held.plan, x, start_pos, cos, sin, keys, values, work, window, address=held.address,
                             pre=context, block=True)


def _deltanet_step(layer, mods, mixer, mlp, x, cos, sin, start_pos: int) -> torch.Tensor | None:
    b, t, _ = x.shape
    xm, mm = mixer._modules, mlp._modules
    cache = xm.get("cache")
    if (type(cache) is not DeltaNetCache or cache.static or not mixer.fast or t > cache.max_block
            or cache.batch != b or cache.dtype is not torch.float32):
        return None
    buffers = cache._buffers
    if not buffers["state"].is_contiguous() or not buffers["conv"].is_contiguous():
        return None
    projections = (xm["in_proj_qkv"], xm["in_proj_z"], xm["in_proj_a"], xm["in_proj_b"], xm["out_proj"],
                   mm.get("gate_up_proj"), mm.get("down_proj"))
    if projections[5] is None:
        return None
    norms = (mods["input_layernorm"], mods["post_attention_layernorm"])
    if _hooked((layer, mixer, mlp, *projections, *norms)):
        return None
    p = mixer._parameters
    key = _key(projections, (*(n._parameters["weight"] for n in norms), xm["conv1d"]._parameters["weight"],
                             p["A_log"], p["dt_bias"], xm["norm"]._parameters["weight"]))
    if key is None:
        return None
    held = _held(layer, key, lambda: _build_deltanet(mixer, projections, norms, key))
    if held.plan is None:
        return None
    work = _work(held.per_row * b * t + held.per_extra * b)
    cache.begin(start_pos, t)  # may roll back or re-anchor: state and conv are read after it
    state, conv = buffers["state"], buffers["conv"]
    new_state, new_conv = torch.empty_like(state), torch.empty_like(conv)
    out = ops.deltanet_layer(held.plan, x, conv, state, new_conv, new_state, cache.record_at(), work,
                             address=held.address)
    cache.finish(new_state, new_conv)
    return out


KINDS = {Attention: _attention_step, GatedAttention: _attention_step, GatedDeltaNet: _deltanet_step}


def step(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start_pos: int) -> torch.Tensor | None:
    """The layer's output for x [b, t, hidden] at start_pos by one native call (writing its cache), or None where
    the module docstring's conditions do not hold (nothing written: the caller runs the modules)."""
    if not ENABLED or torch.is_grad_enabled() or x.dtype is not torch.float32 or x.dim() != 3 or not x.is_contiguous():
        return None  # with gradients on, autograd must see the modules' ops (training, QAD)
    b, t, _ = x.shape
    mods = layer._modules
    mixer, mlp = mods.get(layer.mixer_attr), mods.get("mlp")
    kind = KINDS.get(type(mixer))
    if kind is None or mlp is None or b * t > NATIVE_ROWS or not ops.usable(x, cos, sin):
        return None
    return kind(layer, mods, mixer, mlp, x, cos, sin, start_pos)
