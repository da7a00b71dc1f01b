"""Where a speculative decode step's time goes: draft forwards, the verify forward, and everything else.

The bench's predicted decode speedup (specquant.bench.predict) counts timed forwards (draft cost c, verify
ratio) and the block drafter's accept; whatever the engine spends per step outside them (Python bookkeeping, host
syncs, argmax over the vocab, cache rollback, metrics) is what separates measured from predicted. This script
runs SpecEngine as `specquant bench` configures rows (e) (LM draft + window) and (h) (block draft + window),
greedy, EOS ignored, on one prompt of --prompt-tokens, and wraps every component of the loop in a clock:

  draft fwd     the drafter's model forwards inside propose (LM: every one-token / catch-up step; block: its one
                block forward)
  propose rest  the rest of propose (argmax, Draft assembly)
  verify fwd    the target's (k+1)-token forward
  verify rule   verify(): argmax / rejection rule and its host sync
  accept        the drafter's accept (LM: cache rollback; block: projecting the accepted target features, a
                forward of its fc and K/V projections)
  rollback      the target's cache rollback
  loop rest     decode time minus all of the above (the loop's own Python: cat, seq writes, metrics, yield)

Clocks read perf_counter after a device sync (a no-op on CPU), so on CPU the breakdown costs nothing measurable.
Each row runs --runs timed requests after one warm-up, rows interleaved; per-step numbers are medians over runs.

Usage: python benchmarks/spec_overhead.py [--target DIR|tiny-target] [--draft DIR|tiny-draft]
       [--block-draft DIR|tiny-block-draft] [--rows e,h] [--prompt-tokens 256] [--new-tokens 128] [--runs 5]
       [--threads N]
The last stdout line is one JSON object: {"benchmark": "spec_overhead", "rows": {...}}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch

import specquant.spec_decode.engine as engine_module
import specquant.spec_decode.loop as loop_module
from specquant.bench.config import BenchConfig
from specquant.bench.measure import WARM_BURST, BlockAccept, BlockForward, Probe, forward_times
from specquant.bench.predict import mean_accept_s
from specquant.bench.prompts import load_prompts
from specquant.spec_decode.engine import generate
from specquant.decode.sampling import SamplingConfig
from specquant.drafter_loader import load_block_draft
from specquant.loader import load_model
from specquant.model.checkpoint import load_tokenizer
from specquant.spec_decode.drafters.block import BlockDrafter
from specquant.spec_decode.engine import SpecEngine
from specquant.util.device import sync

PARTS = ("draft fwd", "propose rest", "verify fwd", "verify rule", "accept", "rollback", "loop rest")


class Clocks:
    """Seconds per named part, accumulated between `reset` calls; nested parts are subtracted by the caller."""

    def __init__(self, device):
        self.device, self.s, self.active = device, defaultdict(float), False

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            if not self.active:
                return fn(*args, **kwargs)
            sync(self.device)
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            sync(self.device)
            self.s[name] += time.perf_counter() - t0
            return out
        return timed

    def reset(self):
        self.s = defaultdict(float)

    def paused(self, fn):
        """fn run with the clocks off (the prefill: not decode time)."""
        def run(*args, **kwargs):
            active, self.active = self.active, False
            try:
                return fn(*args, **kwargs)
            finally:
                self.active = active
        return run


class TimedCall:
    """A callable object (a Stepper) whose calls are clocked; its other attributes pass through."""

    def __init__(self, inner, timed):
        self.inner, self.timed = inner, timed

    def __call__(self, *args, **kwargs):
        return self.timed(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def instrument(engine: SpecEngine, clocks: Clocks) -> None:
    """Wrap the engine's components in clocks (instance attributes shadow the bound methods)."""
    target, drafter = engine.target_step, engine.drafter
    target.step = clocks.wrap("verify fwd", target.step)
    target.rollback = clocks.wrap("rollback", target.rollback)
    if isinstance(drafter, BlockDrafter):
        drafter.model.propose = clocks.wrap("draft fwd", drafter.model.propose)
    else:
        drafter.step = TimedCall(drafter.step, clocks.wrap("draft fwd", drafter.step))
    drafter.propose = clocks.wrap("propose", drafter.propose)
    drafter.accept = clocks.wrap("accept", drafter.accept)


