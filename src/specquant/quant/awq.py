"""AWQ (Lin et al. 2023, activation-aware weight quantization), written from the paper and llm-awq's notes.

Per decoder layer, for each group of Linears that read the same input produced by one "previous" op:
  1. x̄ = mean |x| per input channel over all calibration tokens of that input.
  2. For α in {0, 1/grid, …, (grid-1)/grid}: s = x̄^α, normalized by √(max(s)·min(s)) (llm-awq's choice, keeps
     s centred around 1); loss(α) = Σ_linears mean_tokens ‖x·Wᵀ − (x/s)·Q(W·diag(s))ᵀ‖². α = 0 is plain RTN,
     so the chosen α never does worse than RTN on this loss.
  3. Fold: previous op's output is divided by s (RMSNorm weight, or the rows of a previous Linear and its bias),
     the group's weights are multiplied by s (columns). Full-precision output is unchanged; the captured inputs
     are divided by s in place so later steps see what the rescaled layer sees.
Where the loss is measured is data too (a mapping's `scored_on`):
  * q/k/v: on the attention block's output, as llm-awq does, over the first `AWQConfig.block_samples` calibration
    sequences, because q/k errors act through softmax(q·kᵀ): scored on the Linear outputs instead, AWQ of q/k/v
    lowered their error but not the model's KL to full precision (docs/BENCH.md, "AWQ's q/k/v loss").
  * Gated DeltaNet's in_proj_qkv / in_proj_z: on the mixer's output too, for the same reason: q and k pass
    through a causal conv, SiLU and L2 normalization, and z through SiLU, before they meet.
  * every other group: on the group's own Linear outputs. That is a quadratic form, mean_tokens ‖x·ΔWᵀ‖² =
    Σ_rows ΔW·G·ΔWᵀ with the input second moment G = xᵀx/n, so every calibration token counts and each α costs
    out·in² instead of tokens·out·in. (llm-awq scores gate/up on the MLP output; that costs ~3× more per α
    and is left as a possible refinement.)
  4. Clip search per Linear (if AWQConfig.clip): for each output row and group, try shrinking the min/max range to
     r = 1 − i/clip_grid, i < clip_max_shrink·clip_grid (defaults: r = 1.00 … 0.55, as llm-awq),
     and keep the r minimizing that group's contribution to the output error, ΔW_g·G_gg·ΔW_gᵀ with G_gg the
     group's diagonal block of G (exact over all tokens). Like llm-awq, q_proj/k_proj are not clipped: their
     output error is a poor proxy through softmax(q·kᵀ).
  5. Quantize the rescaled weight with the chosen ranges.
Groups are data per layer kind (AWQ_MAPPINGS, keyed as model/layers.py's LAYER_KINDS, so a hybrid's layers each
use their own kind's groups); a mapping is skipped when shapes do not allow it (v→o under GQA: v_proj has
kv_heads·head_dim rows, o_proj reads heads·head_dim) or when one of its Linears is not targeted. Linears that read
the rescaled output but stay dense (DeltaNet's in_proj_a / in_proj_b, beside in_proj_qkv / in_proj_z) get their
columns multiplied by s too, unquantized, so the full-precision layer is unchanged.
Zero-centred norms (Qwen3.5, y = (1 + w)·normalized(x)) fold s into 1 + w.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from specquant.model.norms import ZeroCentredRMSNorm
from specquant.quant.calib import abs_mean, gram
from specquant.quant.grid import QuantizedWeight, compute_qparams, quantize_codes, rtn_fake_quant

NEEDS_CALIBRATION = True


class Mapping(NamedTuple):
    """Linears reading one op's output, module names relative to a decoder layer."""

    prev: str  # the op whose output is divided by s (a norm or a Linear)
    linears: tuple[str, ...]  # the quantized Linears reading it: their columns are multiplied by s
    scored_on: str | None = None  # the block whose output scores α (None: the Linears' own outputs)
    dense_readers: tuple[str, ...] = ()  # other readers kept dense: columns multiplied by s, not quantized


