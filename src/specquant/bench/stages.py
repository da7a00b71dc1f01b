"""Wall time per stage of a bench or demo run (quantize, QAD, each measuring pass, the report), logged as each
stage ends and kept for results.json and report.md: a user sees where a run's minutes went, and a change that
makes a stage slower shows up in the next report.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable


class StageTimes:
    """An ordered record of (stage, seconds). `with times("AWQ target"):` times a stage; add() records one timed
    elsewhere. A stage entered twice keeps both entries (to_json and table sum nothing)."""

    def __init__(self, log: Callable[[str], None] | None = None):
        self.log = log
        self.stages: list[tuple[str, float]] = []

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float):
        self.stages.append((name, seconds))
        if self.log is not None:
            self.log(f"      [{seconds:6.1f} s] {name}")

    def extend(self, other: "StageTimes", prefix: str = ""):
        """Append another record's stages (not logged again: they were logged when they ended)."""
        self.stages.extend((prefix + name, s) for name, s in other.stages)

    @property
    def total_s(self) -> float:
        return sum(s for _, s in self.stages)

    def to_json(self) -> list[dict]:
        return [{"stage": name, "seconds": round(s, 2)} for name, s in self.stages]

    @classmethod
    def from_json(cls, entries: list[dict]) -> "StageTimes":
        out = cls()
        out.stages = [(e["stage"], float(e["seconds"])) for e in entries]
        return out

    def table(self, total: float | None = None) -> str:
        """A markdown table: stage, seconds, share of `total` (default: the sum of the stages)."""
        total = total or self.total_s or 1.0
        lines = ["| stage | seconds | share |", "|---|---|---|"]
        lines += [f"| {name} | {s:.1f} | {s / total:.0%} |" for name, s in self.stages]
        return "\n".join(lines)
