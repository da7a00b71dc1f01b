"""lm_head precision: dense / bf16 / W8 / W4 (QuantConfig.lm_head).

At real vocabulary sizes the head is the largest matrix a decode step reads: Qwen3-0.6B's tied fp32 head is
151936 x 1024 = 622 MB, more than all its W4 decoder layers (~275 MB with g32 scales), so W4 layers cannot pay
off while the head stays dense fp32. The options, by bytes per step at that shape:
  dense  the model's own matrix (fp32: 622 MB), tied to the embedding when the checkpoint ties them;
  bf16   the same matrix rounded to bf16 (311 MB); fp32 activations run against it widened exactly (the native
         linear on CPU, CastLinear), bf16 ones as a bf16 GEMM;
  w8     RTN int8, one scale per output row (156 MB), run by torch's aten._weight_int8pack_mm;
  w4     RTN int4, group 32, symmetric (97 MB with fp32 scales), run by the W4 backends (native kernel first).
The head gets its own weight (the embedding keeps the dense one), so quantizing it unties a tied checkpoint.
KL and top-1 agreement of each against the dense head: docs/BENCH.md "Quantization quality" (measured with benchmarks/lm_head.py at dfedb37).
The reference recipe keeps the target's head BF16; QuantConfig's default stays dense (see docs/SHAPES.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specquant.errors import SpecquantError
from specquant.model.modules import Linear, dense_linear
from specquant.quant.grid import quantize_weight
from specquant.quant.linear import QuantLinear

from specquant.quant.config import HEAD_PRECISIONS
W4_HEAD_GROUP = 32  # GGUF Q4_0's grid; the native kernel's best case


class CastLinear(nn.Module):
    """A bias-free Linear whose weight is stored in another dtype (bf16). fp32 activations stay fp32 against the
    exact widened weight (model.modules.dense_linear: on a CPU eager step of up to NATIVE_ROWS positions the native
    linear widens it in registers, half the bytes of a dense fp32 head streamed per step; elsewhere the same
    product on weight.float()). Other activations (a bf16 model) are cast to the weight's dtype and back."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if x.dtype == torch.float32 and w.dtype is torch.bfloat16:
            return dense_linear(x, w)
        return F.linear(x.to(w.dtype), w).to(x.dtype)

    def _apply(self, fn, recurse=True):  # model.to(float32) must not widen the head back: keep the stored dtype
        dtype = self.weight.dtype
        super()._apply(fn, recurse)
        self.weight.data = self.weight.data.to(dtype)
        return self


def head_module(weight: torch.Tensor, precision: str, scale_dtype: torch.dtype) -> nn.Module:
    """A module computing x @ Q(weight)^T for precision in HEAD_PRECISIONS (dense returns an nn.Linear copy)."""
    from specquant.quant.config import QuantConfig  # config imports nothing from here; keep the import local

    w = weight.detach()
    if precision == "dense":
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype, device=w.device)
        lin.weight = nn.Parameter(w, requires_grad=False)
        return lin
    if precision == "bf16":
        return CastLinear(w.to(torch.bfloat16).clone())
    bits, group = (8, -1) if precision == "w8" else (4, W4_HEAD_GROUP)
    if precision not in ("w8", "w4"):
        raise SpecquantError(f"unknown lm_head precision {precision!r}; use one of {', '.join(HEAD_PRECISIONS)}")
    cfg = QuantConfig(method="rtn", bits=bits, group_size=group, symmetric=True)
    codes, scale, zero = quantize_weight(w.float(), cfg, scale_dtype=scale_dtype)
    return QuantLinear.from_codes(codes, scale, zero, bits)


def head_scheme(head: nn.Module) -> dict | None:
    """compressed-tensors weights args of a quantized head (None when it is dense or bf16)."""
    if not isinstance(head, QuantLinear):
        return None
    per_channel = head.group_size == head.in_features
    return {"num_bits": head.bits, "type": "int", "symmetric": head.symmetric,
            "strategy": "channel" if per_channel else "group", "group_size": None if per_channel else head.group_size,
            "dynamic": False, "actorder": None, "observer": "minmax"}


def set_lm_head(model: nn.Module, precision: str, scale_dtype: torch.dtype | None = None) -> nn.Module:
    """Replace model.lm_head by `precision`'s module (in place; "dense" leaves it as is). Returns the new head.

    scale_dtype: the quantized head's scale dtype (default: the embedding's dtype)."""
    if precision not in HEAD_PRECISIONS:
        raise SpecquantError(f"unknown lm_head precision {precision!r}; use one of {', '.join(HEAD_PRECISIONS)}")
    if precision == "dense":
        return model.lm_head
    weight = model.lm_head.weight if isinstance(model.lm_head, nn.Linear) else None
    if weight is None:
        raise SpecquantError("lm_head is already converted; set its precision once, on the dense model")
    model.lm_head = head_module(weight, precision, scale_dtype or model.model.embed_tokens.weight.dtype)
    model.config.tie_word_embeddings = False
    return model.lm_head


def cut_rows(head: nn.Module, token_ids: torch.Tensor) -> nn.Module:
    """A module of head's kind computing head(x)[..., token_ids] (its own copy of those rows): a pruned draft head
    (spec_decode/drafters/pruned_head.py) or a pruned target vocabulary (quant/prune_vocab.py)."""
    if isinstance(head, CastLinear):  # a BF16 head (QuantConfig.lm_head="bf16")
        return CastLinear(head.weight.detach()[token_ids].clone())
    if isinstance(head, QuantLinear):
        zero = head.zero_point()
        rows = QuantLinear.from_codes(head.codes()[token_ids], head.weight_scale[token_ids],
                                      None if zero is None else zero[token_ids], head.bits,
                                      None if head.bias is None else head.bias.detach()[token_ids])
        rows.backend, rows.activations = head.backend, head.activations
        return rows
    if isinstance(head, nn.Linear):
        w = head.weight.detach()
        rows = Linear(head.in_features, token_ids.numel(), bias=head.bias is not None, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            rows.weight.copy_(w[token_ids])
            if head.bias is not None:
                rows.bias.copy_(head.bias.detach()[token_ids])
        return rows.requires_grad_(False)
    raise SpecquantError(f"a {type(head).__name__} head cannot be pruned; a pruned head needs a Linear, "
                         "CastLinear or QuantLinear head (quant/head.py's precisions)")