def patch_loop(clocks: Clocks):
    loop_module.verify = clocks.wrap("verify rule", loop_module.verify)
    engine_module.prefill = clocks.paused(engine_module.prefill)


def breakdown(engine: SpecEngine, clocks: Clocks, prompt: torch.Tensor, new_tokens: int) -> dict:
    clocks.reset()
    clocks.active = True
    result = engine.generate(prompt, new_tokens, SamplingConfig(), stop_on_eos=False)
    clocks.active = False
    s, stats = dict(clocks.s), result.stats
    # the prefill ran with the clocks paused (patch_loop): every clocked second is decode time
    steps = stats["target_forwards"] - 1
    parts = {
        "draft fwd": s.get("draft fwd", 0.0),
        "propose rest": s.get("propose", 0.0) - s.get("draft fwd", 0.0),
        "verify fwd": s.get("verify fwd", 0.0),
        "verify rule": s.get("verify rule", 0.0),
        "accept": s.get("accept", 0.0),
        "rollback": s.get("rollback", 0.0),
    }
    parts["loop rest"] = stats["decode_s"] - sum(parts.values())
    return {"steps": steps, "decode_s": stats["decode_s"], "prefill_s": stats["prefill_s"],
            "mal": stats["mean_acceptance_length"], "histogram": list(result.spec.histogram),
            "tokens": result.token_ids[0], **parts}


