"""bench/spread.py: the speedup interval against a plain loop over the same resamples, against the exact bootstrap
distribution enumerated by hand, and the ranking that refuses to order overlapping rows."""

from __future__ import annotations

import itertools
import math
import statistics

import numpy as np
import pytest

from specquant.bench.spread import Interval, bootstrap, draws, intervals, ranking, speedup


def _runs(seed: int, cats=("short", "long"), prompts=3, n=3, scale=1.0):
    rng = np.random.default_rng(seed)
    return {c: {f"{c}{p}": [float(scale * (1 + i) * rng.lognormal(0, 0.1)) for _ in range(n)]
                for p in range(prompts)} for i, c in enumerate(cats)}


def _reference(base, row, resamples, seed, level=0.95):
    """The same resamples drawn in the same order, the statistic by plain loops: per resample and category the mean
    over prompts of the median (statistics.median) of the runs drawn, ratio, mean over categories; percentiles by
    linear interpolation between sorted values written out."""
    rng = np.random.default_rng(seed)
    index = {}
    for cat in row:
        for pid in row[cat]:
            nb, nr = len(base[cat][pid]), len(row[cat][pid])
            b = draws(nb, resamples, rng)
            index[cat, pid] = (b, b if nr == nb else draws(nr, resamples, rng))
    values = {cat: [] for cat in row}
    for k in range(resamples):
        for cat in row:
            lat_b = sum(statistics.median([base[cat][pid][i] for i in index[cat, pid][0][k]]) for pid in row[cat])
            lat_r = sum(statistics.median([row[cat][pid][i] for i in index[cat, pid][1][k]]) for pid in row[cat])
            values[cat].append(lat_b / lat_r)  # the prompt counts cancel in the ratio of means
    values["avg"] = [sum(values[c][k] for c in row) / len(row) for k in range(resamples)]

    def percentile(xs, q):
        xs = sorted(xs)
        pos = q / 100 * (len(xs) - 1)
        lo = math.floor(pos)
        return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (pos - lo)

    tail = 100 * (1 - level) / 2
    return {c: (percentile(v, tail), percentile(v, 100 - tail)) for c, v in values.items()}


@pytest.mark.parametrize("n_row", [3, 1])  # paired runs, and a row timed once against a baseline timed 3 times
def test_intervals_equal_a_plain_loop_over_the_same_resamples(n_row):
    base, row = _runs(0), _runs(1, n=n_row, scale=0.6)
    got = intervals(base, row, resamples=300, seed=7)
    want = _reference(base, row, 300, 7)
    assert set(got) == set(want) == {"short", "long", "avg"}
    for cat in want:
        assert got[cat] == pytest.approx(want[cat], rel=1e-12)
    # the point estimate is the bench's own statistic and lies in its interval
    point = speedup(base, row)
    for cat, p in point.items():
        assert got[cat].low <= p <= got[cat].high
    assert got["avg"].low <= statistics.mean(point.values()) <= got["avg"].high


def test_bootstrap_matches_the_exact_distribution_enumerated():
    """One category, 2 prompts x 2 paired runs: 4 equally likely index pairs per prompt, 16 joint resamples. The
    bootstrap's mean and its share of the largest value match the exact ones. Tolerances are 5 standard errors
    of 40,000 draws: a false failure has odds below 1e-6."""
    base = {"c": {"p": [1.0, 1.4], "q": [2.0, 2.2]}}
    row = {"c": {"p": [0.5, 0.9], "q": [1.1, 1.0]}}
    per_prompt = [list(itertools.product(range(2), repeat=2)) for _ in range(2)]
    exact = []
    for ip, iq in itertools.product(*per_prompt):
        lat_b = statistics.median([base["c"]["p"][i] for i in ip]) + statistics.median([base["c"]["q"][i] for i in iq])
        lat_r = statistics.median([row["c"]["p"][i] for i in ip]) + statistics.median([row["c"]["q"][i] for i in iq])
        exact.append(lat_b / lat_r)
    values = bootstrap(base, row, resamples=40_000, seed=3)["c"]
    sd = statistics.pstdev(exact)
    assert abs(values.mean() - statistics.mean(exact)) < 5 * sd / math.sqrt(40_000)
    top = max(exact)
    p_top = sum(v == top for v in exact) / len(exact)
    share = float(np.mean(np.isclose(values, top, rtol=1e-12)))
    assert abs(share - p_top) < 5 * math.sqrt(p_top * (1 - p_top) / 40_000)
    iv = intervals(base, row, resamples=40_000, seed=3)["c"]
    assert min(exact) <= iv.low <= iv.high <= max(exact)


def test_one_run_or_identical_runs_give_the_point_itself():
    base, row = _runs(0, n=1), _runs(1, n=1, scale=0.5)
    point = speedup(base, row)
    for cat, iv in intervals(base, row, resamples=50).items():
        want = point[cat] if cat != "avg" else statistics.mean(point.values())
        assert iv.low == pytest.approx(want) and iv.high == pytest.approx(want)
    same = {"c": {"p": [2.0, 2.0, 2.0]}}
    assert intervals(same, {"c": {"p": [1.0, 1.0, 1.0]}})["c"] == pytest.approx((2.0, 2.0))


def test_pairing_removes_load_shared_by_both_rows():
    """A round that ran slow for every row (load from another process) moves both latencies alike: the paired
    interval stays narrow where independent resampling would not."""
    slow = [1.0, 3.0, 1.0, 3.0]  # rounds 2 and 4 under load
    base = {"c": {"p": [1.0 * s for s in slow]}}
    row = {"c": {"p": [0.5 * s for s in slow]}}
    iv = intervals(base, row, resamples=500)["c"]
    assert iv.low == pytest.approx(2.0) and iv.high == pytest.approx(2.0)


def test_ranking_orders_only_rows_whose_intervals_do_not_overlap():
    rows = [("(d)", 1.55, Interval(1.50, 1.60)), ("(e)", 1.58, Interval(1.52, 1.63)),
            ("(s)", 2.07, Interval(2.00, 2.15)), ("(b)", 1.32, Interval(1.30, 1.34)),
            ("(x)", float("nan"), Interval(0, 0))]
    assert ranking(rows) == "(s) > (e) ~ (d) > (b)"
    # a slower row whose interval reaches into a faster row's (not only its neighbour's) is not ranked below it
    wide = [("(a)", 2.0, Interval(1.0, 2.2)), ("(b)", 1.9, Interval(1.85, 1.95)), ("(c)", 1.5, Interval(1.4, 1.6))]
    assert ranking(wide) == "(a) ~ (b) ~ (c)"
    assert ranking([]) == ""
