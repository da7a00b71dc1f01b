"""The two RMSNorm variants of Qwen3.5 hybrids (transformers' Qwen3_5RMSNorm and Qwen3_5RMSNormGated).

- ZeroCentredRMSNorm: x * rsqrt(mean x^2 + eps) * (1 + w) in fp32, w stored as an offset from one (initialised to
  zeros). Qwen3.5 uses it for input_layernorm, post_attention_layernorm, the final norm and full attention's
  q_norm / k_norm. Loading its weight into the decoder's RMSNorm (x * w) would silently scale by w instead of 1 + w.
- GatedRMSNorm: DeltaNet's per-head output norm, weight * rms_norm(x) * SiLU(gate), weight initialised to ones,
  no +1. forward takes the product with the weight in the input dtype and the gate in fp32, as transformers does,
  so bf16 runs round as theirs do; fp32() is the same in fp32 with one rounding at the end (DeltaNet's fast path).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specquant.kernels import ops


class ZeroCentredRMSNorm(nn.Module):
    offset = 1.0  # kernels.ops.rms_norm's weight offset: x * (1 + w)

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if ops.usable(x, self.weight):  # the same ops fused (fp32 CPU eager steps)
            return ops.rms_norm(x, self.weight, self.eps, self.offset)
        y = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate [..., dim] -> [..., dim] in x's dtype."""
        y = self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)
        return (y * F.silu(gate.float())).to(x.dtype)

    def fp32(self, x: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """forward in fp32 throughout, rounded once to dtype (x may be the rule's fp32 output): a bf16 model's
        fast path (model/deltanet.py), which skips the casts forward makes to round where transformers does."""
        if (dtype == torch.float32 and x.shape == gate.shape and x.is_contiguous() and gate.is_contiguous()
                and ops.usable(x, gate, self.weight)):  # usable: x and gate are fp32
            return ops.rms_norm(x, self.weight, self.eps, gate=gate)
        y = F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps)
        return (y * F.silu(gate.float())).to(dtype)