def probe_costs(target, engines: dict, cfg: BenchConfig, context: int, reps: int) -> dict[str, float]:
    """The forward costs `specquant bench` predicts from (bench.measure.forward_times: every probe timed in turn,
    so each runs after another model's forward; the target alone also right after its own step, as the bench
    times its baseline), for the rows in `engines`."""
    k = cfg.spec.draft_len
    probes = {"target": Probe(target), "target_alone": Probe(target, burst=WARM_BURST), "verify": Probe(target, k + 1)}
    if "e" in engines:
        probes["draft_e"] = Probe(engines["e"].drafter.model, window=cfg.spec.draft_window)
    if "h" in engines:
        kb, block = cfg.block_draft_len, engines["h"].drafter.model
        probes["verify_h"] = Probe(target, kb + 1)
        probes["draft_h"] = Probe(BlockForward(block, kb), window=cfg.spec.draft_window)
        accept = BlockAccept(block)
        for rows in range(1, kb + 2):
            probes[f"accept_h_{rows}"] = Probe(accept, rows, window=cfg.spec.draft_window)
    costs = forward_times(probes, context, reps)
    if "draft_e" in costs:
        costs["draft_e"] *= k  # k one-token forwards per step
    return costs


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="tiny-target")
    p.add_argument("--draft", default="tiny-draft")
    p.add_argument("--block-draft", default="tiny-block-draft")
    p.add_argument("--rows", default="e,h", help="e: LM draft + window; h: block draft + window; a: target only")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg, dtype = BenchConfig(), torch.float32
    target = load_model(args.target, dtype, fuse=True)
    tokenizer = load_tokenizer(args.target)
    first = next(q for q in load_prompts(tokenizer, {"medium": args.prompt_tokens}, ("prose",), 1, 1, 64)
                 if q.kind == "length")
    prompt = torch.tensor([first.ids])
    clocks = Clocks(prompt.device)
    patch_loop(clocks)
    engines = {}
    for row in args.rows.split(","):
        if row == "e":
            engines[row] = SpecEngine(target, load_model(args.draft, dtype, fuse=True), cfg.spec_for(True))
        elif row == "h":
            spec = cfg.block_spec_for(True)
            engines[row] = SpecEngine(target, BlockDrafter(load_block_draft(args.block_draft, dtype), target, spec),
                                      spec)
        else:
            raise SystemExit(f"unknown row {row!r}; use e and/or h")
        instrument(engines[row], clocks)
    reference = None
    samples = {row: [] for row in engines}
    target_only = []
    for rep in range(args.runs + 1):
        res = generate(target, prompt, args.new_tokens, SamplingConfig(), stop_on_eos=False)
        reference = res.token_ids[0]
        if rep:
            target_only.append(res.stats["decode_s"] / (args.new_tokens - 1))
        for row, engine in engines.items():
            b = breakdown(engine, clocks, prompt, args.new_tokens)
            if b["tokens"] != reference:
                raise SystemExit(f"row {row} emitted different greedy tokens than the target alone")
            if rep:
                samples[row].append(b)
    costs = probe_costs(target, engines, cfg, prompt.shape[1] + args.new_tokens // 2, args.runs * 10)
    t_token = statistics.median(target_only)
    out, prediction = {}, {}
    print(f"prompt {prompt.shape[1]} tokens, {args.new_tokens} new, greedy, threads {torch.get_num_threads()}; "
          f"ms per verify step, median of {args.runs} runs")
    print(f"{'row':4} {'steps':>5} {'MAL':>5} " + " ".join(f"{n:>12}" for n in PARTS) + f" {'step':>8} {'tok/s':>7}"
          f" {'rest %':>6}")
    for row, runs in samples.items():
        med = {n: statistics.median(r[n] / r["steps"] * 1e3 for r in runs) for n in PARTS}
        step = statistics.median(r["decode_s"] / r["steps"] * 1e3 for r in runs)
        tok_s = statistics.median(len(r["tokens"]) / (r["decode_s"] + r["prefill_s"]) for r in runs)
        decode_tok_s = statistics.median((len(r["tokens"]) - 1) / r["decode_s"] for r in runs)
        # the forwards a step runs, the block drafter's accept (the projections of the accepted features) included
        forwards = med["draft fwd"] + med["verify fwd"] + (med["accept"] if row == "h" else 0.0)
        overhead = step - forwards
        measured = t_token * 1e3 / (step / runs[0]["mal"])  # decode speedup vs this target alone
        in_loop = t_token * 1e3 * runs[0]["mal"] / forwards  # ... if the step were its forwards only
        # the bench's way (bench/predict.py): E · T_target alone / (draft + verify + accept per step), all probed
        probed_step = costs[f"draft_{row}"] + costs["verify_h" if row == "h" else "verify"]
        if row == "h":
            hist = [sum(h) for h in zip(*(r["histogram"] for r in runs))]
            probed_step += mean_accept_s(hist, [costs[f"accept_h_{n}"] for n in range(1, cfg.block_draft_len + 2)])
        probed = costs["target_alone"] * runs[0]["mal"] / probed_step
        prediction[row] = (measured, in_loop, probed)
        out[row] = {"decode_speedup": measured, "predicted_in_loop_forwards": in_loop,
                    "predicted_probed": probed, "steps": runs[0]["steps"], "mal": runs[0]["mal"], "step_ms": step,
                    "tok_s": tok_s,
                    "decode_tok_s": decode_tok_s, "overhead_ms": overhead,
                    **{n.replace(" ", "_") + "_ms": v for n, v in med.items()}}
        print(f"{row:4} {runs[0]['steps']:5d} {runs[0]['mal']:5.2f} " + " ".join(f"{med[n]:12.3f}" for n in PARTS)
              + f" {step:8.3f} {tok_s:7.1f} {100 * overhead / step:6.1f}")
    print(f"\ntarget alone: {t_token * 1e3:.3f} ms per decoded token (in its own loop); probed forwards (bench's "
          f"forward_times, models interleaved, at context {prompt.shape[1] + args.new_tokens // 2}): "
          + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in costs.items()))
    print(f"{'row':4} {'decode speedup':>15} {'pred. in-loop fwds':>19} {'pred. probed (bench)':>21}")
    for row, (measured, in_loop, probed) in prediction.items():
        print(f"{row:4} {measured:14.2f}x {in_loop:18.2f}x {probed:20.2f}x")
    print(json.dumps({"benchmark": "spec_overhead", "target_token_ms": t_token * 1e3,
                      "probed_ms": {k: v * 1e3 for k, v in costs.items()}, "prompt_tokens": prompt.shape[1],
                      "new_tokens": args.new_tokens,
                      "threads": torch.get_num_threads(), "rows": out}))


if __name__ == "__main__":
    main()
