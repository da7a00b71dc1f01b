"""Few-row dense GEMMs on CPU: F.linear (x·Wᵀ) vs the decoder's Linear (W·xᵀ for up to 8 fp32 rows).

The shapes of the bundled target (384->384, 384->128, 384->1024, 1024->384) and its lm_head (384->8192), for 1..16
rows, fp32 and bf16. Weights are streamed as in a forward pass: each timed pass walks --copies-mb of distinct
copies, so every call reads its weight from memory. Per call: the median of --reps passes.
Usage: python benchmarks/small_gemm.py [--threads N] [--reps 5]; a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_backends import time_streamed  # noqa: E402  (one streamed-weights timer for both kernel benchmarks)

from specquant.model.decoder import Linear  # noqa: E402
from specquant.util.flags import finite_float  # noqa: E402

SHAPES = [(384, 384), (384, 128), (384, 1024), (1024, 384), (384, 8192)]  # (in, out)
ROWS = [1, 2, 4, 5, 9, 16]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--copies-mb", type=finite_float(96.0), default=96.0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    results = []
    print(f"{'shape':>12} {'dtype':>9} {'rows':>4} {'F.linear us':>12} {'Linear us':>10} {'ratio':>6}")
    with torch.inference_mode():
        for inp, out in SHAPES:
            for dtype in (torch.float32, torch.bfloat16):
                n = max(4, math.ceil(args.copies_mb * 1e6 / (inp * out * 4)))
                layers = [Linear(inp, out, bias=False).to(dtype) for _ in range(n)]
                for rows in ROWS:
                    x = torch.randn(rows, inp, dtype=dtype)
                    plain = time_streamed([lambda m=m: F.linear(x, m.weight) for m in layers], args.reps) * 1e6
                    ours = time_streamed([lambda m=m: m(x) for m in layers], args.reps) * 1e6
                    row = {"in": inp, "out": out, "dtype": str(dtype).removeprefix("torch."), "rows": rows,
                           "f_linear_us": plain, "linear_us": ours, "speedup": plain / ours}
                    results.append(row)
                    print(f"{inp:>5}->{out:<6} {row['dtype']:>9} {rows:>4} {plain:12.1f} {ours:10.1f} "
                          f"{plain / ours:5.2f}x", flush=True)
                del layers
    print(json.dumps({"benchmark": "small_gemm", "threads": args.threads, "results": results}))


if __name__ == "__main__":
    main()
