"""Which QuantLinear backend is fastest on this CPU? Per-layer latency for 1..16 rows, fp32 and bf16 activations.

Shapes: the tiny-target projections (384->384 q/o, 384->128 k/v, 384->1024 gate/up, 1024->384 down), its lm_head
(384->8192) and one 4096x4096 layer. W4 g128 symmetric.

Weights are timed *streamed*, as in a real forward pass: each timed pass walks --copies-mb worth of distinct copies
of the layer (well past the last-level cache), so every call reads its weight from memory. Timing one layer
over and over instead keeps it in cache and measures arithmetic only; on the 2-core AMD EPYC dev box that
flipped the ranking (dense fp32 looked fastest, and is the slowest once streamed). Times are the median of --reps
passes, per call. The dense nn.Linear in the activation dtype is timed side by side as the baseline; `reference`
(dequantize on every call) is timed only from LARGE_ROWS / 2 rows on, where auto may pick it for prefill.

Measured on that box (AVX2, no AVX-512/AMX, ~5 GB/s streamed GEMV bandwidth), 2 threads, fp32 activations:
int4pack_cpu_bf16 was fastest at 1-4 rows on every shape, e.g. 384->1024 one row 94 us vs dense fp32 287 us
(dense fp32 is memory-bound and gains nothing from the second thread), and up to 16 rows on all but the smallest
layers (384->128, 384->384: dense within ~20%). int4pack_cpu with fp32 activations is 10-40x slower than either.
From 64-128 rows on, dequantize-per-call (`reference`) + one dense GEMM catches up with the kernel (384x384, 128
rows: 0.85 vs 0.95 ms). auto_backend in specquant/quant/linear.py follows this.
Usage: python benchmarks/quant_backends.py [--threads N] [--reps 5]; the last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

from specquant.quant.config import QuantConfig
from specquant.quant.grid import quantize_weight
from specquant.quant.linear import BACKENDS, LARGE_ROWS, QuantLinear
from specquant.util.flags import finite_float

SHAPES = [(384, 384), (384, 128), (384, 1024), (1024, 384), (384, 8192), (4096, 4096)]  # (in, out)
ROWS = [1, 2, 4, 9, 16]


def time_streamed(fns, reps: int) -> float:
    """Median over reps of one pass calling every fn once, per call."""
    for fn in fns[:2]:
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for fn in fns:
            fn()
        samples.append((time.perf_counter() - t0) / len(fns))
    return statistics.median(samples)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--copies-mb", type=finite_float(96.0), default=96.0,
                    help="weight bytes walked per pass (past the LLC)")
    ap.add_argument("--shapes", default=None, help="comma list like 384x1024,4096x4096 (in x out)")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma list of row counts")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes = SHAPES if not args.shapes else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    cfg = QuantConfig(method="rtn", bits=4, group_size=128)
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    with torch.inference_mode():
        for inp, out in shapes:
            copies = max(4, math.ceil(args.copies_mb * 1e6 / (inp * out * 4)))
            w = torch.randn(out, inp) * inp**-0.5
            for dtype in (torch.float32, torch.bfloat16):
                codes, scale, zero = quantize_weight(w, cfg, scale_dtype=dtype)
                qlins = [QuantLinear.from_codes(codes, scale, zero, 4) for _ in range(copies)]
                denses = []
                for q in qlins:
                    d = torch.nn.Linear(inp, out, bias=False).to(dtype)
                    d.weight.data.copy_(q.dequantized_weight().to(dtype))
                    denses.append(d)
                for rows in rows_list:
                    x = torch.randn(rows, inp, dtype=dtype)
                    row = {"in": inp, "out": out, "dtype": str(dtype).removeprefix("torch."), "rows": rows,
                           "copies": copies, "dense_us": time_streamed([lambda d=d: d(x) for d in denses],
                                                                      args.reps) * 1e6}
                    # reference (dequantize per call) is a candidate only where auto may pick it
                    for name in [n for n in BACKENDS if n != "reference" or rows >= LARGE_ROWS // 2]:
                        if not BACKENDS[name].supports(qlins[0], x):
                            continue
                        for q in qlins:
                            q.backend = name
                            q.invalidate()
                        row[f"{name}_us"] = time_streamed([lambda q=q: q(x) for q in qlins], args.reps) * 1e6
                    timed = {k[:-3]: v for k, v in row.items() if k.endswith("_us")}
                    row["fastest"] = min(timed, key=timed.get)
                    results.append(row)
                    cols = "  ".join(f"{k[:-3]}={v:9.1f}" for k, v in row.items() if k.endswith("_us"))
                    print(f"{inp:>5}->{out:<5} {row['dtype']:>8} rows={rows:<3} {cols}  fastest={row['fastest']}",
                          flush=True)
                del qlins, denses
    summary = {}
    for r in results:
        summary.setdefault(r["dtype"], {}).setdefault(r["fastest"], 0)
        summary[r["dtype"]][r["fastest"]] += 1
    print(json.dumps({"threads": args.threads, "copies_mb": args.copies_mb, "results": results,
                      "fastest_counts": summary}))


if __name__ == "__main__":
    main()
