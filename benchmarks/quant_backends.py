"""Which QuantLinear backend is fastest on this CPU? Per-layer latency for 1..16 rows, fp32 and bf16.

Shapes: the tiny-target projections (384->384 q/o, 384->128 k/v, 384->1024 gate/up, 1024->384 down) and one
4096x4096 layer. W4 g128 symmetric. Times are medians of --reps repetitions (each the mean of --inner calls)
after warm-up; the dense nn.Linear in the same dtype is timed side by side as the baseline.
The auto policy in specquant/quant/linear.py (`auto_backend`) follows what this prints.

Measured on the 2-core AMD EPYC dev box (AVX2, no AVX-512/AMX), one thread, with a training job sharing the
cores (absolute numbers noisy, orderings stable): fp32 -> dequant_cached fastest at every shape and row count
(int4pack_cpu with fp32 activations is 10-40x slower); bf16 -> int4pack_cpu fastest at every shape for 2-16
rows and at 1 row except 384->128 (tie), e.g. 4096x4096 1 row: int4pack 3.0 ms, dense bf16 6.3 ms, dense
fp32 5.0 ms.
Usage: python benchmarks/quant_backends.py [--threads N] [--reps 7]; the last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specquant.quant.config import QuantConfig
from specquant.quant.grid import quantize_weight
from specquant.quant.linear import BACKENDS, QuantLinear

SHAPES = [(384, 384), (384, 128), (384, 1024), (1024, 384), (4096, 4096)]  # (in, out)
ROWS = [1, 2, 4, 9, 16]


def time_call(fn, reps: int, inner: int) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--shapes", default=None, help="comma list like 384x1024,4096x4096 (in x out)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes = SHAPES if not args.shapes else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    cfg = QuantConfig(method="rtn", bits=4, group_size=128)
    results = []
    with torch.inference_mode():
        for inp, out in shapes:
            w = torch.randn(out, inp) * inp**-0.5
            inner = max(1, int(2e6 / (inp * out)))
            for dtype in (torch.float32, torch.bfloat16):
                codes, scale, zero = quantize_weight(w, cfg, scale_dtype=dtype)
                qlin = QuantLinear.from_codes(codes, scale, zero, 4)
                dense = torch.nn.Linear(inp, out, bias=False).to(dtype)
                dense.weight.data.copy_(qlin.dequantized_weight().to(dtype))
                for rows in ROWS:
                    x = torch.randn(rows, inp, dtype=dtype)
                    row = {"in": inp, "out": out, "dtype": str(dtype).removeprefix("torch."), "rows": rows,
                           "dense_us": time_call(lambda: dense(x), args.reps, inner) * 1e6}
                    for name, be in BACKENDS.items():
                        if not be.supports(qlin, x):
                            continue
                        qlin.backend = name
                        qlin.invalidate()
                        n = 1 if name == "reference" and inp * out > 4e6 else inner
                        row[f"{name}_us"] = time_call(lambda: qlin(x), args.reps, n) * 1e6
                    timed = {k[:-3]: v for k, v in row.items() if k.endswith("_us") and k != "dense_us"}
                    row["fastest"] = min(timed, key=timed.get)
                    results.append(row)
                    cols = "  ".join(f"{k[:-3]}={v:9.1f}" for k, v in row.items() if k.endswith("_us"))
                    print(f"{inp:>5}->{out:<5} {row['dtype']:>8} rows={rows:<3} {cols}  fastest={row['fastest']}",
                          flush=True)
    summary = {}
    for r in results:
        summary.setdefault(r["dtype"], {}).setdefault(r["fastest"], 0)
        summary[r["dtype"]][r["fastest"]] += 1
    print(json.dumps({"threads": args.threads, "results": results, "fastest_counts": summary}))


if __name__ == "__main__":
    main()
