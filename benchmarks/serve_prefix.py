"""What serve's prefix cache (--prefix-cache) does to time to first token: the same engine served twice on
loopback, without and with it, one streamed request at a time.

Per prompt length (token-id prompts cut from the competition's filler text, so the length is exact):
  cold     a prompt no earlier request shares (its first token differs each run): the cache's cost on a miss
  repeat   the same prompt every run (after one request that stores it): the competition's repeated prompt
  diverge  the first --shared of the prompt is the same every run, the rest is new: a hybrid target resumes from
           the last block boundary (--block) inside the shared part, a dense one from the shared length
TTFT is client-side: request sent to the first streamed text, the median of --runs requests after --warmup. Each
case's replies are compared between the two servers (same_text: the cache must not change an output).

Usage: python benchmarks/serve_prefix.py [--target tiny-target] [--draft tiny-draft|none|DIR]
       [--prompt-tokens 256,1024] [--shared 0.75] [--new-tokens 8] [--runs 5] [--warmup 1] [--block 256]
       [--threads N]
The last stdout line is one JSON object: {"benchmark": "serve_prefix", "rows": [...]}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request

import torch

from specquant.model.checkpoint import load_tokenizer
from specquant.serve.app import create_app
from specquant.serve.config import FILLER, ServeConfig
from specquant.serve.loopback import serving
from specquant.spec_decode.build import build_engine
from specquant.spec_decode.cli import pick_draft
from specquant.spec_decode.runtime import RuntimeConfig
from specquant.util.flags import print_json

CASES = ("cold", "repeat", "diverge")
MODEL = "bench"


def stream_ttft(url: str, ids: list[int], new_tokens: int) -> tuple[float, str]:
    """(seconds to the first streamed text, the whole text) of one streamed completion of token ids."""
    body = {"model": MODEL, "prompt": ids, "max_tokens": new_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, parts = None, []
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"the server failed: {event['error']['message']}")
            text = event["choices"][0]["text"] if event["choices"] else ""
            if text and ttft is None:
                ttft = time.perf_counter() - t0
            parts.append(text)
    return (time.perf_counter() - t0 if ttft is None else ttft), "".join(parts)


def case_prompts(case: str, base: list[int], shared: int, n: int, vocab: int, seed: int) -> list[list[int]]:
    """n prompts of len(base) tokens for one case (the first is the warm-up's when the case has one)."""
    g = torch.Generator().manual_seed(seed)
    fresh = lambda k: torch.randint(0, vocab, (k,), generator=g).tolist()  # noqa: E731
    if case == "repeat":
        return [base] * n
    if case == "cold":
        return [fresh(1) + base[1:] for _ in range(n)]
    return [base[:shared] + fresh(len(base) - shared) for _ in range(n)]


def measure(url: str, prompts: dict, args) -> dict:
    """case -> (median TTFT ms, replies) on one server; every case's warm-up requests first."""
    out = {}
    for case, plist in prompts.items():
        for ids in plist[: args.warmup]:
            stream_ttft(url, ids, args.new_tokens)
        times, texts = [], []
        for ids in plist[args.warmup:]:
            t, text = stream_ttft(url, ids, args.new_tokens)
            times.append(t * 1e3)
            texts.append(text)
        out[case] = (statistics.median(times), texts)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="tiny-target")
    p.add_argument("--draft", default=None, help="drafter (default: tiny-draft for the bundled target; none)")
    p.add_argument("--prompt-tokens", default="256,1024", help="comma-separated prompt lengths")
    p.add_argument("--shared", type=float, default=0.75, help="the diverge case's shared share of the prompt")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--block", type=int, default=ServeConfig.prefix_cache_block, help="--prefix-cache-block")
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.prompt_tokens.split(",") if x]
    if not lengths or min(lengths) < 2 or args.runs < 1 or args.warmup < 1 or not 0 < args.shared < 1:
        print("error: --prompt-tokens >= 2 each, --runs >= 1, --warmup >= 1 (the repeat case stores its prompt "
              "there) and 0 < --shared < 1", file=sys.stderr)
        return 2
    runtime = RuntimeConfig(threads=args.threads, aot="off").validate()
    tokenizer = load_tokenizer(args.target)
    engine = build_engine(args.target, pick_draft(args.target, args.draft), runtime, target_tokenizer=tokenizer)
    context = engine.target.config.max_position_embeddings
    filler = tokenizer.encode(FILLER * (max(lengths) // 4 + 1), add_special_tokens=False)
    rows = []
    n = args.warmup + args.runs
    for length in lengths:
        if length + args.new_tokens + 64 > context:
            print(f"skip {length}: does not fit the {context}-token context", file=sys.stderr)
            continue
        base, shared = filler[:length], max(1, int(length * args.shared))
        prompts = {case: case_prompts(case, base, shared, n, len(tokenizer), seed=length) for case in CASES}
        result = {}
        for cached in (False, True):
            app = create_app(engine, tokenizer, ServeConfig(prefix_cache=cached, prefix_cache_block=args.block),
                             MODEL, threads=args.threads)
            with serving(app) as url:
                result[cached] = measure(url, prompts, args)
        for case in CASES:
            (off, off_text), (on, on_text) = result[False][case], result[True][case]
            rows.append({"prompt_tokens": length, "case": case, "ttft_off_ms": off, "ttft_on_ms": on,
                         "speedup": off / on, "same_text": off_text == on_text})
            print(f"{length:>6} {case:<8} off {off:9.1f} ms  on {on:9.1f} ms  x{off / on:5.2f}  "
                  f"same text: {off_text == on_text}")
    print_json({"benchmark": "serve_prefix", "target": args.target, "draft": args.draft, "block": args.block,
                "new_tokens": args.new_tokens, "runs": args.runs, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
