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


NATIVE_ROWS = 64  # dense_linear: fp32 CPU eager inputs of up to this many positions take kernels.ops.linear
SMALL_ROWS = (5, 8)  # else fp32 CPU inputs with this many rows (inclusive) take the W·xᵀ path ...
SMALL_MIN_WEIGHT = 1 << 21  # ... on weights of at least this many elements (measurement below)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) as inference runs it: every dense fp32 product of the model (Linear, and a
    QuantLinear's dequantized weight) goes through here, so that both take the same path for the same input.

    Inputs of up to NATIVE_ROWS positions (x.shape[-2], any batch) on an eager fp32 CPU step that needs no
    gradient go to kernels.ops.linear where the ops library built. Its rows are batch-invariant, so a verify
    step's row equals the one-row decode step's bit for bit: that is what keeps a speculative run's greedy tokens
    equal to the target's own on a W4 model whose activations round to bf16, where a last-bit difference in a
    dense in_proj_a / in_proj_b flips a rounding and grows to a changed token (the hybrid demo's 1024-token
    prompt did, with 21-row suffix verifies on F.linear). The bound is on positions, not rows, so a batch of
    sequences gets the same per-row results as one sequence. It also streams the weight faster than F.linear on
    one or two threads (benchmarks/small_gemm.py at dfedb37, docs/BENCH.md). Longer blocks (prefill) take F.linear, whose
    GEMM wins there; training (gradients) always does.

    Elsewhere (no library, compiling, other dtypes): F.linear computes x·Wᵀ; from 5 rows on MKL then runs small-M
    kernels that stream the weight at half of memory bandwidth on CPU. (W·xᵀ)ᵀ is the same product with the roles
    swapped and is faster for 5..8 rows on weights of 2M+ elements (re-measured on torch 2.13, docs/SHAPES.md:
    1..4 rows F.linear is as fast or faster; 5..8 rows W·xᵀ wins by 1.1-1.5x on 1024->4096/6144 and 384->8192 and
    loses on small weights). Every path matches F.linear to float rounding (summation order);
    tests/test_model_equivalence.py and tests/test_native_ops.py compare them.
    """
    rows = x.numel() // weight.shape[1]
    positions = x.shape[-2] if x.dim() > 1 else 1
    if weight.dtype is torch.bfloat16 and x.dtype is torch.float32:  # a bf16-stored weight (model/bf16_store.py,
        # quant/head.py's CastLinear): fp32 activations against it widened exactly, natively from half the bytes
        if rows and positions <= NATIVE_ROWS and weight.is_contiguous() and weight.is_cpu:
            if ops.usable(x, bias) and not (weight.requires_grad and torch.is_grad_enabled()):
                return ops.linear(x, weight, bias)
            if torch.compiler.is_compiling() and x.is_cpu and not weight.requires_grad:  # a compiled / packaged
                y = ops.linear_bf16w_op(x, weight)  # step: the same native call, as a torch operator (the bias
                return y if bias is None else y + bias  # added after the sum, as the native call adds it)
        weight = weight.float()
    if (rows and positions <= NATIVE_ROWS and weight.is_contiguous()
            and ops.usable(x, weight, bias)):  # ops.linear takes a contiguous weight and at least one row
        return ops.linear(x, weight, bias)
    if (SMALL_ROWS[0] <= rows <= SMALL_ROWS[1] and x.dtype == torch.float32 and x.device.type == "cpu"
            and weight.numel() >= SMALL_MIN_WEIGHT):
        y = torch.mm(weight, x.reshape(rows, weight.shape[1]).t()).t().contiguous()
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear whose product is dense_linear (its fast paths for the few-row fp32 GEMMs of decode and verify)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x, self.weight, self.bias)

    def native_key(self) -> tuple | None:
        """What native_projection's pointers depend on (model/native_layer.py asks before each call)."""
        params = self._parameters  # not self.weight: nn.Module.__getattr__ costs ~1 us, asked every step
        w, b = params["weight"], params.get("bias")
        return w.data_ptr(), w.dtype, None if b is None else b.data_ptr()

    def native_projection(self) -> ops.Projection | None:
        """This product as one projection of a native layer step: the kernels.ops.linear call dense_linear makes."""
        return ops.dense_projection(self.weight, self.bias)

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
