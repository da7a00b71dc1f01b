"""The spread of a speedup: a 95% interval from the per-run latencies, by a paired percentile bootstrap.

The statistic is the bench's own speedup (ablation._add_speedups): per length category, the baseline's latency over
the row's, each latency the mean over the category's prompts of the median over a prompt's timed runs; the average
speedup is the mean over categories. What varies from run to run is the timing noise, not the prompts (they are
fixed), so the bootstrap resamples runs: for every prompt it draws, with replacement, as many run indices as there
are runs and recomputes the statistic from the runs drawn, RESAMPLES times; the interval is the 2.5th and 97.5th
percentiles of those values (numpy's linear interpolation). The same indices are drawn for the baseline and the
row (paired): the two ran side by side in the same round (engines/timing.interleaved), so load that hit one round
hit both, and pairing keeps that shared part out of the spread. A row with another run count than the baseline
(the transformers row, timed once) draws its own indices. The draws come from a fixed seed: a report is
reproducible from its results.json.

With one run per prompt nothing is resampled and the interval is the point itself; with two (the demo) each
prompt's median is one of its two runs or their mean, so the interval is at most the spread between rounds. Two
rows are ranked only when their intervals do not overlap (`ranking`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

RESAMPLES = 2000
SEED = 0
LEVEL = 0.95

# {length category: {prompt id: [latency of each timed run, in round order]}}
Runs = dict[str, dict[str, list[float]]]


class Interval(NamedTuple):
    low: float
    high: float

    def overlaps(self, other: "Interval") -> bool:
        return self.low <= other.high and other.low <= self.high


def speedup(base: Runs, row: Runs) -> dict[str, float]:
    """The point estimates: {category: speedup}, the statistic the interval is for (plain Python)."""
    def latency(per_prompt: dict[str, list[float]]) -> float:
        return sum(float(np.median(runs)) for runs in per_prompt.values()) / len(per_prompt)

    return {cat: latency(base[cat]) / latency(row[cat]) for cat in row}


def draws(n_runs: int, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """Run indices [resamples, n_runs], each row a resample with replacement."""
    return rng.integers(0, n_runs, size=(resamples, n_runs))


def _latencies(per_prompt: dict[str, list[float]], index: dict[str, np.ndarray]) -> np.ndarray:
    """Each resample's latency [resamples]: the mean over prompts of the median of the runs drawn."""
    meds = [np.median(np.asarray(runs)[index[pid]], axis=1) for pid, runs in per_prompt.items()]
    return np.mean(meds, axis=0)


def bootstrap(base: Runs, row: Runs, resamples: int = RESAMPLES, seed: int = SEED) -> dict[str, np.ndarray]:
    """Each category's speedup over the resamples, {category: [resamples]}, plus "avg" (their mean)."""
    rng = np.random.default_rng(seed)
    out = {}
    for cat in row:
        base_index, row_index = {}, {}
        for pid in row[cat]:
            nb, nr = len(base[cat][pid]), len(row[cat][pid])
            base_index[pid] = draws(nb, resamples, rng)
            row_index[pid] = base_index[pid] if nr == nb else draws(nr, resamples, rng)  # paired where possible
        out[cat] = _latencies(base[cat], base_index) / _latencies(row[cat], row_index)
    out["avg"] = np.mean([out[cat] for cat in row], axis=0)
    return out


def intervals(base: Runs, row: Runs, level: float = LEVEL, resamples: int = RESAMPLES,
              seed: int = SEED) -> dict[str, Interval]:
    """{category: Interval, "avg": Interval}: the percentile interval of each speedup."""
    tail = 100 * (1 - level) / 2
    return {cat: Interval(float(np.percentile(v, tail)), float(np.percentile(v, 100 - tail)))
            for cat, v in bootstrap(base, row, resamples, seed).items()}


def ranking(rows: list[tuple[str, float, Interval]]) -> str:
    """Rows (label, speedup, interval) from fastest to slowest, joined by ">" where the next row's interval lies
    wholly below every faster row's, else by "~" (the intervals overlap: the run cannot tell them apart, so they
    are not ranked)."""
    ordered = sorted((r for r in rows if not math.isnan(r[1])), key=lambda r: -r[1])
    if not ordered:
        return ""
    parts, floor = [ordered[0][0]], ordered[0][2].low
    for label, _, iv in ordered[1:]:
        parts.append(("> " if iv.high < floor else "~ ") + label)
        floor = min(floor, iv.low)
    return " ".join(parts)
