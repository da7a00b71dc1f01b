"""Fuse each layer's q/k/v projections into one Linear and gate/up into another, for inference.

Attention mixers only (GatedAttention included: its forward reads the fused [query | gate, k, v] layout); other
layer kinds (Gated DeltaNet) keep their projections.

One matmul call instead of three (and two), on the concatenated weight, and (Qwen3) one q/k normalization and one
RoPE call on q and k together: each output column is the same dot product as before, so logits are unchanged (dense
GEMMs may sum in another order). Why: at small sizes every call costs framework overhead comparable to the
arithmetic; measured by benchmarks/fuse.py at dfedb37 (docs/BENCH.md).

Fusing is polymorphic: each linear kind concatenates itself with its `concat(mods)` classmethod (model.modules'
Linear here; quant.linear.QuantLinear brings its own), so this file knows no quantized layer. A fused model is for
decoding only: its state dict no longer has HF's names, so saving and quantizing it are refused.
"""

from __future__ import annotations

import torch
from torch import nn

from specquant.errors import SpecquantError
from specquant.model.attention import Attention
from specquant.model.bf16_store import store_bf16
from specquant.model.decoder import Transformer
from specquant.model.modules import RMSNorm


def _fuse(mods: list[nn.Module]) -> nn.Module | None:
    """One module computing cat([m(x) for m in mods], -1), or None when they cannot be fused."""
    kind = type(mods[0])
    if any(type(m) is not kind for m in mods) or not hasattr(kind, "concat"):
        return None
    return kind.concat(mods)


def fuse_projections(model: Transformer) -> int:
    """Fuse q/k/v and gate/up in every layer where possible, in place; returns the number of fused modules."""
    return fuse_layers(model.model.layers)


def fuse_layers(layers) -> int:
    """fuse_projections on these DecoderLayers (a model's, or an MTP drafter's: model/mtp.py)."""
    n = 0
    for layer in layers:
        attn, mlp = layer.mixer, layer.mlp
        if isinstance(attn, Attention) and attn.qkv_proj is None:  # other layer kinds keep their projections
            fused = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
            if fused is not None:
                attn.qkv_proj, attn.q_proj, attn.k_proj, attn.v_proj = fused, None, None, None
                # one normalization of [q heads; k heads] with per-head weights; GatedAttention (Qwen3.5) keeps its
                # zero-centred q_norm / k_norm, since its fused output interleaves each query with its gate
                if type(attn.q_norm) is RMSNorm:
                    attn.qk_norm_weight = torch.cat([attn.q_norm.weight.detach().expand(attn.n_heads, -1),
                                                     attn.k_norm.weight.detach().expand(attn.n_kv, -1)])
                n += 1
        if mlp.gate_up_proj is None:
            fused = _fuse([mlp.gate_proj, mlp.up_proj])
            if fused is not None:
                mlp.gate_up_proj, mlp.gate_proj, mlp.up_proj = fused, None, None
                n += 1
    return n


def for_decoding(model: nn.Module, layers=None) -> nn.Module:
    """model laid out for decoding, in place: its layers' (default: a Transformer's) projections fused, and dense
    weights of bf16 values stored bf16 (model/bf16_store.py: the same outputs, half the bytes), so their steps run as
    one native call each (model/native_layer.py). What loader.load_model(fuse=True) does to a target and a drafter
    kind's load to the model its engine runs."""
    fuse_layers(model.model.layers if layers is None else layers)
    store_bf16(model)
    return model


def is_fused(model: nn.Module) -> bool:
    """Whether any layer runs fused projections (read from the modules themselves, not from a flag)."""
    return any(getattr(m, "qkv_proj", None) is not None or getattr(m, "gate_up_proj", None) is not None
               for m in model.modules())


def check_unfused(model: nn.Module, what: str):
    if is_fused(model):
        raise SpecquantError(f"cannot {what} a model with fused projections (an inference-only layout); load the "
                             "checkpoint again without fuse=True")
