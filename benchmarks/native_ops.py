"""Whole decode / verify steps with the native small ops (kernels/ops.py) against the same steps on their torch
references, interleaved in one process on one model.

A random-init model of each shape (shapes.py's SHAPES and build: W4 RTN g32 of the bf16 weights, fused projections,
the --lm-head precision), a --context token prompt in the cache, then forwards of T tokens at that position. Each
repetition runs every T once with the native ops disabled (as SPECQUANT_NATIVE without an ops variant would) and
once with them, so background load hits both alike; figures are medians over --reps after --warmup repetitions.
--max-rows sets model.attention.NATIVE_MAX_ROWS for the run (the largest step that takes the native attention), so
its choice can be re-measured. SPECQUANT_NATIVE=avx2,portable runs what an AVX2-only CPU gets.

Usage: python benchmarks/native_ops.py [--shapes qwen3-0.6b] [--modes w4a8] [--rows 1,4,8,16] [--context 128]
       [--reps 10] [--warmup 2] [--threads N] [--lm-head w4] [--max-rows N]
A table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import SHAPES, build  # noqa: E402

import specquant.model.attention as attention  # noqa: E402
from specquant.kernels import LIBRARIES, ops  # noqa: E402


def measure(model, rows: list[int], context: int, reps: int, warmup: int) -> dict:
    cfg = model.config
    gen = torch.Generator().manual_seed(1)
    model.setup_cache(1, context + max(rows) + 1)
    on, off = ops.LIBRARY.choose(), (None, None, "disabled for the A/B")
    samples = {(arm, t): [] for arm in ("torch", "native") for t in rows}
    try:
        with torch.inference_mode():
            model(torch.randint(0, cfg.vocab_size, (1, context), generator=gen), 0)
            for rep in range(warmup + reps):
                for arm, choice in (("torch", off), ("native", on)):
                    ops.LIBRARY._choice = choice
                    for t in rows:
                        tokens = torch.randint(0, cfg.vocab_size, (1, t), generator=gen)
                        t0 = time.perf_counter()
                        model(tokens, context)
                        if rep >= warmup:
                            samples[(arm, t)].append(time.perf_counter() - t0)
    finally:
        ops.LIBRARY._choice = on
        model.clear_cache()
    return {t: {"torch_ms": statistics.median(samples[("torch", t)]) * 1e3,
                "native_ms": statistics.median(samples[("native", t)]) * 1e3} for t in rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3-0.6b")
    ap.add_argument("--modes", default="w4a8")
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--lm-head", default="w4")
    ap.add_argument("--max-rows", type=int, default=attention.NATIVE_MAX_ROWS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if ops.LIBRARY.library() is None:
        sys.exit(f"native ops unavailable ({ops.LIBRARY.why()}); nothing to compare")
    for shape in args.shapes.split(","):
        if shape not in SHAPES:
            sys.exit(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    attention.NATIVE_MAX_ROWS = args.max_rows
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    print(f"native ops {ops.LIBRARY.why()}, {args.threads} threads, context {args.context}, "
          f"native attention up to {args.max_rows} rows")
    print(f"{'shape':14s} {'mode':6s} {'T':>3s} {'torch ms':>9s} {'native ms':>9s} {'speedup':>8s}")
    for shape in args.shapes.split(","):
        for mode in args.modes.split(","):
            model = build(SHAPES[shape](), mode, args.lm_head)
            res = measure(model, rows, args.context, args.reps, args.warmup)
            del model
            for t, r in res.items():
                r["speedup"] = r["torch_ms"] / r["native_ms"]
                print(f"{shape:14s} {mode:6s} {t:3d} {r['torch_ms']:9.2f} {r['native_ms']:9.2f} {r['speedup']:7.3f}x")
                results.append({"shape": shape, "mode": mode, "rows": t, **r})
    print(json.dumps({"benchmark": "native_ops", "threads": args.threads, "context": args.context, "reps": args.reps,
                      "max_rows": args.max_rows, "kernels": {n: lib.why() for n, lib in LIBRARIES.items()},
                      "torch": torch.__version__, "results": results}))


if __name__ == "__main__":
    main()
