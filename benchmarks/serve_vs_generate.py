"""The serving issue's goal, measured: one request's end-to-end time through `specquant serve` against the same
request through the engine as `specquant generate` runs it (issue 26: served within 10% of generate).

One engine, built by `specquant serve`'s own build_app from serve's flags (any flag this script does not know goes
to serve: --target, --draft, --draft-len, --threads, --aot, ...), serves on loopback in this process; the same
engine also runs generate's path, `engine.generate(tokenizer.encode(prompt), max_new_tokens)` at temperature 0 with
EOS kept. The served request is latency's: a raw, non-streamed /v1/completions from `specquant latency`'s client
(temperature 0, no ignore_eos), its prompt built to the category's length as latency builds it (and scaled by the
same factor when the context is shorter). Per category: --warmup requests of each path, then --reps pairs,
interleaved (the path that goes first alternates), so a busy machine slows both alike. Reported: each path's
median wall time and process CPU time (the CPU time is the steadier ratio on a shared machine; it includes the
server's event loop and the HTTP client, which run in this process too), served / generate for both, the mean
acceptance length each side saw, and whether the served text equals generate's (exit status 1 when not); the JSON
adds each path's median minor page faults per request.

Usage: python benchmarks/serve_vs_generate.py [--categories short,medium] [--reps 5] [--warmup 1]
       [--new-tokens N] [--tiny] [serve's flags, e.g. --draft runs/w4-draft --threads 2]
--tiny: short only, 1 pair after no warm-up, 8 new tokens (a smoke test, not a measurement).
The last stdout line is one JSON object: {"benchmark": "serve_vs_generate", "rows": {...}}.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time

import torch

from specquant.decode.sampling import SamplingConfig
from specquant.serve import cli as serve_cli
from specquant.serve.config import CATEGORIES, FILLER
from specquant.serve.latency import Client, prompt_of, scale_of
from specquant.serve.loopback import serving
from specquant.spec_decode.cli import pick_draft
from specquant.util.flags import print_json

TIMEOUT_S = 600.0


def timed(fn) -> tuple[float, float, int, object]:
    """(wall s, process CPU s, minor page faults, result) of fn()."""
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return wall, cpu, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0, out


def mal_of(before, after) -> float | None:
    if not before or not after or after[0] <= before[0]:
        return None
    return 1.0 + (after[1] - before[1]) / (after[0] - before[0])


def compare(engine, tokenizer, client: Client, prompt: str, new: int, reps: int, warmup: int) -> dict:
    """One category's interleaved pairs -> its row."""
    device = next(engine.target.parameters()).device
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)], device=device)  # as generate does
    greedy = SamplingConfig()

    def direct():
        return engine.generate(ids, new, greedy, stop_on_eos=True)

    def served():
        return client.complete(prompt, new, 0.0)

    for _ in range(warmup):
        direct()
        served()
    walls = {"generate": [], "served": []}
    cpus = {"generate": [], "served": []}
    faults = {"generate": [], "served": []}
    texts, counts, gen_drafts, gen_accepted = set(), set(), 0, 0
    before = client.spec_counters()
    for rep in range(reps):
        order = (("generate", direct), ("served", served))
        for name, fn in order if rep % 2 == 0 else order[::-1]:
            wall, cpu, fault, out = timed(fn)
            walls[name].append(wall)
            cpus[name].append(cpu)
            faults[name].append(fault)
            if name == "generate":
                tokens = out.token_ids[0]
                texts.add(("generate", tokenizer.decode(tokens, skip_special_tokens=True)))
                counts.add(("generate", len(tokens)))
                gen_drafts += out.stats.get("num_drafts", 0)
                gen_accepted += out.stats.get("num_accepted_tokens", 0)
            else:
                texts.add(("served", out["choices"][0]["text"]))
                counts.add(("served", out["usage"]["completion_tokens"]))
    served_mal = mal_of(before, client.spec_counters())
    med = {k: statistics.median(v) for k, v in walls.items()}
    cpu = {k: statistics.median(v) for k, v in cpus.items()}
    same = len({t for _, t in texts}) == 1 and len({c for _, c in counts}) == 1
    return {"prompt_tokens": ids.shape[1], "max_tokens": new, "new_tokens": sorted({c for _, c in counts}),
            "generate_ms": med["generate"] * 1e3, "served_ms": med["served"] * 1e3,
            "ratio": med["served"] / med["generate"],
            "generate_cpu_ms": cpu["generate"] * 1e3, "served_cpu_ms": cpu["served"] * 1e3,
            "cpu_ratio": cpu["served"] / cpu["generate"],
            # malloc returning and re-faulting the pages of a long context's temporaries shows here; it varies
            # with the heap's history, in the worker thread and the main thread alike
            "generate_minor_faults": statistics.median(faults["generate"]),
            "served_minor_faults": statistics.median(faults["served"]),
            "generate_mal": 1.0 + gen_accepted / gen_drafts if gen_drafts else None, "served_mal": served_mal,
            "same_text": same}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--categories", default="short,medium", help=f"some of {','.join(CATEGORIES)}")
    p.add_argument("--reps", type=int, default=5, help="interleaved pairs per category")
    p.add_argument("--warmup", type=int, default=1, help="untimed requests of each path before the pairs")
    p.add_argument("--new-tokens", type=int, default=None, help="max tokens per request (default: the category's)")
    p.add_argument("--tiny", action="store_true", help="short only, 1 pair, no warm-up, 8 new tokens")
    args, rest = p.parse_known_args(argv)
    if args.tiny:
        args.categories, args.reps, args.warmup, args.new_tokens = "short", 1, 0, 8
    cats = [c for c in args.categories.split(",") if c]
    if not cats or set(cats) - set(CATEGORIES):
        print(f"error: --categories {args.categories!r}: use some of {','.join(CATEGORIES)}", file=sys.stderr)
        return 2
    if args.reps < 1 or args.warmup < 0 or (args.new_tokens is not None and args.new_tokens < 1):
        print("error: --reps and --new-tokens must be >= 1, --warmup >= 0", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="serve_vs_generate.py")
    serve_cli.add_parser(parser.add_subparsers(dest="verb"))
    serve_args = parser.parse_args(["serve", "--port", "0", *rest])
    app, _ = serve_cli.build_app(serve_args)
    worker = app.state.worker
    engine, tokenizer = worker.engine, worker.tokenizer
    if serve_args.threads:  # the worker thread sets serve's --threads; generate's thread here gets the same
        torch.set_num_threads(serve_args.threads)
    rows = {}
    with serving(app) as url:
        client = Client(url, None, TIMEOUT_S)
        scale = scale_of(client.context(), cats)
        for cat in cats:
            prompt, n = prompt_of(client, FILLER, max(1, round(CATEGORIES[cat][0] * scale)))
            new = args.new_tokens or CATEGORIES[cat][1]
            rows[cat] = compare(engine, tokenizer, client, prompt, new, args.reps, args.warmup)
    print(f"{'category':<9} {'prompt':>6} {'new':>4} {'generate ms':>12} {'served ms':>10} {'ratio':>6} "
          f"{'cpu ratio':>9} {'MAL gen/srv':>12} {'same':>5}")
    for cat, r in rows.items():
        mal = "/".join("-" if m is None else f"{m:.2f}" for m in (r["generate_mal"], r["served_mal"]))
        print(f"{cat:<9} {r['prompt_tokens']:>6} {max(r['new_tokens']):>4} {r['generate_ms']:>12.1f} "
              f"{r['served_ms']:>10.1f} {r['ratio']:>6.3f} {r['cpu_ratio']:>9.3f} {mal:>12} "
              f"{'yes' if r['same_text'] else 'NO':>5}")
    print_json({"benchmark": "serve_vs_generate", "target": serve_args.target, "draft": pick_draft(serve_args.target, serve_args.draft),
                "threads": torch.get_num_threads(), "prompt_scale": scale, "reps": args.reps,
                "warmup": args.warmup, "rows": rows})
    return 0 if all(r["same_text"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
