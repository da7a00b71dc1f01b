"""Greedy acceptance of the block drafter vs the LM drafter, and each drafter's forward cost vs a target step.

Cheap where benchmarks/block_draft.py (full timed runs) is not: greedy speculative decoding emits the target's
greedy continuation, so acceptance needs no timing. Block drafter: train.block_draft.greedy_acceptance (exact, no
engine). LM drafter: SpecEngine. Cost: interleaved median of single forwards at the prompt's context — target one-token
decode step, target verify of k+1 rows per k, block drafter forward (one per step), LM drafter one-token forward (k per
step), at a 160-token context; with them each row's predicted decode speedup MAL / ((draft + verify) / target step),
which is how the bench's block k is chosen.

Usage: python benchmarks/block_acceptance.py [--w4-target DIR] [--block-draft [NAME=]DIR,...] [--w4-block DIR]
       [--ks 3,7,15] [--new-tokens 48] [--heldout N]
The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specquant.bench.prompts import load_prompts
from specquant.drafter_loader import load_block_draft
from specquant.loader import load_model
from specquant.model.checkpoint import load_tokenizer
from specquant.spec_decode.config import SpecConfig
from specquant.spec_decode.engine import SpecEngine
from specquant.spec_decode.metrics import SpecMetrics
from specquant.train.block_draft import greedy_acceptance


def timed(fn, reps):
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


@torch.no_grad()
def costs(target, block, lm, ks, context=160, reps=9):
    """Median seconds at `context` earlier positions: target 1-token step, target verify of k+1 rows for each k,
    block drafter forward (one per step, whatever k), LM 1-token forward (k per step); interleaved."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.config.vocab_size, (1, context + max(ks) + 1), generator=g)
    n = context
    target.setup_cache(1, n + max(ks) + 2)
    target(prompt[:, :n], 0)
    lm.setup_cache(1, n + 2)
    lm(prompt[:, :n], 0)
    block.setup_cache(n + 32)
    block.append_context(torch.randn(1, n, len(block.config.target_layer_ids) * block.config.hidden_size,
                                     generator=g).to(block.norm.weight))
    one = prompt[:, n : n + 1]
    res = {"target_step": [], "block_forward": [], "lm_forward": [], **{f"target_verify_{k}": [] for k in ks}}
    for _ in range(reps):  # interleaved, so background load hits all alike
        res["target_step"].append(timed(lambda: target(one, n, last_only=True), 1))
        for k in ks:
            res[f"target_verify_{k}"].append(timed(lambda: target(prompt[:, n : n + k + 1], n), 1))
        res["block_forward"].append(timed(lambda: block.propose(prompt[0, n], max(ks)), 1))
        res["lm_forward"].append(timed(lambda: lm(one, n, last_only=True), 1))
    return {key: statistics.median(v) for key, v in res.items()}


