"""What a bench run measured, kept as objects until the report: BenchResults holds a RowResult per row (per length
category a CategoryResult: its timed Samples, their Timing, the row's SpecMetrics and Prediction) and the forward
costs per length category (CategoryCosts, keyed by ForwardKey).

Every derived number is read from the object that defines it (the mean acceptance length from SpecMetrics, the
averages from RowResult), and to_json() is the one place the results.json layout is written (report.py writes it;
other tools and the docs read its keys).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from specquant.bench.config import BenchConfig
from specquant.bench.measure import ForwardKey, Timing
from specquant.bench.predict import Prediction
from specquant.bench.prompts import Prompt
from specquant.bench.spread import Interval
from specquant.bench.stages import StageTimes
from specquant.engines.timing import Sample
from specquant.spec_decode.metrics import SpecMetrics


@dataclass
class CategoryCosts:
    """Forward times of one length category, all at `context` tokens (ablation.measure_costs)."""

    context: int
    times: dict[ForwardKey, float]

    def to_json(self) -> dict:
        return {"context": self.context, **{key.name: t for key, t in self.times.items()}}


class SameTokens(NamedTuple):
    """Whether a row's greedy tokens are those of `row`, the row of its target decoding alone."""

    row: str
    match: bool


@dataclass
class CategoryResult:
    """One row on one length category's prompts.

    acceptance / prediction: speculative rows of ours; step_ratio: target-only rows, the baseline's step over this
    row's target step (both timed alone), which is their predicted speedup. speedup, decode_speedup and
    same_tokens_as are filled once every row has run (they compare with other rows)."""

    samples: dict[str, list[Sample]]  # prompt id -> the timed runs
    timing: Timing
    acceptance: SpecMetrics | None = None
    prediction: Prediction | None = None
    step_ratio: float | None = None
    speedup: float = math.nan
    speedup_interval: Interval | None = None  # 95%, from the per-run latencies (bench/spread.py)
    decode_speedup: float = math.nan
    same_tokens_as: SameTokens | None = None

    @property
    def predicted_speedup(self) -> float | None:
        return self.prediction.speedup if self.prediction is not None else self.step_ratio

    @property
    def tokens(self) -> dict[str, list[int]]:
        """Each prompt's new token ids (its first run)."""
        return {pid: ss[0].tokens for pid, ss in self.samples.items() if ss}

    @property
    def new_tokens(self) -> list[int]:
        return [s.new_tokens for ss in self.samples.values() for s in ss]

    def to_json(self) -> dict:
        out = {**dataclasses.asdict(self.timing), "new_tokens": self.new_tokens,
               "samples": {pid: [{"latency_s": s.latency_s, "ttft_s": s.ttft_s, "tpot_s": s.tpot_s} for s in ss]
                           for pid, ss in self.samples.items()}}
        if self.acceptance is not None:
            out["acceptance"] = self.acceptance.to_dict()
        if self.prediction is not None:
            out["predicted"] = self.prediction.to_json()
        elif self.step_ratio is not None:
            out["predicted"] = {"speedup": self.step_ratio}
        out["speedup"], out["decode_speedup"] = self.speedup, self.decode_speedup
        if self.speedup_interval is not None:
            out["speedup_interval"] = list(self.speedup_interval)
        if self.same_tokens_as is not None:
            out["same_tokens_as"] = self.same_tokens_as._asdict()
        return out


