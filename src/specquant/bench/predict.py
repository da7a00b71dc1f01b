"""Predicted speedup of speculative decoding from measured acceptance and measured forward costs.

Leviathan et al. 2023 (Fast Inference from Transformers via Speculative Decoding), with k draft tokens per step:
- α: the chance that one draft token is accepted (taken i.i.d. across positions).
- Each verify step emits the accepted tokens plus one (recovered or bonus), so the expected tokens per target
  forward is E = (1 - α^(k+1)) / (1 - α). Its empirical version is the mean acceptance length
  1 + accepted / drafts = Σ_a (a + 1)·histogram[a] / Σ_a histogram[a].
- One step costs k draft forwards plus one target forward over k+1 tokens. Leviathan counts that verify forward as
  one decode step (T_verify = T_target) and writes c = T_draft / T_target, so the wall-time speedup over decoding
  with the target alone is S = E / (k·c + 1) = (1 - α^(k+1)) / ((1 - α)(k·c + 1)).

A (k+1)-token forward is not free on real hardware (on a CPU it is compute-bound sooner than a GPU is), so we
measure it: verify_ratio = T_target(k+1 tokens) / T_target(1 token). A block drafter also pays, every step, its
`accept`: the fc and K/V projections of the accepted target features (a + 1 rows after a accepted drafts), timed
per row count and weighted by the histogram (accept_ratio = mean accept time / T_target; 0 for an LM drafter, whose
accept is an O(1) cache rollback). We predict

    S_predicted = E / (k·c + verify_ratio + accept_ratio)

with E from the measured histogram. `leviathan_speedup` keeps the paper's closed form (α backed out of the mean
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


def mean_tokens_per_step(histogram: list[int]) -> float:
    """E from a histogram of accepted counts per verify step (index = accepted): the mean acceptance length."""
    steps = sum(histogram)
    if steps == 0:
        return 1.0  # no step carried a draft: one token per target forward
    return sum((a + 1) * n for a, n in enumerate(histogram)) / steps


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


def predicted_speedup(histogram: list[int], k: float, c: float, verify_ratio: float,
                      accept_ratio: float = 0.0) -> float:
    """S = E / (k·c + verify_ratio + accept_ratio), E from the measured histogram; speedup of the decode phase over
    the row's target decoding alone."""
    return mean_tokens_per_step(histogram) / (k * c + verify_ratio + accept_ratio)


def mean_accept_s(histogram: list[int], accept_s: list[float]) -> float:
    """The drafter's accept time per verify step: accept_s[a] is its accept after a accepted drafts (a + 1 rows of
    target features), weighted by how often each a happened."""
    steps = sum(histogram)
    if steps == 0:
        return 0.0
    if len(accept_s) < len(histogram):
        raise ValueError(f"accept times for {len(accept_s)} accepted counts; the histogram has {len(histogram)}")
    return sum(n * t for n, t in zip(histogram, accept_s)) / steps


def predict_row(histogram: list[int], draft_tokens: int, drafts: int, costs: dict) -> dict:
    """All predicted numbers for one speculative row in one category.

    costs, all at the category's context: target_step_s (the row's target, 1 token), verify_s ((k+1)-token
    forward), draft_step_s, timed as a speculative step runs them (after other models' forwards); baseline_step_s
    (the baseline target, 1 token) as its own decode loop runs it (after its own forward); optional
    draft_forwards_per_step: 1 for a block drafter, whose one forward drafts the whole step (c is then its
    forward's cost and k·c becomes 1·c); optional accept_s: the block drafter's accept time after 0, 1, .., k
    accepted drafts. k is the mean number of draft tokens per step (= draft_len unless adaptive or cut by
    max_new_tokens).
    """
    k = draft_tokens / drafts if drafts else 0.0
    # a per-token drafter pays k forwards per step; a block drafter one (counted as k·c with c scaled by 1/k)
    c = costs["draft_step_s"] / costs["target_step_s"] * (costs["draft_forwards_per_step"] / k
                                                          if "draft_forwards_per_step" in costs and k else 1.0)
    verify_ratio = costs["verify_s"] / costs["target_step_s"]
    accept_s = mean_accept_s(histogram, costs["accept_s"]) if "accept_s" in costs else 0.0  # LM drafter: none
    accept_ratio = accept_s / costs["target_step_s"]
    e = mean_tokens_per_step(histogram)
    alpha = alpha_from_mal(e, k) if k else 0.0
    s_row = predicted_speedup(histogram, k, c, verify_ratio, accept_ratio)
    # S_row · T_baseline / T_target = E · T_baseline / (k·T_draft + T_verify + T_accept): the row's own target
    # step cancels, so the speedup over the baseline rests on the forwards the row runs and the baseline's step
    rescale = costs["baseline_step_s"] / costs["target_step_s"]
    return {
        "k": k, "alpha": alpha, "c": c, "c_forward": costs["draft_step_s"] / costs["target_step_s"],
        "draft_forwards_per_step": costs.get("draft_forwards_per_step", k), "verify_ratio": verify_ratio,
        "accept_ratio": accept_ratio, "expected_tokens": e,
        "expected_tokens_leviathan": expected_tokens(alpha, k),
        "speedup_vs_own_target": s_row,
        "leviathan_speedup_vs_own_target": leviathan_speedup(alpha, k, c),
        "rescale": rescale,
        "speedup": s_row * rescale,  # vs the baseline row (a)
        "leviathan_speedup": leviathan_speedup(alpha, k, c) * rescale,
    }
