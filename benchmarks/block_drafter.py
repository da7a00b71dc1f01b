"""The block drafter's proposal at real model shapes: its layers as one native call each, beside their modules.

A block drafter (model/block_draft.py, DFlash's layout) of a target shape's width (bench.shapes.SHAPES: Qwen3 and
the Qwen3.5 hybrids), random-init and laid out as the block kind loads one (bench.shapes.block_drafter: fused,
W4 = RTN g32 with bf16 scales on int8 (w4a8) or float (w4) activations, or dense bf16 values stored bf16). Each
repetition times, interleaved, one `propose` of a whole block (--block rows) after --pending new context rows (the
target features of the positions accepted since the last block, as the drafter keeps them: projected by fc and
written to the context cache by the same forward), over --context rows of context, then rolls the context back:
  native   every layer one call (model/native_layer.py block_step: the pending rows' K/V ride on the block's qkv)
  modules  every layer on its modules (native_layer.ENABLED off: the pending rows' K/V projected first, then the
           block), as before the one-call layer
Figures are medians over --reps (ms per proposal). The drafter's head is left out: it is the target's lm_head on k
rows, which both paths run alike (a 248K-row head would dwarf the layers being compared), so the model is built
with a 1024-token vocabulary and an identity head. `floor` = the bytes of the drafter's fc and layer weights over the
streamed read bandwidth measured at the start of the run (bench.shapes.streamed_bandwidth).

Usage: python benchmarks/block_drafter.py [--shapes qwen3-0.6b,qwen3.5-0.8b] [--modes w4a8,bf16] [--layers 1]
       [--block 16] [--pending 3] [--context 256] [--reps 5] [--threads N]
A table, then one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import torch

from specquant.bench.shapes import SHAPES, block_drafter, module_bytes, streamed_bandwidth
from specquant.model import native_layer


class _Target(torch.nn.Module):
    """What attach_target reads of a target: its config, embedding and head (identity: module docstring)."""

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.lm_head = torch.nn.Identity()


def run(shape: str, mode: str, layers: int, block: int, pending: int, context: int, reps: int) -> dict:
    cfg = dataclasses.replace(SHAPES[shape](), vocab_size=1024)
    draft = block_drafter(cfg, mode, layers, block).attach_target(_Target(cfg))
    width = len(draft.config.target_layer_ids) * cfg.hidden_size
    gen = torch.Generator().manual_seed(0)
    feats = torch.randn(1, context + pending, width, generator=gen)
    anchor = torch.tensor(5)
    weights = module_bytes(draft.fc) + sum(module_bytes(layer) for layer in draft.layers)
    times = {"native": [], "modules": []}
    with torch.inference_mode():
        draft.setup_cache(context + pending + 1, window=None)
        draft.append_context(feats[:, :context])
        for rep in range(reps + 1):  # the first round warms up (plans, scratch)
            for path in times:
                native_layer.ENABLED = path == "native"
                t0 = time.perf_counter()
                draft.propose(anchor, block - 1, feats[:, context:])
                if rep:
                    times[path].append(time.perf_counter() - t0)
                draft.rollback(context)
    native_layer.ENABLED = True
    ms = {path: statistics.median(v) * 1e3 for path, v in times.items()}
    return {"shape": shape, "mode": mode, "layers": layers, "block": block, "pending": pending, "context": context,
            "weight_mb": round(weights / 2**20, 1), **{f"{p}_ms": round(v, 3) for p, v in ms.items()},
            "speedup": round(ms["modules"] / ms["native"], 2)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="qwen3-0.6b,qwen3.5-0.8b")
    ap.add_argument("--modes", default="w4a8,bf16")
    ap.add_argument("--layers", type=int, default=1, help="drafter layers (DFlash's released drafters: 1 to 5)")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--pending", type=int, default=3)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    bandwidth = streamed_bandwidth()
    rows = [run(s, m, args.layers, args.block, args.pending, args.context, args.reps)
            for s in args.shapes.split(",") for m in args.modes.split(",")]
    for r in rows:
        r["floor_ms"] = round(r["weight_mb"] * 2**20 / bandwidth / 1e6, 3)
    print(f"threads {torch.get_num_threads()}, streamed {bandwidth:.1f} GB/s, OMP_NUM_THREADS "
          f"{os.environ.get('OMP_NUM_THREADS', '-')}")
    print("| shape | mode | layers | weights MB | floor ms | modules ms | one call ms | speedup |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['mode']} | {r['layers']} | {r['weight_mb']} | {r['floor_ms']} | "
              f"{r['modules_ms']} | {r['native_ms']} | {r['speedup']}x |")
    print(json.dumps({"bandwidth_gbs": round(bandwidth, 1), "threads": torch.get_num_threads(), "rows": rows}))


if __name__ == "__main__":
    main()
