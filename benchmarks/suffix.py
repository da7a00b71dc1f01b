"""The suffix drafter: what its automaton costs per token, and what it drafts and gets accepted on the bundled
target, on the filler prompt and on real text reported apart.

1. Drafter cost: a SuffixDrafter fed --tokens tokens one at a time, a propose of a --ks[-1]-token draft after
   each (automaton append, lookup, the draft tensor), on two texts: the competition's latency prompt repeated
   (maximal repetition, the deepest suffix links) and the packaged held-out text (data/heldout.txt).
   Microseconds per token, the median of --runs passes after a warm-up one; the same with the bounded cache
   holding the other text (one cursor per token more).
2. Drafting: SpecEngine with a SuffixDrafter at each K in --ks against --target, greedy, EOS ignored, exactly
   --new-tokens tokens per prompt. Prompts: "filler" (the latency prompt repeated to --filler-tokens tokens) and
   the bench's content sets (prose / code / qa, the first --prompts-per-set of each). Per row: mean acceptance
   length (vLLM's 1 + accepted / drafts, over the steps that drafted), tokens per target forward (every step,
   the undrafted included), the share of steps that drafted, per-position acceptance (cumulative), the drafter's
   microseconds per decode step (its profiled prefill and proposes: building the prompt's automaton counts),
   tokens/s, and whether the tokens equal target-only greedy.
   A "replay" row runs each prompt twice with the cache on and reports the second pass: what a repeated request
   gains (the benchmark repeats prompts, so this is the cache's best case, not a typical one).

Times are wall-clock, so they include whatever else the machine runs: medians of --runs requests, one row after
another (not interleaved); the acceptance counters are exact whatever the load.

Usage: python benchmarks/suffix.py [--target tiny-target] [--ks 4,8,20] [--new-tokens 64] [--tokens 4096]
       [--filler-tokens 128] [--prompts-per-set 1] [--runs 3] [--threads N] [--out DIR] [--overwrite]
With --out the result is also written to DIR/suffix.json (the --out policy of every command, util/files.py).
The last stdout line is one JSON object: {"benchmark": "suffix", "automaton": [...], "rows": [...]}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from specquant.bench.prompts import Prompt, load_prompts
from specquant.spec_decode.engine import generate
from specquant.decode.sampling import SamplingConfig
from specquant.errors import SpecquantError
from specquant.loader import load_model
from specquant.model.checkpoint import load_tokenizer
from specquant.spec_decode.config import SpecConfig
from specquant.spec_decode.engine import SpecEngine
from specquant.spec_decode.metrics import SpecMetrics
from specquant.spec_decode.suffix_drafter import SuffixConfig, SuffixDrafter
from specquant.util.files import atomic_write, claim_out_dir
from specquant.util.flags import add_config_flags, config_from_args

FILLER = "The quick brown fox jumps over the lazy dog. "
CONTENT = ("prose", "code", "qa")
HELDOUT = Path(__file__).resolve().parent.parent / "src" / "specquant" / "data" / "heldout.txt"


def automaton_cost(tokens: list[int], k: int, other: list[int] | None, runs: int,
                   base: SuffixConfig = SuffixConfig()) -> float:
    """Median microseconds per token of a SuffixDrafter fed `tokens` one at a time, a propose (append, lookup,
    the draft tensor) after each; with `other`, one earlier request in its cache (one more cursor per token)."""
    seq, greedy = torch.tensor([tokens]), SamplingConfig()
    times = []
    for run in range(runs + 1):  # run 0 warms up (first-call costs of torch and the allocator)
        drafter = SuffixDrafter(replace(base, max_draft_len=k, cache_tokens=len(other) if other else 0))
        if other:
            drafter.prefill(torch.tensor([other]), None)  # the next prefill moves it into the cache
        drafter.prefill(seq[:, :1], None)
        t0 = time.perf_counter()
        for n in range(2, len(tokens) + 1):
            drafter.propose(seq[:, :n], k, greedy, None)
        if run:
            times.append((time.perf_counter() - t0) / (len(tokens) - 1))
    return 1e6 * statistics.median(times)


def filler_prompt(tok, n: int) -> Prompt:
    ids = []
    while len(ids) < n:
        ids = tok.encode(FILLER * (len(ids) // 8 + 2))
    return Prompt("filler", "filler", "content", ids[:n])


def run_drafting(target, prompts: list[Prompt], ks: list[int], new_tokens: int, runs: int,
                 base: SuffixConfig = SuffixConfig()) -> list[dict]:
    greedy = SamplingConfig()
    configs = [(f"suffix K={k}", replace(base, max_draft_len=k, cache_tokens=0)) for k in ks]
    configs.append((f"suffix K={ks[-1]} replay", replace(base, max_draft_len=ks[-1], cache_tokens=1 << 16)))
    sets = sorted({p.category for p in prompts}, key=[p.category for p in prompts].index)
    rows = []
    for cat in sets:
        group = [p for p in prompts if p.category == cat]
        refs, base = [], []
        for p in group:
            ids = torch.tensor([p.ids])
            refs.append(generate(target, ids, new_tokens, greedy, stop_on_eos=False).token_ids[0])
            base.append(statistics.median(
                generate(target, ids, new_tokens, greedy, stop_on_eos=False).stats["decode_s"] for _ in range(runs)))
        for name, cfg in configs:
            engine = SpecEngine(target, SuffixDrafter(cfg), SpecConfig(draft_len=cfg.max_draft_len), profile=True)
            m, steps, forwards, emitted, draft_s, decode_s, match = SpecMetrics(), 0, 0, 0, 0.0, [], True
            for p, ref in zip(group, refs):
                ids = torch.tensor([p.ids])
                if cfg.cache_tokens:
                    engine.generate(ids, new_tokens, greedy, stop_on_eos=False)  # the request the replay repeats
                res = [engine.generate(ids, new_tokens, greedy, stop_on_eos=False) for _ in range(runs)]
                r = res[0]  # counters from one request per prompt (greedy: every run drafts the same)
                match &= all(x.token_ids[0] == ref for x in res)
                m.merge(r.spec)
                steps += r.stats["target_forwards"] - 1
                emitted += r.stats["new_tokens"] - 1
                draft_s += r.stats["draft_s"]
                decode_s.append(statistics.median(x.stats["decode_s"] for x in res))
            rows.append({
                "set": cat, "config": name, "mean_acceptance_length": m.mean_acceptance_length,
                "tokens_per_forward": emitted / max(steps, 1), "drafted_share": m.num_drafts / max(steps, 1),
                "acceptance_per_pos": [round(x, 3) for x in m.acceptance_rate_per_pos[:20]],
                "draft_us_per_step": 1e6 * draft_s / max(steps, 1),
                "tokens_per_s": len(group) * (new_tokens - 1) / sum(decode_s),
                "speedup": sum(base) / sum(decode_s), "greedy_match": match})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="tiny-target")
    ap.add_argument("--ks", default="4,8,20", help="suffix drafter K values (max_draft_len), comma-separated")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens fed to the automaton in the cost section")
    ap.add_argument("--filler-tokens", type=int, default=128)
    ap.add_argument("--prompts-per-set", type=int, default=1)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write DIR/suffix.json")
    ap.add_argument("--overwrite", action="store_true",
                    help="write into --out even when it is a non-empty folder specquant did not create")
    add_config_flags(ap, SuffixConfig, prefix="suffix.")  # the drafter's settings (--ks and the rows set k, cache)
    args = ap.parse_args(argv)
    try:  # the --out policy of every command (util/files.py), before any work
        base = config_from_args(SuffixConfig, args, prefix="suffix.").validate()
        out = claim_out_dir(args.out, args.overwrite) if args.out else None
        ks = [int(k) for k in args.ks.split(",")]
        for k in ks:
            replace(base, max_draft_len=k).validate()
    except (SpecquantError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    tok = load_tokenizer(args.target)
    filler = filler_prompt(tok, args.tokens).ids
    text = tok.encode(HELDOUT.read_text()[: 16 * args.tokens])[: args.tokens]  # a prefix is enough to encode
    cost = []
    for name, ids, other in (("filler", filler, text), ("heldout", text, filler)):
        cost.append({"text": name, "tokens": len(ids),
                     "us_per_token": automaton_cost(ids, ks[-1], None, args.runs, base),
                     "us_per_token_with_cache": automaton_cost(ids, ks[-1], other, args.runs, base)})
    print(f"suffix drafter, one token appended + one {ks[-1]}-token propose:")
    print(f"{'text':<8} {'tokens':>6} {'us/token':>9} {'+1 cached doc':>13}")
    for c in cost:
        print(f"{c['text']:<8} {c['tokens']:>6} {c['us_per_token']:>9.1f} {c['us_per_token_with_cache']:>13.1f}")

    target = load_model(args.target, fuse=True)
    prompts = [filler_prompt(tok, args.filler_tokens)]
    prompts += [p for p in load_prompts(tok, {"short": 64}, CONTENT, 1, args.prompts_per_set, 256)
                if p.category in CONTENT]
    rows = run_drafting(target, prompts, ks, args.new_tokens, args.runs, base)
    print(f"\n{'set':<7} {'config':<22} {'MAL':>5} {'tok/fwd':>7} {'drafted':>7} {'us/step':>7} {'tok/s':>7} "
          f"{'speedup':>7} match  acceptance per position 1..")
    for r in rows:
        per = " ".join(f"{x:.2f}" for x in r["acceptance_per_pos"][:10])
        print(f"{r['set']:<7} {r['config']:<22} {r['mean_acceptance_length']:>5.2f} {r['tokens_per_forward']:>7.2f} "
              f"{r['drafted_share']:>7.2f} {r['draft_us_per_step']:>7.0f} {r['tokens_per_s']:>7.1f} "
              f"{r['speedup']:>6.2f}x {str(r['greedy_match']):<5}  {per}")
    result = {"benchmark": "suffix", "target": args.target, "new_tokens": args.new_tokens, "runs": args.runs,
              "automaton": cost, "rows": rows}
    if out is not None:
        atomic_write(out / "suffix.json", json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
