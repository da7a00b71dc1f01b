"""The suffix drafter against arctic-inference's suffix decoding on the same token streams: accepted tokens per
target forward at equal K.

Streams: each bundled target's (--targets) greedy output (--new-tokens, EOS ignored) on the bundled content sets
(prose / code / qa, --prompts-per-set prompts each; every prompt a request with no cache), and the filler protocol
(the competition's repeated sentence, --filler-tokens prompt tokens) sent --repeats times with the response cache
on (arctic's global tree, our DocumentCache), the first request and the repeats reported apart ("replay").

Metric (greedy, no model in the loop): as in SpecEngine, the prefill's forward emits the first output token; then
each step drafts from prompt + output so far, its draft tokens are accepted while they equal the stream's next
tokens, and the step emits accepted + 1 tokens (the target's own next one); the drafters are then fed those
tokens. tokens / forward = stream tokens / forwards (the prefill's included); MAL = 1 + accepted / drafting
steps. Both read the same streams; neither sees a token before it is committed.

Configurations (columns): "arctic" is SuffixDecodingCache (max_tree_depth --arctic-depth) with the leaderboard
entry's settings (max_spec_factor 3.0, offset 0, min_token_prob 0); "peer" is SuffixDrafter with the same factor /
offset / min_token_prob and min_match 1 (our branch rule and candidates: SuffixConfig's defaults); "peer-freq" the
same with arctic's branch rule (most frequent) and 8 candidates; "default" is SuffixConfig's defaults. All at
K = --k.

arctic-inference is optional and is not a dependency of the project; without it the arctic column is absent.
Install it apart (an sdist with a C++ extension; it builds on CPU):
    python3 -m venv /tmp/arctic && /tmp/arctic/bin/pip install torch arctic-inference==0.3.0 numpy
and pass --arctic-site /tmp/arctic/lib/python3.11/site-packages (appended to sys.path, after this environment's
packages; only its suffix_decoding module, which needs numpy, is imported).

Last stdout line: one JSON object {"benchmark": "suffix_vs_arctic", "rows": [...]}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace

import torch

from specquant.bench.prompts import Prompt, load_prompts
from specquant.decode.sampling import SamplingConfig
from specquant.errors import SpecquantError
from specquant.loader import load_model
from specquant.model.checkpoint import load_tokenizer
from specquant.spec_decode.engine import generate
from specquant.spec_decode.suffix_drafter import SuffixConfig, SuffixDrafter

FILLER = "The quick brown fox jumps over the lazy dog. "
CONTENT = ("prose", "code", "qa")
# the leaderboard's suffix-decoding entry (../shared/PEERS.md): K 20, max_spec_factor 3.0, tree depth 64
PEER = dict(match_factor=3.0, match_offset=0.0, min_token_prob=0.0)


class Ours:
    """SuffixDrafter behind the simulation's three calls."""

    def __init__(self, config: SuffixConfig):
        self.drafter = SuffixDrafter(config)
        self.k = config.max_draft_len

    def start(self, prompt: list[int]) -> None:
        self.drafter.prefill(torch.tensor([prompt]), None)  # the previous request joins the cache, if on

    def draft(self, context: list[int], k: int) -> list[int]:
        return self.drafter.peek(torch.tensor([context]), k).tokens

    def commit(self, tokens: list[int]) -> None:
        pass  # peek appends the committed tokens it has not seen


class Arctic:
    """arctic-inference's SuffixDecodingCache: the prompt in a per-request tree, responses in the global one."""

    def __init__(self, module, k: int, depth: int, cached_requests: int):
        self.cache = module.SuffixDecodingCache(max_tree_depth=depth, max_cached_requests=cached_requests)
        self.k, self.req = k, None
        self._ids = 0

    def start(self, prompt: list[int]) -> None:
        if self.req is not None:
            self.cache.stop_request(self.req)
        self._ids += 1
        self.req = f"r{self._ids}"
        self.cache.start_request(self.req, prompt)

    def draft(self, context: list[int], k: int) -> list[int]:
        d = self.cache.speculate(self.req, context, max_spec_tokens=k, min_token_prob=PEER["min_token_prob"],
                                 max_spec_factor=PEER["match_factor"], max_spec_offset=PEER["match_offset"])
        return list(d.token_ids)

    def commit(self, tokens: list[int]) -> None:
        self.cache.add_active_response(self.req, tokens)


def simulate(drafter, prompt: list[int], output: list[int]) -> tuple[int, int, int, int]:
    """(forwards, drafted tokens, accepted tokens, drafting steps) of one request whose greedy output is `output`."""
    drafter.start(prompt)
    drafter.commit(output[:1])  # the prefill's forward emits the first token, undrafted (as SpecEngine does)
    pos, steps, drafted, accepted, drafting = 1, 1, 0, 0, 0
    while pos < len(output):
        # the loop's k: at most what is left to emit, less the step's own token (spec_decode/loop.py)
        k = min(drafter.k, len(output) - pos - 1)
        draft = drafter.draft(prompt + output[:pos], k) if k else []
        n = 0
        while n < len(draft) and pos + n < len(output) and draft[n] == output[pos + n]:
            n += 1
        emitted = output[pos : pos + n + 1]
        drafter.commit(emitted)
        steps, drafted, accepted, pos = steps + 1, drafted + len(draft), accepted + n, pos + len(emitted)
        drafting += bool(draft)
    return steps, drafted, accepted, drafting


