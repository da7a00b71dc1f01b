"""Is the draft's confidence a usable stop signal? P(draft argmax == target argmax) by the draft's top probability.

Teacher-forced over the bundled content prompts and the first --heldout-tokens of data/heldout.txt (in 512-token
windows): at every position, the draft's top-1 probability and whether its argmax equals the target's. Greedy
speculative decoding accepts a drafted token exactly when they agree (given an accepted prefix), so the match rate
per bin says what a confidence stop (SpecConfig.draft_confidence) would throw away.
Usage: python benchmarks/draft_confidence.py [--target tiny-target] [--draft tiny-draft]; a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specquant.bench.prompts import load_prompts
from specquant.model.checkpoint import load_tokenizer
from specquant.loader import load_model

BINS = [0.0, 0.01, 0.02, 0.03, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.01]
HELDOUT = Path(__file__).resolve().parent.parent / "src" / "specquant" / "data" / "heldout.txt"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="tiny-target")
    ap.add_argument("--draft", default="tiny-draft")
    ap.add_argument("--heldout-tokens", type=int, default=4096)
    args = ap.parse_args()
    tok = load_tokenizer(args.target)
    target, draft = load_model(args.target, fuse=True), load_model(args.draft, fuse=True)
    prompts = load_prompts(tok, {"short": 32}, ("prose", "code", "qa"), 1, 100, 512, None)
    seqs = [p.ids for p in prompts if p.kind == "content"]
    ids = tok.encode(HELDOUT.read_text())[: args.heldout_tokens]
    seqs += [ids[i : i + 512] for i in range(0, len(ids), 512)]
    probs, match = [], []
    with torch.no_grad():
        for s in seqs:
            x = torch.tensor([s])
            top = draft(x)[0].softmax(-1).max(-1)
            probs.append(top.values)
            match.append(top.indices == target(x)[0].argmax(-1))
    probs, match = torch.cat(probs), torch.cat(match).float()
    rows = []
    print(f"{'draft top prob':>16} {'share':>6} {'P(match)':>9}")
    for lo, hi in zip(BINS, BINS[1:]):
        sel = (probs >= lo) & (probs < hi)
        if not sel.any():
            continue
        rows.append({"lo": lo, "hi": min(hi, 1.0), "share": float(sel.float().mean()),
                     "match_rate": float(match[sel].mean()), "positions": int(sel.sum())})
        print(f"{f'[{lo:.2f}, {min(hi, 1.0):.2f})':>16} {rows[-1]['share']:6.2f} {rows[-1]['match_rate']:9.2f}")
    print(f"all {len(probs)} positions: P(match) {float(match.mean()):.3f}, median top prob "
          f"{float(probs.median()):.3f}")
    print(json.dumps({"benchmark": "draft_confidence", "positions": len(probs), "match_rate": float(match.mean()),
                      "median_top_prob": float(probs.median()), "bins": rows}))


if __name__ == "__main__":
    main()
