"""Block drafter vs LM drafter on the bundled pair: acceptance, per-position acceptance, speed and per-step cost.

For each target (tiny-target in float32, and its W4 from --w4-target): target alone, the LM drafter (tiny-draft,
its default k), the block drafter (tiny-block-draft) at each k in --block-ks, its GPTQ W4 (calibrated on this
target's features, cached in --cache) at the last k, and the W4 block drafter with a --window context window.
Greedy, EOS ignored, exactly --new-tokens tokens per prompt; prompts are the bench's content sets (the first
--prompts-per-set of each). Every timed repetition runs every config on a prompt before the next prompt, so
background load hits all alike; latency = median over --runs per prompt, summed over prompts.

Reported per config: mean acceptance length (vLLM's 1 + accepted / drafts), per-position acceptance rate
(cumulative, positions 1..15), tokens/s, speedup over the same target alone, greedy match with it, and from the
profiled run the drafter's cost per step relative to a one-token target forward (c) and the verify forward's
(verify_ratio).

Usage: python benchmarks/block_draft.py --w4-target DIR [--block-ks 3,7,15] [--runs 2] [--new-tokens 64]
The last stdout line is one JSON object: {"benchmark": "block_draft", "rows": [...]}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from specquant.bench.prompts import load_prompts
from specquant.spec_decode.engine import generate
from specquant.decode.sampling import SamplingConfig
from specquant.drafter_loader import load_block_draft
from specquant.errors import SpecquantError
from specquant.loader import load_model
from specquant.model.checkpoint import save_block_drafter
from specquant.model.checkpoint import load_tokenizer, resolve
from specquant.spec_decode.drafters.block import BlockDrafter
from specquant.spec_decode.config import SpecConfig
from specquant.spec_decode.engine import SpecEngine
from specquant.spec_decode.metrics import SpecMetrics
from specquant.util.files import claim_out_dir


def w4_block_drafter(src: str, target, target_name: str, cache: Path, tokenizer) -> Path:
    """GPTQ W4 of the block drafter calibrated on `target`'s features, cached per (drafter, target)."""
    from specquant.quant.block_draft_gptq import gptq_block_drafter
    from specquant.quant.calib import calibration_tokens
    from specquant.quant.checkpoint import quantization_config
    from specquant.quant.config import QuantConfig

    out = cache / f"block-w4-{Path(str(resolve(src))).name}-{target_name}"
    if (out / "config.json").exists():
        return out
    cfg = QuantConfig(method="gptq", bits=4, group_size=128, calib_samples=16, seq_len=256)
    draft = load_block_draft(src)
    tokens = calibration_tokens(tokenizer, cfg.calib_path(), cfg.calib_samples, cfg.seq_len)
    gptq_block_drafter(draft, target, tokens, cfg)
    save_block_drafter(draft, out, extra_config={"quantization_config": quantization_config(draft, cfg)})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="tiny-target")
    ap.add_argument("--w4-target", default=None, help="W4 checkpoint of --target (specquant quantize)")
    ap.add_argument("--lm-draft", default="tiny-draft")
    ap.add_argument("--block-draft", default="tiny-block-draft")
    ap.add_argument("--lm-k", type=int, default=SpecConfig.draft_len)
    ap.add_argument("--block-ks", default="3,7,15")
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompts-per-set", type=int, default=1)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--cache", default="runs/bench-block")
    ap.add_argument("--overwrite", action="store_true",
                    help="write into --cache even when it is a non-empty folder specquant did not create")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:  # the --out policy of every command (util/files.py), before any work
        cache = claim_out_dir(args.cache, args.overwrite, "--cache")
    except SpecquantError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tok = load_tokenizer(args.target)
    prompts = [p for p in load_prompts(tok, {"short": 64}, ("prose", "code", "qa"), 1, args.prompts_per_set, 256)
               if p.kind == "content"]
    ks = [int(k) for k in args.block_ks.split(",")]
    greedy = SamplingConfig()
    rows = []
    targets = [("fp32", args.target)] + ([("w4", args.w4_target)] if args.w4_target else [])
    for tname, tpath in targets:
        target = load_model(tpath, fuse=True)
        lm = load_model(args.lm_draft, fuse=True)
        block = load_block_draft(args.block_draft)
        block_w4 = load_block_draft(w4_block_drafter(args.block_draft, load_model(tpath), tname, cache, tok))
        configs = [("target only", None, None)]
        configs.append((f"LM drafter k={args.lm_k}", "lm", SpecConfig(draft_len=args.lm_k)))
        for k in ks:
            configs.append((f"block k={k}", block, SpecConfig(draft_len=k)))
        configs.append((f"W4 block k={ks[-1]}", block_w4, SpecConfig(draft_len=ks[-1])))
        configs.append((f"W4 block k={ks[-1]} window {args.window}", block_w4,
                        SpecConfig(draft_len=ks[-1], draft_window=args.window)))
        engines = {}
        for name, d, spec in configs:
            if d is None:
                continue
            drafter = lm if d == "lm" else BlockDrafter(d, target, spec)
            engines[name] = SpecEngine(target, drafter, spec, profile=True)
        lat = {name: [[] for _ in prompts] for name, _, _ in configs}
        metrics = {name: SpecMetrics() for name, _, _ in configs}
        prof = {name: {"draft_s": 0.0, "draft_calls": 0, "target_s": 0.0, "target_calls": 0} for name, _, _ in configs}
        match = {name: True for name, _, _ in configs}
        refs = {}
        for run in range(args.runs + 1):  # run 0 warms up (and gives the acceptance / profile numbers)
            for i, p in enumerate(prompts):
                ids = torch.tensor([p.ids])
                for name, _, _ in configs:
                    t0 = time.perf_counter()
                    if name == "target only":
                        res = generate(target, ids, args.new_tokens, greedy, stop_on_eos=False)
                    else:
                        res = engines[name].generate(ids, args.new_tokens, greedy, stop_on_eos=False)
                    dt = time.perf_counter() - t0
                    if run == 0:
                        if name == "target only":
                            refs[i] = res.token_ids[0]
                        else:
                            match[name] &= res.token_ids[0] == refs[i]
                            metrics[name].merge(res.spec)
                            for key in prof[name]:
                                prof[name][key] += res.stats.get(key, 0)
                    else:
                        lat[name][i].append(dt)
        base = sum(statistics.median(x) for x in lat["target only"])
        # one-token target forward: the profiled target-only decode is not available, so take it from the LM row's
        # target calls? No: measure it directly, interleaved with nothing else running in this process
        step = _target_step(target, prompts, args.new_tokens)
        for name, _, _ in configs:
            total = sum(statistics.median(x) for x in lat[name])
            m, pr = metrics[name], prof[name]
            row = {"target": tname, "config": name, "tokens_per_s": len(prompts) * args.new_tokens / total,
                   "speedup": base / total, "greedy_match": match[name] if name != "target only" else None}
            if name != "target only":
                draft_calls = max(pr["draft_calls"], 1)
                row.update(mean_acceptance_length=m.mean_acceptance_length,
                           acceptance_per_pos=[round(x, 3) for x in m.acceptance_rate_per_pos[:15]],
                           draft_ms_per_call=1e3 * pr["draft_s"] / draft_calls,
                           drafter_calls_per_step=pr["draft_calls"] / max(m.num_drafts, 1),
                           c=(pr["draft_s"] / max(m.num_drafts, 1)) / step,
                           verify_ratio=(pr["target_s"] / max(pr["target_calls"], 1)) / step)
            rows.append(row)
    print(f"{'target':<6} {'config':<30} {'MAL':>5} {'tok/s':>7} {'speedup':>7} {'c':>5} {'verify':>6} match  "
          "acceptance per position 1..")
    for r in rows:
        mal = f"{r['mean_acceptance_length']:.2f}" if "mean_acceptance_length" in r else "-"
        c = f"{r['c']:.2f}" if "c" in r else "-"
        v = f"{r['verify_ratio']:.2f}" if "verify_ratio" in r else "-"
        per = " ".join(f"{x:.2f}" for x in r.get("acceptance_per_pos", []))
        print(f"{r['target']:<6} {r['config']:<30} {mal:>5} {r['tokens_per_s']:>7.1f} {r['speedup']:>6.2f}x "
              f"{c:>5} {v:>6} {str(r['greedy_match']):<5}  {per}")
    print(json.dumps({"benchmark": "block_draft", "new_tokens": args.new_tokens, "prompts": len(prompts),
                      "runs": args.runs, "rows": rows}))


def _target_step(target, prompts, new_tokens) -> float:
    """Median seconds of a one-token target decode step at the benchmark's context lengths."""
    times = []
    for p in prompts:
        ids = torch.tensor([p.ids])
        res = generate(target, ids, new_tokens, SamplingConfig(), stop_on_eos=False)
        times.append(res.stats["decode_s"] / max(res.stats["new_tokens"] - 1, 1))
    return statistics.median(times)


if __name__ == "__main__":
    sys.exit(main())