@dataclass
class RowResult:
    """One row of the ablation: what it ran (id .. draft_len), whether it ran, and what it measured.

    acceptance: per content set, from the untimed greedy pass (None: the row had none, e.g. target-only rows);
    acceptance_whole_block: a block row again with its whole block verified; filler: the same pass on the filler
    sets (repeating text, kept out of acceptance and acceptance_all); by_source: a hybrid row's steps split by the
    drafter that drafted them, per pass ("content", "filler")."""

    id: str
    name: str
    impl: str
    target: str
    draft: str | None
    drafter: str | None
    draft_window: int | None
    draft_len: int | None
    status: str = "ok"  # or "skipped", with a reason
    reason: str | None = None
    categories: dict[str, CategoryResult] = field(default_factory=dict)
    acceptance: dict[str, SpecMetrics] | None = None
    acceptance_whole_block: SpecMetrics | None = None
    filler: dict[str, SpecMetrics] | None = None  # per filler set (repeating text), apart from acceptance
    by_source: dict[str, dict[str, SpecMetrics]] | None = None  # a hybrid row: {pass: {source: its steps}}
    # a lossy row (the vocabulary-pruned target): its kl gate stats against the unpruned target (gate/kl.py)
    lossy: dict | None = None
    # wall time of the row's decoding in this bench: warm-up and timed runs, its acceptance passes
    seconds: float | None = None
    speedup_avg_interval: Interval | None = None  # 95%, of speedup_avg (bench/spread.py)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def acceptance_all(self) -> SpecMetrics | None:
        """The content sets' counters merged."""
        return SpecMetrics.total(self.acceptance.values()) if self.acceptance is not None else None

    def _mean(self, values: list[float]) -> float:
        return sum(values) / len(values)

    @property
    def speedup_avg(self) -> float:
        """The mean of the per-category speedups."""
        return self._mean([e.speedup for e in self.categories.values()])

    @property
    def decode_speedup_avg(self) -> float:
        return self._mean([e.decode_speedup for e in self.categories.values()])

    @property
    def timing_avg(self) -> Timing:
        """Each time's mean over the length categories."""
        return Timing(*(self._mean([getattr(e.timing, f.name) for e in self.categories.values()])
                        for f in dataclasses.fields(Timing)))

    @property
    def predicted_speedup_avg(self) -> float | None:
        """The mean predicted speedup, when every category has one."""
        preds = [e.predicted_speedup for e in self.categories.values()]
        return self._mean(preds) if preds and all(p is not None for p in preds) else None

    def to_json(self) -> dict:
        out = {"id": self.id, "name": self.name, "impl": self.impl, "target": self.target, "draft": self.draft,
               "drafter": self.drafter, "draft_window": self.draft_window, "draft_len": self.draft_len,
               "status": self.status}
        if self.seconds is not None:
            out["seconds"] = round(self.seconds, 2)
        if not self.ok:
            return {**out, "reason": self.reason}
        out["categories"] = {cat: e.to_json() for cat, e in self.categories.items()}
        if self.acceptance is not None:
            out["acceptance"] = {name: m.to_dict() for name, m in self.acceptance.items()}
            out["acceptance_all"] = self.acceptance_all.to_dict()
        if self.acceptance_whole_block is not None:
            out["acceptance_whole_block"] = self.acceptance_whole_block.to_dict()
        if self.filler is not None:
            out["filler"] = {name: m.to_dict() for name, m in self.filler.items()}
        if self.lossy is not None:
            out["lossy"] = self.lossy
        if self.by_source is not None:
            out["by_source"] = {run: {src: m.to_dict() for src, m in srcs.items()}
                                for run, srcs in self.by_source.items()}
        avg = self.timing_avg
        if self.speedup_avg_interval is not None:
            out["speedup_avg_interval"] = list(self.speedup_avg_interval)
        out.update(speedup_avg=self.speedup_avg, decode_speedup_avg=self.decode_speedup_avg,
                   latency_avg_s=avg.latency_s, ttft_avg_s=avg.ttft_s, tpot_avg_s=avg.tpot_s,
                   tokens_per_s_avg=avg.tokens_per_s)
        if self.predicted_speedup_avg is not None:
            out["predicted_speedup_avg"] = self.predicted_speedup_avg
        return out


@dataclass
class BenchResults:
    """A whole bench run (ablation.run_ablation); quantized: what run_bench quantized or was given."""

    config: BenchConfig
    environment: dict
    models: dict[str, Path]
    w4_activations: dict[str, str]
    context: int
    lengths: dict[str, int]
    prompts: list[Prompt]
    rows: list[RowResult]
    costs: dict[str, CategoryCosts]
    draft_latency: dict
    quantized: dict | None = None
    stages: StageTimes | None = None  # run_bench's wall time per stage (prepare, each measuring pass)

    def ok_rows(self) -> list[RowResult]:
        return [r for r in self.rows if r.ok]

    def row(self, row_id: str) -> RowResult:
        return next(r for r in self.rows if r.id == row_id)

    def to_json(self) -> dict:
        """results.json's layout (NaN still in it: report.py makes the file strict JSON)."""
        out = {"benchmark": "specquant bench", "config": self.config.to_json(), "environment": self.environment,
               "models": {role: str(p) for role, p in self.models.items()}, "w4_activations": self.w4_activations,
               "context": self.context, "lengths": self.lengths, "prompts": [p.to_json() for p in self.prompts],
               "rows": [r.to_json() for r in self.rows],
               "costs": {cat: c.to_json() for cat, c in self.costs.items()}, "draft_latency": self.draft_latency}
        if self.quantized is not None:
            out["quantized"] = self.quantized
        if self.stages is not None:
            out["stages"] = self.stages.to_json()
        return out
