"""Interleaved A/B of QuantLinear backends on one layer shape, robust to a busy machine.

Each repetition calls every backend's copies of the layer once, in turn (interleaved), so background load hits all
alike; --copies distinct copies per backend are walked per pass so weights stream from memory (use enough copies
to exceed the LLC; 1 copy = weights in cache, i.e. arithmetic only). Times are the median over --reps of
`--clock process` CPU time (not counting time the process waited for a core: steadier on a shared box, exact for
one thread) or `--clock wall`. W4 RTN group --group, symmetric, fp32 activations.
Usage: python benchmarks/w4_ab.py --shape 2048x1024 --copies 80 [--rows 1,4,8] [--backends a,b] [--threads 1]
A table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specquant.quant.config import QuantConfig
from specquant.quant.grid import quantize_weight
from specquant.quant.linear import QuantLinear


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="2048x1024", help="IN x OUT")
    ap.add_argument("--copies", type=int, default=80)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--backends", default="int4pack_cpu_bf16,native_w4_bf16")
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--clock", choices=("process", "wall"), default="process")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "process" else time.perf_counter
    inp, out = (int(v) for v in args.shape.split("x"))
    names = args.backends.split(",")
    w = torch.randn(out, inp) * inp**-0.5
    codes, scale, zero = quantize_weight(w, QuantConfig(method="rtn", group_size=args.group),
                                         scale_dtype=torch.float32)
    sets = {n: [QuantLinear.from_codes(codes, scale, zero, 4) for _ in range(args.copies)] for n in names}
    for n, qs in sets.items():
        for q in qs:
            q.backend = n
    nbytes = inp * out * (0.5 + 4 / args.group)
    results = []
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, inp)
            for qs in sets.values():
                for q in qs:
                    q(x)
            samples = {n: [] for n in names}
            for _ in range(args.reps):
                for n, qs in sets.items():
                    t0 = clock()
                    for q in qs:
                        q(x)
                    samples[n].append((clock() - t0) / args.copies)
            row = {"in": inp, "out": out, "rows": rows, **{f"{n}_us": statistics.median(v) * 1e6
                                                            for n, v in samples.items()}}
            results.append(row)
            print(f"{inp}->{out} x{args.copies} rows={rows:<3} " + "  ".join(
                f"{n}={row[n + '_us']:8.0f} us ({nbytes / row[n + '_us'] / 1e3:4.1f} GB/s)" for n in names),
                flush=True)
    print(json.dumps({"benchmark": "w4_ab", "threads": args.threads, "clock": args.clock, "results": results}))


if __name__ == "__main__":
    main()
