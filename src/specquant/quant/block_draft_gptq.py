"""GPTQ W4 of the block drafter, calibrated on teacher-forced target features (REFERENCE.md §3, "GPTQ").

Calibration: for each sequence the target runs once (teacher-forced) and gives the context features; at
`anchors` evenly spaced (linspace) positions the drafter runs its serving computation — context before the
anchor, block [token, MASK...] — all blocks in one forward (the training mask; tests/test_block_draft.py ties it to
the serving path). Forward-pre hooks on every drafter Linear (fc included, as in the reference) accumulate
H = 2/n Σ xᵀx; then each Linear is quantized column by column by quant/gptq.py's `gptq_quantize` (sequential
columns, damp·mean(diag H)) and swapped for a QuantLinear. One dense capture pass serves every Linear: the
drafter is 2-5 layers, so the layer-by-layer re-capture of a deep target buys little here.

The target may be dense or a hybrid (Qwen3.5): its features come from its own forward (`hidden_layers`), whatever
its layer kinds, so a hybrid's drafter is calibrated on the hybrid's features the same way.

The window is a serve-time setting (SpecConfig.draft_window / the drafter's `specquant_sliding_window`), not baked in.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from specquant.model.block_draft import BlockDraftModel
from specquant.quant.config import QuantConfig
from specquant.quant.gptq import gptq_quantize
from specquant.quant.grid import dequantize
from specquant.quant.pipeline import _error_row, _swap, tensor_bytes


def calibration_anchors(batch: int, seq_len: int, anchors: int, device=None) -> torch.Tensor:
    """[batch, anchors] evenly spaced anchor positions in 1 .. seq_len-2 (the reference's linspace)."""
    pos = torch.linspace(1, seq_len - 2, anchors, device=device).round().long().unique()
    return pos[None].expand(batch, -1)


@torch.no_grad()
def drafter_hessians(drafter: BlockDraftModel, target, tokens: torch.Tensor, anchors: int = 16,
                     batch: int = 4, on_batch=None) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """tokens [N, L] -> ({Linear name: H [in, in] float32}, {name: a subsample of its inputs, for the report});
    on_batch: called after each batch of `batch` sequences (progress)."""
    linears = {n: m for n, m in drafter.named_modules() if isinstance(m, nn.Linear)}
    sums = {n: torch.zeros(m.in_features, m.in_features) for n, m in linears.items()}
    counts = dict.fromkeys(linears, 0)
    samples: dict[str, torch.Tensor] = {}

    def hook(name):
        def fn(_mod, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            sums[name].addmm_(x.t(), x)
            counts[name] += x.shape[0]
            if name not in samples:
                samples[name] = x[:512].clone()
        return fn

    ids = tuple(drafter.config.target_layer_ids)
    handles = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
    try:
        for i in range(0, len(tokens), batch):
            tok = tokens[i : i + batch]
            _, hidden = target(tok, hidden_layers=ids, hidden_only=True)  # [b, L, taps, hidden]
            drafter.block_logits(hidden.flatten(2), tok, calibration_anchors(len(tok), tok.shape[1], anchors))
            if on_batch is not None:
                on_batch()
    finally:
        for h in handles:
            h.remove()
    return {n: sums[n].mul_(2.0 / max(counts[n], 1)) for n in linears}, samples


@torch.no_grad()
def gptq_block_drafter(drafter: BlockDraftModel, target, tokens: torch.Tensor, cfg: QuantConfig,
                       anchors: int = 16, progress: bool | str = False) -> dict:
    """Quantize every Linear of the drafter in place (GPTQ, cfg.bits / group / damp); returns a report.
    progress: a bar over the calibration batches and the Linears (util/progress.py: True, BAR_ONLY or False)."""
    from specquant.util.progress import progress_for

    cfg = cfg.validate()
    started = time.perf_counter()
    drafter.eval()
    drafter.attach_target(target)
    linears = {n: m for n, m in drafter.named_modules() if isinstance(m, nn.Linear)}
    for n, m in linears.items():
        cfg.group_for(n, m.in_features)  # every group size checked before any work
    bytes_before = tensor_bytes(drafter)
    batches = -(-len(tokens) // 4)  # drafter_hessians' default batch
    with progress_for(progress, batches + len(linears), "GPTQ block drafter", "step") as bar:
        hessians, samples = drafter_hessians(drafter, target, tokens, anchors,
                                             on_batch=lambda: bar.update(1, status="calibration"))
        scale_dtype = drafter.norm.weight.dtype
        rows = []
        for name, lin in linears.items():
            res = gptq_quantize(lin.weight, hessians[name], cfg, cfg.group_for(name, lin.in_features), scale_dtype,
                                name)
            deq = dequantize(res.codes, res.scale.float(), res.zero)
            rows.append(_error_row(name, res, deq, samples.get(name), cfg.seed))
            _swap(drafter, name, res, lin, cfg.bits)
            bar.update(1, status=name)
    drafter.quant_config = cfg
    return {"method": "gptq", "config": cfg.to_json(), "layers": rows, "quantized_linears": len(rows),
            "calibration": {"sequences": len(tokens), "seq_len": tokens.shape[1], "anchors_per_sequence": anchors},
            "bytes_before": bytes_before, "bytes_after": tensor_bytes(drafter),
            "seconds": round(time.perf_counter() - started, 2)}
