"""Wall time per stage of a bench or demo run (quantize, QAD, each measuring pass, the report), logged as each
stage ends and kept for results.json and report.md: a user sees where a run's minutes went, and a change that
makes a stage slower shows up in the next report.

Each stage also records this process's CPU seconds (every thread's): on a machine shared with other jobs, wall
time stretches with their load while CPU time mostly does not, so CPU seconds compare runs made under different
loads (at one thread, they are close to the stage's wall time on an idle machine).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, NamedTuple


class Stage(NamedTuple):
    name: str
    seconds: float  # wall
    cpu_seconds: float  # this process, every thread


class StageTimes:
    """An ordered record of stages. `with times("AWQ target"):` times a stage; add() records one timed elsewhere.
    A stage entered twice keeps both entries."""

    def __init__(self, log: Callable[[str], None] | None = None):
        self.log = log
        self.stages: list[Stage] = []

    @contextmanager
    def __call__(self, name: str):
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - wall, time.process_time() - cpu)

    def add(self, name: str, seconds: float, cpu_seconds: float):
        self.stages.append(Stage(name, seconds, cpu_seconds))
        if self.log is not None:
            self.log(f"      [{seconds:6.1f} s, CPU {cpu_seconds:6.1f} s] {name}")

    @property
    def total_s(self) -> float:
        return sum(s.seconds for s in self.stages)

    @property
    def total_cpu_s(self) -> float:
        return sum(s.cpu_seconds for s in self.stages)

    def to_json(self) -> list[dict]:
        return [{"stage": s.name, "seconds": round(s.seconds, 2), "cpu_seconds": round(s.cpu_seconds, 2)}
                for s in self.stages]

    def table(self) -> str:
        """A markdown table: stage, wall seconds, CPU seconds, share of the wall total."""
        total = self.total_s or 1.0
        lines = ["| stage | seconds | CPU seconds | share |", "|---|---|---|---|"]
        lines += [f"| {s.name} | {s.seconds:.1f} | {s.cpu_seconds:.1f} | {s.seconds / total:.0%} |"
                  for s in self.stages]
        return "\n".join(lines)