def heldout_prompts(tok, n: int, length: int = 32) -> list[torch.Tensor]:
    """n prompts of `length` tokens from the bundled held-out text (never trained on): tokens 64.. of each block."""
    from specquant.quant.quality import heldout_tokens
    from specquant.train.qad import BUNDLED_HELDOUT

    ids = heldout_tokens(tok, BUNDLED_HELDOUT, n, 256)
    return [ids[i : i + 1, 64 : 64 + length] for i in range(len(ids))]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="tiny-target")
    ap.add_argument("--w4-target", default=None, help="the W4 target (e.g. the demo's W4 + QAD target)")
    ap.add_argument("--lm-draft", default="tiny-draft")
    ap.add_argument("--block-draft", default="tiny-block-draft",
                    help="block drafter(s): DIR or NAME=DIR, comma-separated (e.g. stage1=A,stage2=B)")
    ap.add_argument("--w4-block", default=None, help="GPTQ W4 of the block drafter (compressed-tensors dir)")
    ap.add_argument("--ks", default="3,7,15")
    ap.add_argument("--lm-ks", default="3,7")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--prompts-per-set", type=int, default=1)
    ap.add_argument("--heldout", type=int, default=0,
                    help="use N held-out prompts (32 tokens of heldout.txt) instead of the bench's content sets")
    ap.add_argument("--targets", default="fp32,w4", help="which targets to measure against (fp32, w4)")
    ap.add_argument("--no-costs", action="store_true", help="acceptance only")
    args = ap.parse_args()
    tok = load_tokenizer(args.target)
    if args.heldout:
        prompts = heldout_prompts(tok, args.heldout)
    else:
        prompts = [torch.tensor([p.ids]) for p in load_prompts(tok, {"short": 64}, ("prose", "code", "qa"), 1,
                                                               args.prompts_per_set, 256) if p.kind == "content"]
    blocks = [item.split("=", 1) if "=" in item else ("block", item) for item in args.block_draft.split(",")]
    rows = []
    ks = [int(x) for x in args.ks.split(",")]
    lm_ks = [int(x) for x in args.lm_ks.split(",") if x]
    for tname, tpath in [("fp32", args.target)] + ([("w4", args.w4_target)] if args.w4_target else []):
        if tname not in args.targets.split(","):
            continue
        target = load_model(tpath)
        lm = load_model(args.lm_draft)
        drafters = [(name, load_block_draft(path).attach_target(target)) for name, path in blocks]
        if args.w4_block:
            drafters.append(("W4 block", load_block_draft(args.w4_block).attach_target(target)))
        found = []
        for name, d in drafters:
            for k in ks:
                m = greedy_acceptance(d, target, prompts, args.new_tokens, k)
                found.append({"target": tname, "drafter": name, "k": k, "mal": m.mean_acceptance_length,
                              "per_pos": [round(x, 3) for x in m.acceptance_rate_per_pos]})
        for k in lm_ks:
            m = SpecMetrics()
            eng = SpecEngine(target, lm, SpecConfig(draft_len=k))
            for p in prompts:
                m.merge(eng.generate(p, args.new_tokens, stop_on_eos=False).spec)
            found.append({"target": tname, "drafter": "LM tiny-draft", "k": k, "mal": m.mean_acceptance_length,
                          "per_pos": [round(x, 3) for x in m.acceptance_rate_per_pos]})
        if not args.no_costs:
            c = costs(target, drafters[0][1], lm, sorted(set(ks + lm_ks)))
            for r in found:  # predicted decode speedup over this target alone: MAL / (draft cost + verify), per step
                draft = (c["block_forward"] if r["drafter"] != "LM tiny-draft" else r["k"] * c["lm_forward"])
                r["predicted_speedup"] = r["mal"] / ((draft + c[f"target_verify_{r['k']}"]) / c["target_step"])
            found.append({"target": tname, "costs_s": c,
                          "block_forward_over_step": c["block_forward"] / c["target_step"],
                          "lm_forward_over_step": c["lm_forward"] / c["target_step"],
                          "verify_over_step": {k: c[f"target_verify_{k}"] / c["target_step"]
                                               for k in sorted(set(ks + lm_ks))}})
        rows += found
    for r in rows:
        if "mal" in r:
            pred = f"  predicted {r['predicted_speedup']:.2f}x" if "predicted_speedup" in r else ""
            print(f"{r['target']:<5} {r['drafter']:<14} k={r['k']:<3} MAL {r['mal']:.3f}{pred}  per-position "
                  + " ".join(f"{x:.2f}" for x in r["per_pos"]))
        else:
            print(f"{r['target']:<5} cost / target 1-token step: block forward {r['block_forward_over_step']:.2f}, "
                  f"LM forward {r['lm_forward_over_step']:.2f}, verify of k+1 rows "
                  + ", ".join(f"k={k}: {v:.2f}" for k, v in r["verify_over_step"].items()))
    print(json.dumps({"benchmark": "block_acceptance", "new_tokens": args.new_tokens, "prompts": len(prompts),
                      "rows": rows}))


if __name__ == "__main__":
    main()
