"""One request -> one Sample, and the one interleaved timing loop every engine's rows go through: bench's rows
and benchmarks/*.py (bench/measure.py) and the engine table's row of our engine (engines/ours.py).

A sample is one whole generate call, fixed length (EOS ignored), timed around the call after a device sync:
latency_s is end to end (cache setup, prefill, decode); ttft_s is the time to the first new token (the prefill
forward, plus the draft's prefill for speculative rows — both are needed before the first draft); tpot_s and
tokens_per_s as decode.result defines them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from specquant.decode.result import tokens_per_s, tpot_s
from specquant.decode.sampling import SamplingConfig
from specquant.spec_decode.engine import generate
from specquant.spec_decode.metrics import SpecMetrics
from specquant.util.device import sync


@dataclass(frozen=True)
class Sample:
    """One timed request: its times, its new token ids, and its acceptance counters (SpecMetrics, speculative
    runners only; None otherwise)."""

    latency_s: float
    ttft_s: float
    tpot_s: float
    new_tokens: int
    tokens_per_s: float
    tokens: list[int]
    spec: SpecMetrics | None = None


def sample_from(latency: float, ttft: float, new_tokens: int, tokens: list[int], spec=None,
                decode_tokens: int | None = None) -> Sample:
    """The Sample of one request; decode_tokens: the tokens TPOT counts (default new_tokens)."""
    return Sample(latency, ttft, tpot_s(new_tokens if decode_tokens is None else decode_tokens, latency, ttft),
                  new_tokens, tokens_per_s(new_tokens, latency), tokens, spec)


def ours_target_only(model, max_new_tokens: int, sampling: SamplingConfig):
    """A runner: prompt_ids [1, L] -> sample, for the target decoding alone."""

    def run(prompt_ids: torch.Tensor) -> Sample:
        sync(prompt_ids.device)
        t0 = time.perf_counter()
        res = generate(model, prompt_ids, max_new_tokens, sampling, stop_on_eos=False)
        sync(prompt_ids.device)
        latency = time.perf_counter() - t0
        return sample_from(latency, latency - res.stats["decode_s"], res.stats["new_tokens"], res.token_ids[0])

    return run


def ours_speculative(engine, max_new_tokens: int, sampling: SamplingConfig):
    """A runner for SpecEngine; the sample carries this request's acceptance counters (a SpecMetrics)."""

    def run(prompt_ids: torch.Tensor) -> Sample:
        sync(prompt_ids.device)
        t0 = time.perf_counter()
        res = engine.generate(prompt_ids, max_new_tokens, sampling, stop_on_eos=False)
        sync(prompt_ids.device)
        latency = time.perf_counter() - t0
        return sample_from(latency, latency - res.stats["decode_s"], res.stats["new_tokens"], res.token_ids[0],
                           res.spec)

    return run


def interleaved(runners: dict[str, Callable[[torch.Tensor], Sample]], prompts, repetitions: int, warmup: int,
                device: torch.device, on_error: Callable[[str, Exception], bool] | None = None,
                desc: str = "latency", seconds: dict[str, float] | None = None,
                rounds: dict[str, int] | None = None,
                warmup_prompts: int | None = None) -> dict[str, dict[str, list[Sample]]]:
    """{runner name: {prompt id: samples}} from `repetitions` rounds, the first `warmup` of them untimed.
    seconds: where given, each runner's wall time in this call (warm-up rounds included) is added to seconds[name].
    rounds: a runner named there takes part in its first rounds[name] rounds only (warm-up included).
    warmup_prompts: the warm-up rounds run only the first N prompts (None: every prompt).

    Interleaved: each round runs every runner on a prompt before the next prompt, so load from other processes
    hits all runners alike and ratios between them are taken side by side. on_error(name, exception) -> True drops
    that runner and goes on (e.g. transformers' assisted generation failing); otherwise the error propagates.
    """
    from specquant.util.progress import Progress

    runners, rounds = dict(runners), rounds or {}
    samples = {name: {p.id: [] for p in prompts} for name in runners}

    def prompts_of(rep: int):
        return prompts[:warmup_prompts] if rep < warmup and warmup_prompts is not None else prompts

    calls = sum(len(prompts_of(rep)) for name in runners for rep in range(min(rounds.get(name, repetitions),
                                                                               repetitions)))
    # no closing line: bench logs each pass's wall time as a stage (bench/stages.py)
    with Progress(calls, desc, "call", summary=False) as bar:
        for rep in range(repetitions):
            for p in prompts_of(rep):
                ids = torch.tensor([p.ids], device=device)
                for name in [n for n in runners if rep < rounds.get(n, repetitions)]:
                    t0, s = time.perf_counter(), None
                    try:
                        s = runners[name](ids)
                    except Exception as e:
                        if on_error is None or not on_error(name, e):
                            raise
                        del runners[name], samples[name]
                        continue
                    finally:
                        bar.update(1, status=f"{name}: {s.tokens_per_s:.0f} tok/s" if s is not None else None)
                        if seconds is not None:
                            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - t0
                    if rep >= warmup:
                        samples[name][p.id].append(s)
    return samples
