"""Predicted speedup of speculative decoding from measured acceptance and measured forward costs.

Leviathan et al. 2023 (Fast Inference from Transformers via Speculative Decoding), with k draft tokens per step:
- α: the chance that one draft token is accepted (taken i.i.d. across positions).
- Each verify step emits the accepted tokens plus one (recovered or bonus), so the expected tokens per target
  forward is E = (1 - α^(k+1)) / (1 - α). Its empirical version is the mean acceptance length
  1 + accepted / drafts (SpecMetrics.mean_acceptance_length, spec_decode/metrics.py).
- One step costs k draft forwards plus one target forward over k+1 tokens. Leviathan counts that verify forward as
  one decode step (T_verify = T_target) and writes c = T_draft / T_target, so the wall-time speedup over decoding
  with the target alone is S = E / (k·c + 1) = (1 - α^(k+1)) / ((1 - α)(k·c + 1)).

A (k+1)-token forward is not free on real hardware (on a CPU it is compute-bound sooner than a GPU is), so we
measure it: verify_ratio = T_target(k+1 tokens) / T_target(1 token). A block drafter also pays, every step, its
`accept`: the fc and K/V projections of the accepted target features (a + 1 rows after a accepted drafts), timed
per row count and weighted by the histogram (accept_ratio = mean accept time / T_target; 0 for an LM drafter, whose
accept is an O(1) cache rollback). We predict

    S_predicted = E / (k·c + verify_ratio + accept_ratio)

with E the measured mean acceptance length. `leviathan_speedup` keeps the paper's closed form (α backed out of the mean
acceptance length, verify_ratio = 1, no accept) beside it. Both predict the decode phase only (time per output
token); end-to-end latency adds the prefill, which speculation does not speed up, and the engine's own overhead
(sampling, host-side bookkeeping) that neither formula counts — the gap between predicted and measured is that
overhead. When the row's target is not the baseline's (a W4 target), the prediction is rescaled to the baseline:
S_vs_baseline = S_predicted · T_baseline_step / T_row_target_step = E · T_baseline_step / (k·T_draft + T_verify +
T_accept). Each cost is timed the way its loop runs it: the baseline's step right after its own step (a target
decoding alone), the row's forwards after other models' forwards (a speculative step alternates models). Timing the
baseline's step between other models' forwards read it 1.4x its measured TPOT at 2 threads (docs/BENCH.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from specquant.spec_decode.metrics import SpecMetrics


def tokens_per_step(metrics: SpecMetrics) -> float:
    """E: the measured mean acceptance length, or 1 when no step carried a draft (one token per target
    forward)."""
    return metrics.mean_acceptance_length if metrics.num_drafts else 1.0


def expected_tokens(alpha: float, k: float) -> float:
    """Leviathan's E = (1 - α^(k+1)) / (1 - α); k may be a mean (adaptive drafting)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def alpha_from_mal(mal: float, k: float, iters: int = 60) -> float:
    """The α whose expected tokens per step equals the measured mean acceptance length (bisection; E rises in α)."""
    if mal <= 1.0:
        return 0.0
    if mal >= k + 1.0:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) < mal else (lo, mid)
    return (lo + hi) / 2


def leviathan_speedup(alpha: float, k: float, c: float) -> float:
    """S = (1 - α^(k+1)) / ((1 - α)(k·c + 1)): the paper's formula (verify forward costs one decode step)."""
    return expected_tokens(alpha, k) / (k * c + 1.0)


def predicted_speedup(e: float, k: float, c: float, verify_ratio: float, accept_ratio: float = 0.0) -> float:
    """S = E / (k·c + verify_ratio + accept_ratio), E the measured tokens per step (tokens_per_step); speedup of
    the decode phase over the row's target decoding alone."""
    return e / (k * c + verify_ratio + accept_ratio)


