"""Few-row dense GEMMs on CPU: F.linear (x·Wᵀ), W·xᵀ (torch.mm with the roles swapped), the native few-row linear
(kernels/ops.py `linear`) and the decoder's Linear (which picks among them).

Shapes: the bundled target's (384->384, 384->128, 384->1024, 1024->384) and its lm_head (384->8192), and with
--shapes any list (the Qwen3-0.6B decoder's fused projections: 1024x4096,1024x6144,3072x1024,2048x1024), for
1..16 rows, fp32 (and bf16 for the torch paths with --bf16). Weights are streamed as in a forward pass: each timed
pass walks --copies-mb of distinct copies, so every call reads its weight from memory. Per call: the median of
--reps passes.
Usage: python benchmarks/small_gemm.py [--threads N] [--reps 5] [--shapes 1024x4096,...] [--rows 1,4,8] [--bf16];
a table, then one JSON line.
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

from specquant.kernels import ops  # noqa: E402
from specquant.model.decoder import Linear  # noqa: E402
from specquant.util.flags import finite_float  # noqa: E402

SHAPES = [(384, 384), (384, 128), (384, 1024), (1024, 384), (384, 8192)]  # (in, out)
ROWS = [1, 2, 4, 5, 9, 16]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--copies-mb", type=finite_float(96.0), default=96.0)
    ap.add_argument("--shapes", default=None, help="comma list like 1024x4096 (in x out); default: the bundled ones")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma list of row counts")
    ap.add_argument("--bf16", action="store_true", help="also time the torch paths in bf16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes = SHAPES if not args.shapes else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows_list = [int(r) for r in args.rows.split(",")]
    native = ops.LIBRARY.library() is not None
    variant = ops.LIBRARY.choose()[0] if native else None
    print(f"native ops variant: {variant.name if variant else 'none'}")
    print(f"{'shape':>12} {'dtype':>9} {'rows':>4} {'F.linear us':>12} {'W·xT us':>9} {'native us':>10} "
          f"{'Linear us':>10} {'F.linear/Linear':>15}")
    results = []
    with torch.inference_mode():
        for inp, out in shapes:
            for dtype in (torch.float32, torch.bfloat16) if args.bf16 else (torch.float32,):
                n = max(4, math.ceil(args.copies_mb * 1e6 / (inp * out * 4)))
                layers = [Linear(inp, out, bias=False).to(dtype) for _ in range(n)]
                for rows in rows_list:
                    x = torch.randn(rows, inp, dtype=dtype)
                    plain = time_streamed([lambda m=m: F.linear(x, m.weight) for m in layers], args.reps) * 1e6
                    swapped = time_streamed([lambda m=m: torch.mm(m.weight, x.t()).t().contiguous() for m in layers],
                                            args.reps) * 1e6
                    nat = (time_streamed([lambda m=m: ops.linear(x, m.weight) for m in layers], args.reps) * 1e6
                           if native and dtype == torch.float32 else float("nan"))
                    ours = time_streamed([lambda m=m: m(x) for m in layers], args.reps) * 1e6
                    row = {"in": inp, "out": out, "dtype": str(dtype).removeprefix("torch."), "rows": rows,
                           "f_linear_us": plain, "mm_swapped_us": swapped, "native_us": nat, "linear_us": ours,
                           "speedup": plain / ours}
                    results.append(row)
                    print(f"{inp:>5}->{out:<6} {row['dtype']:>9} {rows:>4} {plain:12.1f} {swapped:9.1f} {nat:10.1f} "
                          f"{ours:10.1f} {plain / ours:14.2f}x", flush=True)
                del layers
    print(json.dumps({"benchmark": "small_gemm", "threads": args.threads, "native": variant.name if variant else None,
                      "results": results}))


if __name__ == "__main__":
    main()
