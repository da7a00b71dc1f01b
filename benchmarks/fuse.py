"""Fused vs unfused projections (model/fuse.py): one-token and (k+1)-token forward times, interleaved A/B.

Models: the bundled target and draft in fp32, and their W4 versions (RTN g128 in-process; the kernel speed does not
depend on how codes were chosen), each loaded twice (load_model(fuse=False / True)). After a --context-token prompt,
each repetition times every model on the same step, so background load hits all alike; per model: the median.
Usage: python benchmarks/fuse.py [--reps 25] [--context 300] [--threads N]; a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specquant.loader import load_model
from specquant.quant import QuantConfig, quantize
from specquant.spec_decode.config import SpecConfig


def load(name: str, w4: bool, fuse: bool):
    model = load_model(name, torch.float32)
    if w4:
        quantize(model, QuantConfig(method="rtn", group_size=128))
    if fuse:
        from specquant.model.fuse import fuse_projections

        fuse_projections(model)
    return model.eval()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    models = {(name, w4, fuse): load(name, w4, fuse) for name in ("tiny-target", "tiny-draft")
              for w4 in (False, True) for fuse in (False, True)}
    vocab = models[("tiny-target", False, False)].config.vocab_size
    prompt = torch.randint(0, vocab, (1, args.context), generator=gen)
    with torch.no_grad():
        for m in models.values():
            m.setup_cache(1, args.context + 64)
            m(prompt, 0)
        rows = []
        for t in (1, SpecConfig.draft_len + 1):
            ids = torch.randint(0, vocab, (1, t), generator=gen)
            times = {key: [] for key in models}
            for key, m in models.items():  # warm-up
                m(ids, args.context)
            for _ in range(args.reps):
                for key, m in models.items():
                    t0 = time.perf_counter()
                    m(ids, args.context)
                    times[key].append(time.perf_counter() - t0)
            for name in ("tiny-target", "tiny-draft"):
                for w4 in (False, True):
                    plain = statistics.median(times[(name, w4, False)]) * 1e3
                    fused = statistics.median(times[(name, w4, True)]) * 1e3
                    rows.append({"model": name, "weights": "W4" if w4 else "fp32", "tokens": t, "plain_ms": plain,
                                 "fused_ms": fused, "speedup": plain / fused})
    print(f"{'model':<12} {'weights':>7} {'tokens':>6} {'plain ms':>9} {'fused ms':>9} {'speedup':>8}")
    for r in rows:
        print(f"{r['model']:<12} {r['weights']:>7} {r['tokens']:>6} {r['plain_ms']:9.2f} {r['fused_ms']:9.2f} "
              f"{r['speedup']:7.2f}x")
    print(json.dumps({"benchmark": "fuse", "threads": args.threads, "context": args.context, "rows": rows}))


if __name__ == "__main__":
    main()
