"""lm_head precision (QuantConfig.lm_head): KL, top-1 agreement and bytes of dense / bf16 / w8 / w4 heads.

For each bundled model (tiny-target, tiny-draft: real trained weights), the fp32 model with its dense head is the
reference; only the head is changed, so the numbers isolate the head's precision. Text: --samples blocks of
--seq-len tokens from the held-out split (src/specquant/data/heldout.txt). Also the head's one-row time, each
precision timed interleaved with the others (median of --reps).
Usage: python benchmarks/lm_head.py [--models tiny-target,tiny-draft] [--samples 16] [--seq-len 256]
A table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specquant.loader import load_model
from specquant.model.checkpoint import load_tokenizer
from specquant.quant.config import HEAD_PRECISIONS
from specquant.quant.head import set_lm_head
from specquant.quant.linear import DERIVED_BUFFERS
from specquant.quant.quality import compare, heldout_tokens, logprobs

HELDOUT = Path(__file__).resolve().parent.parent / "src" / "specquant" / "data" / "heldout.txt"


def head_bytes(head: torch.nn.Module) -> int:
    """The head's checkpoint bytes: parameters and buffers, not those a QuantLinear backend derives from them."""
    seen = {id(t): t for t in list(head.parameters()) + [b for n, b in head.named_buffers()
                                                          if n.rsplit(".", 1)[-1] not in DERIVED_BUFFERS]}
    return sum(t.numel() * t.element_size() for t in seen.values())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny-target,tiny-draft")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    rows = []
    print(f"{'model':<12} {'head':<6} {'KL nats':>9} {'top-1':>7} {'ppl':>8} {'bytes':>11} {'1-row us':>9}")
    with torch.inference_mode():
        for name in args.models.split(","):
            tokens = heldout_tokens(load_tokenizer(name), HELDOUT, args.samples, args.seq_len)
            ref_model = load_model(name)
            ref = logprobs(ref_model, tokens)
            models = {}
            for precision in HEAD_PRECISIONS:
                m = load_model(name)
                set_lm_head(m, precision)
                models[precision] = m
            x = torch.randn(1, 1, ref_model.config.hidden_size)
            samples = {p: [] for p in HEAD_PRECISIONS}
            for m in models.values():
                m.lm_head(x)
            for _ in range(args.reps):
                for p, m in models.items():
                    t0 = time.perf_counter()
                    m.lm_head(x)
                    samples[p].append(time.perf_counter() - t0)
            for precision, m in models.items():
                q = compare(ref, m, tokens)
                row = {"model": name, "lm_head": precision, "kl": q["kl"], "top1_agree": q["top1_agree"],
                       "ppl": q["ppl"], "ppl_ref": q["ppl_ref"], "bytes": head_bytes(m.lm_head),
                       "one_row_us": statistics.median(samples[precision]) * 1e6}
                rows.append(row)
                print(f"{name:<12} {precision:<6} {row['kl']:9.2e} {row['top1_agree']:7.2%} {row['ppl']:8.2f} "
                      f"{row['bytes']:11,} {row['one_row_us']:9.1f}", flush=True)
    print(json.dumps({"benchmark": "lm_head", "samples": args.samples, "seq_len": args.seq_len, "rows": rows}))


if __name__ == "__main__":
    main()
