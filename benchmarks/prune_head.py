"""Vocabulary-pruned draft heads: acceptance and per-step cost against N, the token ids the drafter's head keeps
(spec_decode/drafters/pruned_head.py), for the block and the LM drafter.

For each drafter in --drafts and each N in --keep (the full vocabulary is the reference row, always run):
1. Map: the N most frequent ids of --data (default: the bundled calibration text) tokenized with --target's
   tokenizer, special tokens always kept (what `specquant distill prune-head` writes); "coverage" is the share of
   --data's tokens the kept ids cover.
2. Acceptance: SpecEngine greedy at k = --k against --target, EOS ignored, --new-tokens per prompt, on the bench's
   content sets (prose / code / qa, the first --prompts-per-set of each) merged, and on the filler prompt (the
   competition's latency prompt) apart. MAL = vLLM's 1 + accepted / drafts; "mal_vs_full" = MAL / the full
   head's; greedy_match: the tokens equal target-only greedy (they must: the target verifies over the full
   vocabulary).
3. Cost: the drafter's propose of k tokens after a prompt of --context tokens (block: its one forward; LM: k
   forwards), and its head alone on k rows, each the median of --reps calls after a warm-up; "step_vs_full" =
   propose time / the full head's. Every N of a drafter is timed in each of --rounds rounds, one after another,
   and each figure is the median over rounds: whatever else the machine runs falls on every N alike.

Times are wall-clock medians and include whatever else the machine runs; the acceptance counters are exact.
Usage: python benchmarks/prune_head.py [--target tiny-target] [--drafts tiny-block-draft,tiny-draft]
       [--keep 512,1024,2048,4096] [--k 3] [--new-tokens 32] [--prompts-per-set 1] [--context 256] [--reps 20]
       [--rounds 5]
       [--data FILE] [--threads N] [--out DIR] [--overwrite]
With --out the result is also written to DIR/prune_head.json (the --out policy of every command, util/files.py).
The last stdout line is one JSON object: {"benchmark": "prune_head", "rows": [...]}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from specquant.bench.prompts import Prompt, load_prompts
from specquant.decode.sampling import SamplingConfig
from specquant.errors import SpecquantError
from specquant.loader import load_model
from specquant.model.checkpoint import load_tokenizer
from specquant.spec_decode.config import SpecConfig
from specquant.spec_decode.drafters import kind_of_checkpoint
from specquant.spec_decode.drafters.pruned_head import ATTRIBUTE, PrunedHead
from specquant.spec_decode.engine import SpecEngine, generate
from specquant.spec_decode.metrics import SpecMetrics
from specquant.spec_decode.runtime import RuntimeConfig
from specquant.train.prune_head import build_token_map
from specquant.util.files import atomic_write, claim_out_dir

FILLER = "The quick brown fox jumps over the lazy dog. "
CONTENT = ("prose", "code", "qa")


def median_ms(fn, reps: int) -> float:
    fn()  # warm-up: first-call costs of torch and the allocator
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


class Drafter:
    """One loaded drafter whose head can be set to any map (None: the full head)."""

    def __init__(self, name: str, target, runtime: RuntimeConfig):
        self.name, self.target = name, target
        self.kind = kind_of_checkpoint(name)
        self.model = self.kind.load(name, runtime)
        self.lm_head = getattr(self.model, "lm_head", None) if self.kind.name == "lm" else None

    def build(self, ids: torch.Tensor | None, k: int):
        spec = SpecConfig(draft_len=k)
        if self.kind.name == "lm":
            self.model.lm_head = self.lm_head if ids is None else PrunedHead(self.lm_head, ids)
        elif ids is None:
            if hasattr(self.model, ATTRIBUTE):
                delattr(self.model, ATTRIBUTE)
        else:
            setattr(self.model, ATTRIBUTE, ids)
        return self.kind.build(self.model, self.target, spec)

    def full_head(self):
        return self.lm_head if self.kind.name == "lm" else self.target.lm_head


def acceptance(target, drafter, prompts: list[Prompt], refs: dict, k: int, new_tokens: int) -> tuple[dict, bool]:
    engine = SpecEngine(target, drafter, SpecConfig(draft_len=k))
    per_kind, match = {"content": SpecMetrics(), "filler": SpecMetrics()}, True
    for p in prompts:
        res = engine.generate(torch.tensor([p.ids]), new_tokens, SamplingConfig(), stop_on_eos=False)
        match &= res.token_ids[0] == refs[p.id]
        per_kind[p.kind].merge(res.spec)
    return per_kind, match


@torch.no_grad()
def step_cost(target, drafter, head, context: list[int], k: int, reps: int) -> tuple[float, float]:
    """(propose ms, head ms): one propose of k tokens after `context`, and the head on k rows."""
    ids = torch.tensor([context])
    drafter.setup(1, len(context) + k + 8)
    hidden = None
    if drafter.target_layers:
        target.clear_cache()
        _, hidden = target(ids[:, :-1], hidden_layers=drafter.target_layers)
    drafter.prefill(ids[:, :-1], hidden)
    greedy, n = SamplingConfig(), len(context)

    def propose():
        drafter.propose(ids, k, greedy, None)
        drafter.rollback(n - 1)  # what it drafted is forgotten: every call drafts from the same context

    x = torch.randn(k, head.in_features if hasattr(head, "in_features") else head.rows.in_features)
    return median_ms(propose, reps), median_ms(lambda: head(x), reps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="tiny-target")
    ap.add_argument("--drafts", default="tiny-block-draft,tiny-draft", help="draft checkpoints, comma-separated")
    ap.add_argument("--keep", default="512,1024,2048,4096", help="N values (kept ids), comma-separated")
    ap.add_argument("--k", type=int, default=3, help="draft tokens per step")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompts-per-set", type=int, default=1)
    ap.add_argument("--context", type=int, default=256, help="prompt tokens before the timed propose")
    ap.add_argument("--reps", type=int, default=20, help="timed calls per figure and round")
    ap.add_argument("--rounds", type=int, default=5, help="timing rounds, every N once per round (median over them)")
    ap.add_argument("--data", default=None, help="text (.txt) or regen .jsonl to count on (default: calib.txt)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write DIR/prune_head.json")
    ap.add_argument("--overwrite", action="store_true",
                    help="write into --out even when it is a non-empty folder specquant did not create")
    args = ap.parse_args(argv)
    try:  # the --out policy of every command (util/files.py), before any work
        out = claim_out_dir(args.out, args.overwrite) if args.out else None
        keeps = sorted({int(n) for n in args.keep.split(",")})
        if args.k < 1 or min(keeps) < 1 or args.rounds < 1 or args.reps < 1:
            raise SpecquantError(f"--k {args.k}, --rounds {args.rounds}, --reps {args.reps} and every --keep value "
                                 "must be at least 1")
    except (SpecquantError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    tok = load_tokenizer(args.target)
    target = load_model(args.target, fuse=True)
    vocab = target.config.vocab_size
    prompts = [p for p in load_prompts(tok, {"short": 64}, CONTENT, 1, args.prompts_per_set, 256)
               if p.category in CONTENT]
    prompts.append(Prompt("filler", "filler", "filler", tok.encode(FILLER * 12, add_special_tokens=False)))
    refs = {p.id: generate(target, torch.tensor([p.ids]), args.new_tokens, SamplingConfig(),
                           stop_on_eos=False).token_ids[0] for p in prompts}
    context = tok.encode(FILLER * 4 + "Once upon a time " * (args.context // 4), add_special_tokens=False)
    context = context[-args.context:]
    rows = []
    for name in args.drafts.split(","):
        d = Drafter(name, target, RuntimeConfig())
        maps = []
        for n in [vocab] + [n for n in keeps if n < vocab]:
            try:
                ids, summary = (None, {"coverage": 1.0}) if n == vocab else build_token_map(
                    name, n, args.data, tokenizer_from=args.target)
            except SpecquantError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            drafter = d.build(ids, args.k)
            acc, match = acceptance(target, drafter, prompts, refs, args.k, args.new_tokens)
            maps.append((n, ids))
            rows.append({"draft": name, "kind": d.kind.name, "keep": n, "coverage": summary["coverage"],
                         "mal": acc["content"].mean_acceptance_length,
                         "mal_filler": acc["filler"].mean_acceptance_length,
                         "acceptance_per_pos": [round(x, 3) for x in acc["content"].acceptance_rate_per_pos],
                         "greedy_match": match})
        times = {n: ([], []) for n, _ in maps}
        for _ in range(args.rounds):  # interleaved: each round times every N once
            for n, ids in maps:
                drafter = d.build(ids, args.k)
                head = d.full_head() if ids is None else drafter.head if d.kind.name == "block" else d.model.lm_head
                propose_ms, head_ms = step_cost(target, drafter, head, context, args.k, args.reps)
                times[n][0].append(propose_ms)
                times[n][1].append(head_ms)
        mine = [r for r in rows if r["draft"] == name]
        for r in mine:
            r["propose_ms"], r["head_ms"] = (statistics.median(t) for t in times[r["keep"]])
            r["propose_ms_rounds"] = [round(t, 3) for t in times[r["keep"]][0]]
        full = mine[0]
        for r in mine:
            r.update(mal_vs_full=r["mal"] / full["mal"] if full["mal"] else None,
                     step_vs_full=r["propose_ms"] / full["propose_ms"], head_vs_full=r["head_ms"] / full["head_ms"])
    print(f"{'draft':<18} {'kind':<6} {'keep':>6} {'cover':>6} {'MAL':>5} {'vs full':>7} {'MAL fill':>8} "
          f"{'propose ms':>10} {'vs full':>7} {'head ms':>8} {'vs full':>7} match")
    for r in rows:
        print(f"{r['draft']:<18} {r['kind']:<6} {r['keep']:>6} {r['coverage']:>6.3f} {r['mal']:>5.2f} "
              f"{r['mal_vs_full'] or 0:>7.3f} {r['mal_filler']:>8.2f} {r['propose_ms']:>10.3f} "
              f"{r['step_vs_full']:>7.3f} {r['head_ms']:>8.4f} {r['head_vs_full']:>7.3f} {r['greedy_match']}")
    result = {"benchmark": "prune_head", "target": args.target, "k": args.k, "new_tokens": args.new_tokens,
              "reps": args.reps, "rounds": args.rounds, "threads": torch.get_num_threads(),
              "vocab_size": vocab, "rows": rows}
    if out is not None:
        atomic_write(out / "prune_head.json", json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
