"""Fuse each layer's q/k/v projections into one Linear and gate/up into another, for inference.

One matmul call instead of three (and two), on the concatenated weight, and (Qwen3) one q/k normalization and one
RoPE call on q and k together: each output column is the same dot product as before, so logits are unchanged (the
int4 kernel's were bit-identical on the bundled pair; dense GEMMs may sum in another order). At the bundled sizes every call costs framework overhead (and, for W4 layers, two activation
casts) comparable to the arithmetic. `benchmarks/fuse.py` (interleaved A/B, 2 threads, 300 tokens of context):
1.14-1.25x faster for the bundled target and draft, fp32 and W4, one-token and 4-token steps.

Works on dense `Linear`s and on `QuantLinear`s that share bits, group size and symmetry. A fused model is for
decoding only: its state dict no longer has HF's names, so saving and quantizing it are refused.
"""

from __future__ import annotations

import torch
from torch import nn

from specquant.errors import SpecquantError
from specquant.model.decoder import Linear, Transformer


def _fuse(mods: list[nn.Module]) -> nn.Module | None:
    """One module computing cat([m(x) for m in mods], -1), or None when they cannot be fused."""
    from specquant.quant.linear import QuantLinear

    first = mods[0]
    has_bias = [m.bias is not None for m in mods]
    if any(h != has_bias[0] for h in has_bias) or any(m.in_features != first.in_features for m in mods):
        return None
    bias = torch.cat([m.bias.detach() for m in mods]) if has_bias[0] else None
    if all(type(m) is Linear for m in mods):
        w = torch.cat([m.weight.detach() for m in mods])
        fused = Linear(first.in_features, w.shape[0], bias=bias is not None, device=w.device, dtype=w.dtype)
        fused.weight.data.copy_(w)
        if bias is not None:
            fused.bias.data.copy_(bias)
        return fused.requires_grad_(False)
    if all(type(m) is QuantLinear for m in mods):
        if any((m.bits, m.group_size, m.symmetric, m.weight_scale.dtype)
               != (first.bits, first.group_size, first.symmetric, first.weight_scale.dtype) for m in mods):
            return None
        zero = None if first.symmetric else torch.cat([m.zero_point() for m in mods])
        fused = QuantLinear.from_codes(torch.cat([m.codes() for m in mods]), torch.cat([m.weight_scale for m in mods]),
                                       zero, first.bits, bias)
        fused.backend = first.backend
        return fused
    return None


def fuse_projections(model: Transformer) -> int:
    """Fuse q/k/v and gate/up in every layer where possible, in place; returns the number of fused modules."""
    n = 0
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv_proj is None:
            fused = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
            if fused is not None:
                attn.qkv_proj, attn.q_proj, attn.k_proj, attn.v_proj = fused, None, None, None
                if attn.q_norm is not None:  # one normalization of [q heads; k heads] with per-head weights
                    attn.qk_norm_weight = torch.cat([attn.q_norm.weight.detach().expand(attn.n_heads, -1),
                                                     attn.k_norm.weight.detach().expand(attn.n_kv, -1)])
                n += 1
        if mlp.gate_up_proj is None:
            fused = _fuse([mlp.gate_proj, mlp.up_proj])
            if fused is not None:
                mlp.gate_up_proj, mlp.gate_proj, mlp.up_proj = fused, None, None
                n += 1
    if n:
        model.fused_projections = True
    return n


def check_unfused(model: nn.Module, what: str):
    if getattr(model, "fused_projections", False):
        raise SpecquantError(f"cannot {what} a model with fused projections (an inference-only layout); load the "
                             "checkpoint again without fuse=True")