_MLP = [
    Mapping("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    Mapping("mlp.up_proj", ("mlp.down_proj",)),
]
_ATTENTION = [
    Mapping("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
    # under Qwen3.5's output gate too: sigmoid(gate) multiplies the attention output per channel, which commutes
    # with v's per-channel 1/s
    Mapping("self_attn.v_proj", ("self_attn.o_proj",)),
    *_MLP,
]
AWQ_MAPPINGS: dict[str, list[Mapping]] = {
    "full_attention": _ATTENTION,
    "gated_attention": _ATTENTION,
    # out_proj has no foldable predecessor: its input is GatedRMSNorm(o)·SiLU(z), a norm whose weight is shared by
    # every value head and a nonlinear gate; it is quantized with clipping only
    "linear_attention": [
        Mapping("input_layernorm", ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z"), "linear_attn",
                ("linear_attn.in_proj_a", "linear_attn.in_proj_b")),
        *_MLP,
    ],
}
NO_CLIP = ("q_proj", "k_proj")


def _prev_out_features(prev: nn.Module) -> int:
    return prev.out_features if isinstance(prev, nn.Linear) else prev.weight.shape[0]


def output_error(dw: torch.Tensor, g: torch.Tensor) -> float:
    """mean over tokens of ‖x·dwᵀ‖² for dw [out, in], given g = xᵀx/n [in, in]."""
    return float(((dw @ g) * dw).sum())


@torch.no_grad()
def search_scale(loss_fn, x_mean: torch.Tensor, linears: list[nn.Linear], groups: list[int], cfg,
                 scale_dtype) -> tuple[torch.Tensor, float, float]:
    """Best s [in] for Linears sharing one input. loss_fn(fake-quantized weights) scores a candidate.

    Returns (s, best_loss, rtn_loss)."""
    weights = [lin.weight.float() for lin in linears]
    best, best_s, rtn_loss = float("inf"), None, None
    for i in range(cfg.method.grid):
        s = x_mean.pow(i / cfg.method.grid).clamp_min(1e-4)
        s = s / (s.max() * s.min()).sqrt()
        loss = loss_fn([rtn_fake_quant(w * s, cfg.bits, group, cfg.symmetric, scale_dtype=scale_dtype) / s
                        for w, group in zip(weights, groups)])
        if i == 0:
            rtn_loss = loss
        if loss < best:
            best, best_s = loss, s
    return best_s, best, rtn_loss


def linear_output_loss(linears: list[nn.Linear], g: torch.Tensor):
    weights = [lin.weight.float() for lin in linears]
    return lambda fq: sum(output_error(q - w, g) for q, w in zip(fq, weights))


def block_output_loss(block: nn.Module, linears: list[nn.Linear], x: torch.Tensor, call: tuple[tuple, dict]):
    """Score fake-quantized weights by the block's output MSE on x [sequences, T, hidden] (block = the layer's
    mixer, called with the arguments the model's forward gives it: call = (args, kwargs), calib.layer_calls)."""
    args, kwargs = call
    reference = block(x, *args, **kwargs)

    def loss(fq):
        originals = [lin.weight.data for lin in linears]
        try:
            for lin, q in zip(linears, fq):
                lin.weight.data = q.to(lin.weight.dtype)
            return float((block(x, *args, **kwargs) - reference).float().pow(2).mean())
        finally:
            for lin, w in zip(linears, originals):
                lin.weight.data = w

    return loss


@torch.no_grad()
def apply_scale(prev: nn.Module, linears: list[nn.Linear], s: torch.Tensor, x: torch.Tensor,
                dense_readers: tuple[nn.Linear, ...] = ()):
    """prev's output /= s, each Linear's columns (and each dense reader's) *= s, captured input x /= s (in place;
    x is shared)."""
    if isinstance(prev, nn.Linear):
        prev.weight.div_(s.to(prev.weight.dtype).unsqueeze(1))
        if prev.bias is not None:
            prev.bias.div_(s.to(prev.bias.dtype))
    elif isinstance(prev, ZeroCentredRMSNorm):  # y = (1 + weight) * normalized(x)
        prev.weight.copy_(((1.0 + prev.weight.float()) / s - 1.0).to(prev.weight.dtype))
    else:  # RMSNorm: y = weight * normalized(x)
        prev.weight.div_(s.to(prev.weight.dtype))
    for lin in (*linears, *dense_readers):
        lin.weight.mul_(s.to(lin.weight.dtype).unsqueeze(0))
    x.div_(s.to(x.dtype))


@torch.no_grad()
def search_clip(w: torch.Tensor, g: torch.Tensor, group: int, cfg, scale_dtype) -> torch.Tensor:
    """Per (row, group) range shrink in (0, 1] minimizing that group's output error. w [out, in], g [in, in]."""
    out, inp = w.shape
    n_groups = inp // group
    steps = max(1, int(round(cfg.method.clip_max_shrink * cfg.method.clip_grid)))
    blocks = torch.stack([g[j * group : (j + 1) * group, j * group : (j + 1) * group] for j in range(n_groups)])
    wg = w.reshape(out, n_groups, group)
    best_err = torch.full((out, n_groups), float("inf"), device=w.device)
    best_shrink = torch.ones(out, n_groups, device=w.device)
    for i in range(steps):
        r = 1 - i / cfg.method.clip_grid
        shrink = torch.full((out, n_groups), r, device=w.device)
        scale, zero = compute_qparams(w, cfg.bits, group, cfg.symmetric, scale_dtype, shrink)
        codes = quantize_codes(w, scale, zero, cfg.bits).float().reshape(out, n_groups, group)
        zf = 0.0 if zero is None else zero.float().unsqueeze(-1)
        dw = (codes - zf) * scale.float().unsqueeze(-1) - wg  # [out, groups, group]
        err = torch.einsum("ogk,gkl,ogl->og", dw, blocks, dw)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_shrink[better] = r
    return best_shrink


@torch.no_grad()
def quantize_layer(layer: nn.Module, targets: dict[str, nn.Linear], inputs: dict[str, torch.Tensor], cfg,
                   scale_dtype, stats: dict | None = None, call=None, seq_len=None, **_):
    """layer: a DecoderLayer (its `layer_type` picks the mappings); call: the model's arguments for it after the
    hidden state (calib.layer_calls), None when there is no calibration stream."""
    modules = dict(layer.named_modules())
    grams: dict[int, torch.Tensor] = {}  # id(captured input) -> xᵀx/n; inputs are shared by q/k/v and gate/up

    def gram_of(x):
        if id(x) not in grams:
            grams[id(x)] = gram(x)
        return grams[id(x)]

    for mapping in AWQ_MAPPINGS[layer.layer_type]:
        prev = modules.get(mapping.prev)
        names = mapping.linears
        if prev is None or any(n not in targets for n in names):
            continue
        linears = [targets[n] for n in names]
        if any(lin.in_features != _prev_out_features(prev) for lin in linears):
            continue  # e.g. v_proj -> o_proj under grouped-query attention
        x = inputs[names[0]]
        assert all(inputs[n] is x for n in names), f"{names} do not share one captured input"
        if mapping.scored_on is not None and call is not None:
            # captured rows are whole sequences in order: [samples·T, hidden] -> [samples, T, hidden]
            seqs = x[: cfg.method.block_samples * seq_len].reshape(-1, seq_len, x.shape[-1])
            loss_fn = block_output_loss(modules[mapping.scored_on], linears, seqs, call)
        else:
            loss_fn = linear_output_loss(linears, gram_of(x))
        groups = [cfg.group_for(n, lin.in_features) for n, lin in zip(names, linears)]
        s, loss, rtn_loss = search_scale(loss_fn, abs_mean(x), linears, groups, cfg, scale_dtype)
        apply_scale(prev, linears, s, x, tuple(modules[n] for n in mapping.dense_readers))
        if id(x) in grams:
            grams[id(x)] = grams[id(x)] / s.unsqueeze(1) / s.unsqueeze(0)  # second moment of the rescaled x/s
        if stats is not None:
            key = f"{mapping.prev}->" + "+".join(n.rsplit(".", 1)[-1] for n in names)
            stats[key] = {"awq_loss": loss, "rtn_loss": rtn_loss}
    results = {}
    for name, lin in targets.items():
        w = lin.weight.float()
        group = cfg.group_for(name, w.shape[1])
        shrink = None
        if cfg.method.clip and not name.endswith(NO_CLIP):
            shrink = search_clip(w, gram_of(inputs[name]), group, cfg, scale_dtype)
        scale, zero = compute_qparams(w, cfg.bits, group, cfg.symmetric, scale_dtype, shrink)
        results[name] = QuantizedWeight(quantize_codes(w, scale, zero, cfg.bits), scale, zero, w)
    return results
