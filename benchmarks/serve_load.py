"""The serving issue's bounded load test as a benchmark: --clients concurrent `openai` clients send --requests
requests in all against one server, within --time-limit seconds; every reply is checked against the same request
sent alone before the load (greedy, so it must be token for token the same).

Reports p50 / p99 end-to-end latency (client-side, send to last byte), requests/s over the load's wall time,
failures (an exception or an HTTP error, 503 included), corrupted replies (text or token count unlike the one sent
alone) and requests never started before the time limit, then an excerpt of the server's /metrics after the load.
Half the requests stream (--stream-share), so SSE and JSON replies are both under load.

Against --server URL (any OpenAI-compatible server; --model, default: the first it lists), or, without it, the
--target / --draft pair served in this process on loopback (specquant serve's app, --max-queue = --clients).

Usage: python benchmarks/serve_load.py [--server URL [--model NAME]] [--target tiny-target] [--draft tiny-draft]
       [--clients 64] [--requests 256] [--time-limit 300] [--max-tokens 16] [--prompts 8] [--stream-share 0.5]
       [--prefix-cache] [--threads N]
Exit status 1 when any request failed, was corrupted or did not run. The last stdout line is one JSON object:
{"benchmark": "serve_load", "p50_ms": ..., "p99_ms": ..., "requests_per_s": ..., "failures": ..., ...}.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import urllib.request
from contextlib import ExitStack

from specquant.serve.latency import percentile
from specquant.util.flags import print_json

WORDS = ("Long live", "Here comes", "Where is", "Behold", "O", "Now", "Go to", "Alas for", "Speak of", "Hail")
# /metrics lines worth keeping in a report (requests, tokens, queue, latency counts and the speculative counters)
EXCERPT = ("requests_total", "prompt_tokens_total", "generation_tokens_total", "num_requests_", "_seconds_count",
           "_seconds_sum", "spec_decode_", "prefix_cache_")


def prompts_of(n: int) -> list[str]:
    return [f"{WORDS[i % len(WORDS)]} the king{'!' * (i // len(WORDS))}" for i in range(n)]


def ask(client, model: str, prompt: str, max_tokens: int, stream: bool) -> tuple[str, int]:
    """(text, completion tokens) of one greedy completion."""
    if stream:
        chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage.completion_tokens
    r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
    return r.choices[0].text, r.usage.completion_tokens


def load(url: str, model: str, args) -> dict:
    import openai

    make = lambda: openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0,  # noqa: E731
                                 timeout=args.time_limit)
    prompts = prompts_of(args.prompts)
    alone_client = make()
    alone = {p: ask(alone_client, model, p, args.max_tokens, False) for p in prompts}
    lock, next_index = threading.Lock(), [0]
    latencies, failures, corrupted, errors = [], [0], [0], []
    stream_every = round(1 / args.stream_share) if args.stream_share > 0 else 0
    start = time.perf_counter()
    deadline = start + args.time_limit

    def client_loop():
        client = make()  # one client (its own connection pool) per concurrent user
        while True:
            with lock:
                i = next_index[0]
                if i >= args.requests or time.perf_counter() > deadline:
                    return
                next_index[0] += 1
            p = prompts[i % len(prompts)]
            t0 = time.perf_counter()
            try:
                got = ask(client, model, p, args.max_tokens, bool(stream_every) and i % stream_every == 0)
            except Exception as e:  # every kind of failure counts, and the first few are shown
                with lock:
                    failures[0] += 1
                    if len(errors) < 5:
                        errors.append(f"{type(e).__name__}: {str(e)[:200]}")
                continue
            with lock:
                latencies.append((time.perf_counter() - t0) * 1e3)
                corrupted[0] += got != alone[p]

    threads = [threading.Thread(target=client_loop, daemon=True) for _ in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.perf_counter()) + 5)
    wall = time.perf_counter() - start
    done = len(latencies)
    return {"clients": args.clients, "requests": args.requests, "completed": done, "failures": failures[0],
            "corrupted": corrupted[0], "not_run": args.requests - next_index[0],
            "still_running": sum(t.is_alive() for t in threads), "wall_s": wall,
            "p50_ms": percentile(latencies, 50) if done else None, "p99_ms": percentile(latencies, 99) if done else None,
            "requests_per_s": done / wall, "errors": errors}


def metrics_excerpt(url: str) -> list[str]:
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            text = r.read().decode()
    except OSError:
        return []
    return [line for line in text.splitlines()
            if not line.startswith("#") and "_created" not in line and any(k in line for k in EXCERPT)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--server", default=None, help="base URL of a running server (default: serve --target here)")
    p.add_argument("--model", default=None, help="model id (default: the first the server lists)")
    p.add_argument("--target", default="tiny-target")
    p.add_argument("--draft", default=None, help="drafter (default: tiny-draft for the bundled target; none)")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds for the whole load")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompts", type=int, default=8, help="distinct prompts, sent round robin")
    p.add_argument("--stream-share", type=float, default=0.5, help="share of the requests that stream")
    p.add_argument("--prefix-cache", action="store_true", help="(in-process server) serve with --prefix-cache")
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)
    if min(args.clients, args.requests, args.max_tokens, args.prompts) < 1 or not args.time_limit > 0 \
            or not 0 <= args.stream_share <= 1:
        print("error: --clients, --requests, --max-tokens and --prompts >= 1, --time-limit > 0, "
              "0 <= --stream-share <= 1", file=sys.stderr)
        return 2
    with ExitStack() as stack:
        url = args.server.rstrip("/") if args.server else None
        if url is None:
            url = stack.enter_context(served(args))
        model = args.model
        if model is None:
            with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
                model = json.loads(r.read())["data"][0]["id"]
        result = load(url, model, args)
        excerpt = metrics_excerpt(url)
    print(f"{result['completed']}/{args.requests} requests from {args.clients} clients in {result['wall_s']:.1f} s: "
          f"p50 {result['p50_ms'] or 0:.0f} ms, p99 {result['p99_ms'] or 0:.0f} ms, "
          f"{result['requests_per_s']:.2f} requests/s; failures {result['failures']}, corrupted "
          f"{result['corrupted']}, not run {result['not_run']}")
    for e in result["errors"]:
        print(f"  error: {e}")
    if excerpt:
        print("/metrics after the load:")
        for line in excerpt:
            print("  " + line)
    print_json({"benchmark": "serve_load", "server": args.server, "model": model, "max_tokens": args.max_tokens,
                **result, "metrics": excerpt})
    lost = result["failures"] + result["corrupted"] + result["not_run"] + result["still_running"]
    return 1 if lost else 0


def served(args):
    """The pair served in this process (max_queue = clients, so the load itself never sees a 503)."""
    from specquant.model.checkpoint import load_tokenizer
    from specquant.serve.app import create_app
    from specquant.serve.config import ServeConfig
    from specquant.serve.loopback import serving
    from specquant.spec_decode.build import build_engine
    from specquant.spec_decode.cli import pick_draft
    from specquant.spec_decode.runtime import RuntimeConfig

    tokenizer = load_tokenizer(args.target)
    engine = build_engine(args.target, pick_draft(args.target, args.draft),
                          RuntimeConfig(threads=args.threads, aot="off").validate(), target_tokenizer=tokenizer)
    config = ServeConfig(max_queue=max(args.clients, ServeConfig.max_queue), prefix_cache=args.prefix_cache)
    return serving(create_app(engine, tokenizer, config, args.target, threads=args.threads))


if __name__ == "__main__":
    sys.exit(main())