def filler_prompt(tok, n: int) -> list[int]:
    ids = []
    while len(ids) < n:
        ids = tok.encode(FILLER * (len(ids) // 8 + 2))
    return ids[:n]


def streams(target_name: str, args) -> list[tuple[str, list[tuple[list[int], list[int]]], bool]]:
    """(name, [(prompt, greedy output)], cached) per stream of one target."""
    tok = load_tokenizer(target_name)
    target = load_model(target_name, fuse=True)
    greedy = SamplingConfig()

    def out(ids: list[int], n: int) -> list[int]:
        return generate(target, torch.tensor([ids]), n, greedy, stop_on_eos=False).token_ids[0]

    prompts: list[Prompt] = [p for p in load_prompts(tok, {"short": 64}, CONTENT, 1, args.prompts_per_set, 256)
                             if p.category in CONTENT]
    result = []
    for cat in CONTENT:
        result.append((cat, [(p.ids, out(p.ids, args.new_tokens)) for p in prompts if p.category == cat], False))
    filler = filler_prompt(tok, args.filler_tokens)
    answer = out(filler, args.new_tokens)
    result.append(("filler x1", [(filler, answer)], True))
    result.append((f"filler x{args.repeats}", [(filler, answer)] * args.repeats, True))
    return result


def run_stream(make, requests, replay: bool) -> dict:
    """Tokens per forward over the stream; with replay, also over the requests after the first."""
    drafter = make()
    t0 = time.perf_counter()
    per = [simulate(drafter, p, o) for p, o in requests]
    seconds = time.perf_counter() - t0
    tokens = sum(len(o) for _, o in requests)
    steps = sum(p[0] for p in per)
    row = {"tokens_per_forward": tokens / steps, "mal": 1 + sum(p[2] for p in per) / max(sum(p[3] for p in per), 1),
           "accepted": sum(p[2] for p in per), "drafted": sum(p[1] for p in per), "us_per_step": 1e6 * seconds / steps}
    if replay and len(requests) > 1:
        row["replay_tokens_per_forward"] = sum(len(o) for _, o in requests[1:]) / sum(p[0] for p in per[1:])
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", default="tiny-target,tiny-hybrid")
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompts-per-set", type=int, default=4)
    ap.add_argument("--filler-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--arctic-depth", type=int, default=64)
    ap.add_argument("--arctic-site", default=None, help="a site-packages folder holding arctic_inference")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        SuffixConfig(max_draft_len=args.k).validate()
        for name in ("new_tokens", "prompts_per_set", "filler_tokens", "repeats", "arctic_depth"):
            if getattr(args, name) < 1:
                raise SpecquantError(f"--{name.replace('_', '-')} {getattr(args, name)} must be at least 1")
    except SpecquantError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.arctic_site:
        sys.path.append(args.arctic_site)
    try:
        import arctic_inference.suffix_decoding as arctic
    except ImportError as e:
        arctic = None
        print(f"arctic-inference not importable ({e}); its column is absent (module docstring: how to install)",
              file=sys.stderr)
    if args.threads:
        torch.set_num_threads(args.threads)

    base = SuffixConfig(max_draft_len=args.k)
    peer = replace(base, min_match=1, **PEER)
    configs = {"default": lambda cached: Ours(replace(base, cache_tokens=1 << 16 if cached else 0)),
               "peer": lambda cached: Ours(replace(peer, cache_tokens=1 << 16 if cached else 0)),
               "peer-freq": lambda cached: Ours(replace(peer, branch="frequent", candidates=8,
                                                        cache_tokens=1 << 16 if cached else 0))}
    if arctic is not None:
        configs["arctic"] = lambda cached: Arctic(arctic, args.k, args.arctic_depth, -1 if cached else 0)
    rows = []
    for target_name in args.targets.split(","):
        for stream, requests, cached in streams(target_name, args):
            for name, make in configs.items():
                rows.append({"target": target_name, "stream": stream, "config": name, "cache": cached,
                             "requests": len(requests), **run_stream(lambda: make(cached), requests, cached)})
    print(f"accepted tokens per target forward (MAL), K = {args.k}, greedy streams of {args.new_tokens} tokens; "
          "filler xN: the cache on, its requests after the first reported apart as replay")
    names = list(configs)
    print(f"{'target':<12} {'stream':<10} " + " ".join(f"{n:>16}" for n in names))
    for i in range(0, len(rows), len(names)):
        group = rows[i : i + len(names)]
        cells = [f"{r['tokens_per_forward']:>6.2f} ({r['mal']:>5.2f})" for r in group]
        print(f"{group[0]['target']:<12} {group[0]['stream']:<10} " + " ".join(f"{c:>16}" for c in cells))
        if "replay_tokens_per_forward" in group[0]:
            cells = [f"{r['replay_tokens_per_forward']:>6.2f}" for r in group]
            print(f"{'':<12} {'  replay':<10} " + " ".join(f"{c:>16}" for c in cells))
    print("drafter microseconds per step (contended CPU): "
          + ", ".join(f"{n} {statistics.median(r['us_per_step'] for r in rows if r['config'] == n):.0f}"
                      for n in names))
    print(json.dumps({"benchmark": "suffix_vs_arctic", "k": args.k, "new_tokens": args.new_tokens,
                      "arctic": arctic is not None, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
