"""Speculative decoding speed on the bundled pair: target alone vs speculative, and the k that SpecConfig should use.

Sweeps k in --ks (default 1,2,3,4,6,8), fixed and adaptive k, with and without the draft's sliding window, in
float32 and bfloat16, against transformers' generate(assistant_model=...) on the same checkpoints (constant k =
SpecConfig's default), all in one run. Greedy, EOS ignored, exactly --new-tokens tokens; prompts are the bench's
content sets (prose, code, qa; the first --prompts-per-set of each). Every timed repetition runs every config on a
prompt before the next, so background load hits all alike; latency = median over --runs per prompt, mean over
prompts. speedup = target-only latency / config latency (end to end; the prefill is the same for every config).

Beside each measured speedup: the predicted decode speedup from specquant.bench.predict — S = E / (k·c +
verify_ratio), E the config's mean acceptance length, c and verify_ratio from forward timings at the mean decode
context — the same implementation `specquant bench` uses.

The default draft_len is the k of the fastest fixed-k, full-attention float32 config ("best k" below).
Without the bundled weights (still training) random models of the same architecture are timed instead, with a
warning: their acceptance (and so the best k) means nothing, only the per-forward costs do.

Usage: python benchmarks/spec.py [--target tiny-target] [--draft tiny-draft] [--ks 1,2,3,4,6,8] [--runs 3]
       [--new-tokens 64] [--dtypes float32,bfloat16] [--window 128] [--threads N] [--no-hf]
The last stdout line is one JSON object: {"benchmark": "spec", "best_k": ..., "rows": [...]}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import checkpoint_dir  # noqa: E402  (the one place that builds the random stand-ins)

from specquant.bench.config import BenchConfig  # noqa: E402
from specquant.bench.measure import (Probe, environment, forward_times, hf_assisted,  # noqa: E402
                                     interleaved, ours_speculative, ours_target_only, summarize)
from specquant.bench.predict import StepCosts, predict_row  # noqa: E402
from specquant.bench.prompts import fit_lengths, load_prompts  # noqa: E402
from specquant.decode.sampling import SamplingConfig  # noqa: E402
from specquant.model.checkpoint import load_tokenizer  # noqa: E402
from specquant.util.dtypes import DTYPES  # noqa: E402
from specquant.loader import load_model  # noqa: E402
from specquant.spec_decode.config import SpecConfig  # noqa: E402
from specquant.spec_decode.engine import SpecEngine  # noqa: E402
from specquant.spec_decode.metrics import SpecMetrics  # noqa: E402


def configs(ks: list[int], window: int) -> list[dict]:
    """Target alone, then every (k, fixed/adaptive, window or not)."""
    out = [{"name": "target only", "kind": "target"}]
    for k in ks:
        for adaptive in (False, True):
            for w in (None, window):
                name = f"k={k}{' adaptive' if adaptive else ''}{f' window {w}' if w else ''}"
                spec = SpecConfig(draft_len=k, adaptive=adaptive, max_draft_len=max(k, SpecConfig.max_draft_len),
                                  draft_window=w)
                out.append({"name": name, "kind": "spec", "k": k, "adaptive": adaptive, "window": w, "spec": spec})
    return out


def bench_dtype(dtype_name: str, paths: dict, prompts, args) -> list[dict]:
    dtype = DTYPES[dtype_name]
    sampling = SamplingConfig()
    target, draft = load_model(paths["target"], dtype, fuse=True), load_model(paths["draft"], dtype, fuse=True)
    rows = configs(args.ks, args.window)
    runners = {}
    for r in rows:
        if r["kind"] == "target":
            runners[r["name"]] = ours_target_only(target, args.new_tokens, sampling)
        else:
            runners[r["name"]] = ours_speculative(SpecEngine(target, draft, r["spec"]), args.new_tokens, sampling)
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        k = SpecConfig.draft_len
        hf_row = {"name": f"transformers assisted k={k}", "kind": "transformers", "k": k}
        try:
            hf_t, hf_d = (AutoModelForCausalLM.from_pretrained(str(paths[role]), dtype=dtype, local_files_only=True)
                          .eval() for role in ("target", "draft"))
            runners[hf_row["name"]] = hf_assisted(hf_t, hf_d, args.new_tokens, k, sampling)
        except Exception as e:  # report it in the table rather than hide it
            hf_row["status"] = f"could not load: {type(e).__name__}: {str(e)[:120]}"
        rows.append(hf_row)

    samples = interleaved(runners, prompts, 1 + args.runs, 1, torch.device("cpu"), desc=f"spec {dtype_name}")

    ctx = int(sum(len(p.ids) for p in prompts) / len(prompts)) + args.new_tokens // 2
    widest = max(max(args.ks), SpecConfig.max_draft_len) + 1
    reps = BenchConfig.cost_reps
    probes = {n: Probe(target, n) for n in range(1, widest + 1)}
    probes.update({"draft": Probe(draft), "draft window": Probe(draft, window=args.window)})
    t = forward_times(probes, ctx, reps)
    sizes = list(range(1, widest + 1))
    target_t = {n: t[n] for n in sizes}
    draft_t = {None: t["draft"], args.window: t["draft window"]}

    base = summarize(samples["target only"])
    out = []
    for r in rows:
        row = {k: v for k, v in r.items() if k != "spec"}
        row.update(dtype=dtype_name, context=ctx, status=r.get("status", "ok"))
        if r["name"] not in runners:
            out.append(row)
            continue
        t = summarize(samples[r["name"]])
        row.update(dataclasses.asdict(t), speedup=base.latency_s / t.latency_s, decode_speedup=base.tpot_s / t.tpot_s)
        if r["kind"] == "spec":
            m = SpecMetrics.total(s.spec for ss in samples[r["name"]].values() for s in ss)
            k_eff = m.mean_draft_len or float(r["k"])
            costs = StepCosts(target_step_s=target_t[1], baseline_step_s=target_t[1],
                              verify_s=float(np.interp(k_eff + 1, sizes, [target_t[n] for n in sizes])),
                              draft_step_s=draft_t[r["window"]])
            pred = predict_row(m, costs)
            row.update(mean_acceptance_length=m.mean_acceptance_length, k_mean=k_eff, alpha=pred.alpha, c=pred.c,
                       verify_ratio=pred.verify_ratio, predicted_speedup=pred.speedup,
                       leviathan_speedup=pred.leviathan_speedup)
        out.append(row)
    return out


def print_table(rows: list[dict]):
    print(f"{'dtype':<9} {'config':<28} {'tok/s':>7} {'TPOT ms':>8} {'speedup':>8} {'decode':>7} {'pred':>6} "
          f"{'Lev.':>6} {'MAL':>5} {'k mean':>6} {'c':>6} {'verify':>6}")
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['dtype']:<9} {r['name']:<28} {r['status']}")
            continue

        def f(key, width, digits, suffix=""):
            v = r.get(key)
            return (f"{v:.{digits}f}{suffix}" if v is not None else "-").rjust(width)

        print(f"{r['dtype']:<9} {r['name']:<28} {f('tokens_per_s', 7, 1)} {r['tpot_s'] * 1e3:8.2f} "
              f"{f('speedup', 8, 2, 'x')} {f('decode_speedup', 7, 2, 'x')} {f('predicted_speedup', 6, 2, 'x')} "
              f"{f('leviathan_speedup', 6, 2, 'x')} {f('mean_acceptance_length', 5, 2)} {f('k_mean', 6, 2)} "
              f"{f('c', 6, 3)} {f('verify_ratio', 6, 2)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="tiny-target")
    ap.add_argument("--draft", default="tiny-draft")
    ap.add_argument("--ks", default="1,2,3,4,6,8", help="comma list of draft lengths")
    ap.add_argument("--runs", type=int, default=3, help="timed runs per prompt and config (after one warm-up)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtypes", default="float32,bfloat16", help=f"comma list from {', '.join(DTYPES)}")
    ap.add_argument("--window", type=int, default=BenchConfig().spec.draft_window, help="draft sliding window")
    ap.add_argument("--prompts-per-set", type=int, default=1)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers assisted-generation rows")
    args = ap.parse_args()
    args.ks = [int(k) for k in args.ks.split(",")]
    if args.runs < 1 or args.new_tokens < 2 or min(args.ks) < 1:
        ap.error("--runs must be >= 1, --new-tokens >= 2 and every k >= 1")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    with tempfile.TemporaryDirectory() as tmp:
        paths, random_weights = {}, False
        for role in ("target", "draft"):
            paths[role], rnd = checkpoint_dir(getattr(args, role), Path(tmp))
            random_weights |= rnd
        if random_weights:
            print("warning: random weights: acceptance and the best k below are meaningless; forward costs are real")
        tokenizer = load_tokenizer(paths["target"])
        cfg = BenchConfig()
        context = load_model(paths["target"]).config.max_position_embeddings
        lengths = fit_lengths(cfg.lengths, context, args.new_tokens)
        prompts = load_prompts(tokenizer, lengths, cfg.content_sets, 0, args.prompts_per_set,
                               min(cfg.content_max_tokens, context - args.new_tokens))
        print(f"target {args.target}, draft {args.draft}{' (random weights)' if random_weights else ''}; "
              f"{len(prompts)} prompts ({', '.join(p.id for p in prompts)}), {args.new_tokens} new tokens, "
              f"{args.runs} runs, {args.threads} threads, torch {torch.__version__}")
        rows = []
        for dtype_name in args.dtypes.split(","):
            rows += bench_dtype(dtype_name, paths, prompts, args)
    print_table(rows)
    fixed = [r for r in rows if r["status"] == "ok" and r["kind"] == "spec" and not r["adaptive"]
             and r["window"] is None and r["dtype"] == "float32"] or [
        r for r in rows if r["status"] == "ok" and r["kind"] == "spec" and not r["adaptive"] and r["window"] is None]
    best = max(fixed, key=lambda r: r["speedup"]) if fixed else None
    overall = max((r for r in rows if r["status"] == "ok" and r["kind"] == "spec"), key=lambda r: r["speedup"],
                  default=None)
    if best:
        print(f"best k (fixed, full attention, {best['dtype']}): {best['k']} — {best['speedup']:.2f}x measured, "
              f"{best['predicted_speedup']:.2f}x predicted; fastest config overall: {overall['dtype']} "
              f"{overall['name']} {overall['speedup']:.2f}x")
    print(json.dumps({"benchmark": "spec", "best_k": best["k"] if best else None,
                      "best_overall": overall and {"dtype": overall["dtype"], "name": overall["name"]},
                      "random_weights": random_weights, "environment": environment(torch.device("cpu")),
                      "rows": rows}, default=float))


if __name__ == "__main__":
    main()
