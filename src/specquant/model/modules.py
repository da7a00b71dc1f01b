"""Building blocks every layer kind shares: RMSNorm (and make_norm, the config's choice), the decoder's Linear,
the SwiGLU MLP.

Mixer files (attention.py, the layer kinds in layers.py) import these from here, not from decoder.py: decoder.py
imports the layer-kind table, which imports the mixers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specquant.kernels import ops
from specquant.model.config import ModelConfig
from specquant.model.norms import ZeroCentredRMSNorm


class RMSNorm(nn.Module):
    offset = 0.0  # the weight's offset from the scale (kernels.ops.rms_norm; ZeroCentredRMSNorm's is 1)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # normalized in fp32, as transformers does
        if ops.usable(x, self.weight):  # the same ops fused (fp32 CPU eager steps)
            return ops.rms_norm(x, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)


def add_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, norm(x + residual)) for an RMSNorm or ZeroCentredRMSNorm (their `offset`): one native call
    for fp32 CPU eager tensors of one shape, else the add and the norm's own forward."""
    if x.shape == residual.shape and x.is_contiguous() and residual.is_contiguous() and ops.usable(x, residual,
                                                                                                     norm.weight):
        return ops.rms_norm(x, norm.weight, norm.eps, norm.offset, residual=residual)
    x = x + residual
    return x, norm(x)


def make_norm(cfg: ModelConfig, dim: int) -> nn.Module:
    """The decoder's layer / final norm for this config: x * w, or Qwen3.5's zero-centred x * (1 + w)."""
    return ZeroCentredRMSNorm(dim, cfg.rms_norm_eps) if cfg.zero_centred_norms else RMSNorm(dim, cfg.rms_norm_eps)


SMALL_ROWS = (5, 8)  # Linear: fp32 CPU inputs with this many rows (inclusive) take the W·xᵀ path ...
SMALL_MIN_WEIGHT = 1 << 21  # ... on weights of at least this many elements (measurement in Linear's docstring)


class Linear(nn.Linear):
    """nn.Linear, with a faster path for the few-row fp32 GEMMs of decode and verify steps on CPU.

    F.linear computes x·Wᵀ; from 5 rows on MKL then runs small-M kernels that stream the weight at half of memory
    bandwidth on CPU. (W·xᵀ)ᵀ is the same product with the roles swapped and is faster for 5..8 rows on weights of
    2M+ elements. Re-measured on torch 2.13 (weights streamed, 1 thread, docs/SHAPES.md): 1..4 rows F.linear is as
    fast or faster everywhere (1 row: 5.4-6.2 GB/s against 2.7-3.0 GB/s for W·xᵀ with the row sent twice, which
    earlier torch builds favoured); 5..8 rows W·xᵀ wins by 1.1-1.5x on 1024->4096/6144 and 384->8192 and loses on
    small weights (384->1024 at 8 rows: 0.64 vs 0.53 ms). Results match F.linear to float rounding (summation
    order); tests/test_model_equivalence.py compares them.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if (SMALL_ROWS[0] <= rows <= SMALL_ROWS[1] and x.dtype == torch.float32 and x.device.type == "cpu"
                and self.weight.numel() >= SMALL_MIN_WEIGHT):
            y = torch.mm(self.weight, x.reshape(rows, self.in_features).t()).t().contiguous()
            if self.bias is not None:
                y = y + self.bias
            return y.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)

    @classmethod
    def concat(cls, mods: list["Linear"]) -> "Linear | None":
        """One Linear computing cat([m(x) for m in mods], -1) (model.fuse), or None when they cannot be fused."""
        first = mods[0]
        if any(type(m) is not cls or m.in_features != first.in_features or (m.bias is None) != (first.bias is None)
               or m.weight.dtype != first.weight.dtype for m in mods):
            return None
        w = torch.cat([m.weight.detach() for m in mods])
        fused = cls(first.in_features, w.shape[0], bias=first.bias is not None, device=w.device, dtype=w.dtype)
        fused.weight.data.copy_(w)
        if first.bias is not None:
            fused.bias.data.copy_(torch.cat([m.bias.detach() for m in mods]))
        return fused.requires_grad_(False)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, f, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = Linear(h, f, bias=bias)
        self.up_proj = Linear(h, f, bias=bias)
        self.down_proj = Linear(f, h, bias=bias)
        self.gate_up_proj = None  # model.fuse.fuse_projections: gate and up in one matmul (inference only)

    def forward(self, x):
        if self.gate_up_proj is not None:
            y = self.gate_up_proj(x)
            if y.is_contiguous() and ops.usable(y):
                return self.down_proj(ops.swiglu(y))
            gate, up = y.chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)
