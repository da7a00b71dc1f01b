"""A dense decoder layer's eager fp32 CPU step as one native call (kernels/ops.py decoder_layer).

Why: a decode step's layer is some twenty Python-level calls (module calls, views, the cache's slice writes, a
ctypes call per op, each 10-25 us of wrapper around a few us of work), which is most of a small model's step and a
fifth of a 1.7B one's; llama.cpp runs the same layer as one graph. Here the layer's modules describe themselves once
(a plan of pointers: kernels/ops.py LayerPlan) and the step is one call that makes the same native calls in the same
order on the same values, so its output is the modules' bit for bit (tests/test_native_layer.py) and a verify row
still equals the one-row step. The speed is in docs/BENCH.md ("One native call per layer").

It runs where the modules would run every op natively anyway: a DecoderLayer over Attention (not the gated or
DeltaNet kinds) with q/k/v and gate/up fused, a sliced K/V cache (full or a ring; not the static layout), an fp32
CPU input of up to NATIVE_ROWS rows, gradients off (no_grad / inference_mode), not compiling, no module hooks
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
from specquant.model.modules import NATIVE_ROWS, RMSNorm
from specquant.model.norms import ZeroCentredRMSNorm

ENABLED = True
NORMS = (RMSNorm, ZeroCentredRMSNorm)  # the layer norms whose forward is ops.rms_norm with their `offset`
_work = threading.local()  # one scratch tensor per thread, grown to the largest call: layers run one at a time
# each layer's plan, beside the layer rather than in it: a copy.deepcopy or pickle of the model never meets the
# ctypes pointers (which cannot be copied, and would point at the original's tensors)
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Plan:
    """A layer's LayerPlan, the key of the tensors it points at (rebuilt when one of them moves), what it keeps
    alive, and the scratch floats a call needs per row. plan None: this layer, as the key describes it, cannot run
    natively (kept too, so a step does not try to build it again until the key changes)."""

    __slots__ = ("address", "keep", "key", "per_ring_key", "per_row", "plan")

    def __init__(self, key: tuple, plan: ops.LayerPlan | None = None, keep: tuple = ()):
        self.key, self.plan, self.keep = key, plan, keep
        self.address = None if plan is None else ctypes.addressof(plan)
        self.per_row = 0 if plan is None else ops.layer_work(plan, 1)
        self.per_ring_key = 0 if plan is None else ops.layer_work(plan, 0, 1)


def _hooked(mods) -> bool:
    return bool(torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks) or any(
        m._forward_hooks or m._forward_pre_hooks for m in mods)


# Each step asks for these: module attributes are read from the module's own dicts (_modules, _parameters,
# _buffers), since nn.Module.__getattr__ costs about a microsecond a lookup, and a layer step makes ~25 of them.
def _key(projections, norms, qk: torch.Tensor | None) -> tuple | None:
    """What the plan depends on: which modules, each projection's native_key (None: it cannot describe itself), the
    norms' weights."""
    keys = []
    for p in projections:
        fn = getattr(p, "native_key", None)
        k = None if fn is None else fn()
        if k is None:
            return None
        keys.append((id(p), k))
    weights = ((id(n), n._parameters["weight"].data_ptr()) for n in norms)
    return (*keys, *weights, None if qk is None else qk.data_ptr())


def _build(attn: Attention, projections, norms, qk: torch.Tensor | None, key: tuple, x: torch.Tensor,
           cos: torch.Tensor) -> _Plan:
    if any(type(n) not in NORMS for n in norms) or any(
            n.weight.dtype is not torch.float32 or not n.weight.is_contiguous() or n.offset != norms[0].offset
            or n.eps != norms[0].eps for n in norms):
        return _Plan(key)
    if qk is not None and (qk.dtype is not torch.float32 or not qk.is_contiguous()):
        return _Plan(key)
    described = [p.native_projection() for p in projections]
    if any(p is None for p in described):
        return _Plan(key)
    d = attn.head_dim
    plan = ops.LayerPlan(
        hidden=x.shape[-1], heads=attn.n_heads, kv_heads=attn.n_kv, head_dim=d, inter=described[3].k,
        rot=cos.shape[-1], qk_norm_rows=0 if qk is None else qk.numel() // d, min_parallel_macs=PARALLEL_MIN_MACS,
        input_norm=norms[0].weight.data_ptr(), post_norm=norms[1].weight.data_ptr(),
        qk_norm=None if qk is None else qk.data_ptr(), norm_offset=norms[0].offset, norm_eps=norms[0].eps,
        qk_eps=attn.eps, scale=d ** -0.5, qkv=described[0], o=described[1], gate_up=described[2],
        down=described[3])
    return _Plan(key, plan, (qk, *(n.weight for n in norms)))


def planned(layer) -> bool:
    """Whether a step of this layer has run natively since it was built (tests)."""
    held = _PLANS.get(layer)
    return held is not None and held.plan is not None


def step(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start_pos: int) -> torch.Tensor | None:
    """The layer's output for x [b, t, hidden] at start_pos by one native call (writing its k, v into the cache),
    or None where the module docstring's conditions do not hold (nothing written: the caller runs the modules)."""
    if not ENABLED or torch.is_grad_enabled() or x.dtype is not torch.float32 or x.dim() != 3 or not x.is_contiguous():
        return None  # with gradients on, autograd must see the modules' ops (training, QAD)
    b, t, _ = x.shape
    mods = layer._modules
    attn, mlp = mods.get("self_attn"), mods.get("mlp")
    if type(attn) is not Attention or b * t > NATIVE_ROWS or not ops.usable(x, cos, sin):
        return None
    am, mm = attn._modules, mlp._modules
    cache = am.get("cache")
    projections = (am.get("qkv_proj"), am.get("o_proj"), mm.get("gate_up_proj"), mm.get("down_proj"))
    if type(cache) is not KVCache or cache.static or projections[0] is None or projections[2] is None:
        return None
    keys, values = cache._buffers["k"], cache._buffers["v"]
    if (keys.dtype is not torch.float32 or not keys.is_contiguous() or not cos.is_contiguous()
            or not sin.is_contiguous()):
        return None
    norms = (mods["input_layernorm"], mods["post_attention_layernorm"])
    if _hooked((layer, attn, mlp, *projections, *norms)):  # the layer's own too: Transformer.forward calls this
        return None
    qk = attn._buffers.get("qk_norm_weight")
    key = _key(projections, norms, qk)
    if key is None:
        return None
    held = _PLANS.get(layer)
    if held is None or held.key != key:
        held = _PLANS[layer] = _build(attn, projections, norms, qk, key, x, cos)
    if held.plan is None:
        return None
    window = cache.window
    need = held.per_row * b * t + (0 if window is None else held.per_ring_key * b * keys.shape[2])
    work = getattr(_work, "tensor", None)
    if work is None or work.numel() < need:
        work = _work.tensor = torch.empty(need, dtype=torch.float32)
    cache.claim(start_pos, t)
    return ops.decoder_layer(held.plan, x, start_pos, cos, sin, keys, values, work, window, address=held.address)