def mean_accept_s(histogram: list[int], accept_s) -> float:
    """The drafter's accept time per verify step: accept_s[a] is its accept after a accepted drafts (a + 1 rows of
    target features), weighted by how often each a happened."""
    steps = sum(histogram)
    if steps == 0:
        return 0.0
    if len(accept_s) < len(histogram):
        raise ValueError(f"accept times for {len(accept_s)} accepted counts; the histogram has {len(histogram)}")
    return sum(n * t for n, t in zip(histogram, accept_s)) / steps


@dataclass(frozen=True)
class StepCosts:
    """What one verify step of a speculative row costs, all at one context.

    target_step_s (the row's target, 1 token), verify_s ((k+1)-token forward), draft_step_s: timed as a
    speculative step runs them (after other models' forwards); baseline_step_s (the baseline target, 1 token) as
    its own decode loop runs it (after its own forward); draft_forwards_per_step: 1 for a block drafter, whose one
    forward drafts the whole step (c is then its forward's cost and k·c becomes 1·c), None for a drafter that runs
    one forward per draft token; accept_s: the block drafter's accept time after 0, 1, .., k accepted drafts (None:
    an LM drafter, whose accept is a cache rollback)."""

    target_step_s: float
    verify_s: float
    draft_step_s: float
    baseline_step_s: float
    draft_forwards_per_step: int | None = None
    accept_s: tuple[float, ...] | None = None


@dataclass(frozen=True)
class Prediction:
    """predict_row's numbers for one speculative row in one category (field order = results.json's)."""

    k: float  # mean draft tokens per step
    alpha: float  # backed out of the MAL (Leviathan's closed form)
    c: float  # draft cost per drafted token / target step
    c_forward: float  # one drafter forward / target step
    draft_forwards_per_step: float
    verify_ratio: float
    accept_ratio: float
    expected_tokens: float  # E: the measured mean acceptance length
    expected_tokens_leviathan: float
    speedup_vs_own_target: float
    leviathan_speedup_vs_own_target: float
    rescale: float  # baseline step / the row's target step
    speedup: float  # vs the baseline row (a)
    leviathan_speedup: float

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def predict_row(metrics: SpecMetrics, costs: StepCosts) -> Prediction:
    """All predicted numbers for one speculative row in one category, from its acceptance counters (k is their
    mean draft tokens per step: draft_len unless adaptive or cut by max_new_tokens) and its step costs."""
    k = metrics.mean_draft_len
    # a per-token drafter pays k forwards per step; a block drafter one (counted as k·c with c scaled by 1/k)
    per_token = costs.draft_forwards_per_step is None
    c = costs.draft_step_s / costs.target_step_s * (costs.draft_forwards_per_step / k if not per_token and k else 1.0)
    verify_ratio = costs.verify_s / costs.target_step_s
    accept_s = mean_accept_s(metrics.histogram, costs.accept_s) if costs.accept_s is not None else 0.0
    accept_ratio = accept_s / costs.target_step_s
    e = tokens_per_step(metrics)
    alpha = alpha_from_mal(e, k) if k else 0.0
    s_row = predicted_speedup(e, k, c, verify_ratio, accept_ratio)
    # S_row · T_baseline / T_target = E · T_baseline / (k·T_draft + T_verify + T_accept): the row's own target
    # step cancels, so the speedup over the baseline rests on the forwards the row runs and the baseline's step
    rescale = costs.baseline_step_s / costs.target_step_s
    return Prediction(
        k=k, alpha=alpha, c=c, c_forward=costs.draft_step_s / costs.target_step_s,
        draft_forwards_per_step=k if per_token else costs.draft_forwards_per_step, verify_ratio=verify_ratio,
        accept_ratio=accept_ratio, expected_tokens=e, expected_tokens_leviathan=expected_tokens(alpha, k),
        speedup_vs_own_target=s_row, leviathan_speedup_vs_own_target=leviathan_speedup(alpha, k, c),
        rescale=rescale, speedup=s_row * rescale, leviathan_speedup=leviathan_speedup(alpha, k, c) * rescale)
