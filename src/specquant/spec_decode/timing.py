"""Optional per-component timing of the speculative loop, as wrappers around the target and the drafter.

Reading a clock needs a device sync, which a GPU loop must not pay on every forward, so the loop never times
anything itself: SpecEngine(profile=True) swaps in these wrappers, which add draft_s / target_s (seconds) and
draft_calls / target_calls to the request's stats.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from specquant.util.device import sync


@dataclass
class StepTimes:
    draft_s: float = 0.0
    draft_calls: int = 0
    target_s: float = 0.0
    target_calls: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


class _Clock:
    def __init__(self, times: StepTimes, device: torch.device):
        self.times, self.device = times, device

    def run(self, role: str, fn, *args, **kwargs):
        sync(self.device)
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        sync(self.device)
        setattr(self.times, f"{role}_s", getattr(self.times, f"{role}_s") + time.perf_counter() - t0)
        setattr(self.times, f"{role}_calls", getattr(self.times, f"{role}_calls") + 1)
        return out


class TimedTarget:
    """A Stepper whose `step` calls (prefill and verify forwards) are timed."""

    def __init__(self, step, clock: _Clock):
        self.inner, self.clock = step, clock

    def step(self, *args, **kwargs):
        return self.clock.run("target", self.inner.step, *args, **kwargs)

    def step_tree(self, *args, **kwargs):
        return self.clock.run("target", self.inner.step_tree, *args, **kwargs)

    def commit_tree(self, start: int, path: list[int]):
        self.inner.commit_tree(start, path)

    def rollback(self, length: int):
        self.inner.rollback(length)


class TimedDrafter:
    """A Drafter whose prefill and propose calls are timed (each may run several draft forwards)."""

    def __init__(self, drafter, clock: _Clock):
        self.inner, self.clock = drafter, clock
        self.target_layers = drafter.target_layers

    def setup(self, batch: int, max_len: int):
        self.inner.setup(batch, max_len)

    def prefill(self, *args, **kwargs):
        return self.clock.run("draft", self.inner.prefill, *args, **kwargs)

    def propose(self, *args, **kwargs):
        return self.clock.run("draft", self.inner.propose, *args, **kwargs)

    def propose_tree(self, *args, **kwargs):
        return self.clock.run("draft", self.inner.propose_tree, *args, **kwargs)

    def accept(self, length: int, target_hidden):
        self.inner.accept(length, target_hidden)

    def rollback(self, length: int):
        self.inner.rollback(length)


def timed(target, drafter, device: torch.device,
          times: StepTimes | None = None) -> tuple[TimedTarget, TimedDrafter, StepTimes]:
    """The wrappers, adding into times (a new StepTimes when None)."""
    times = times if times is not None else StepTimes()
    clock = _Clock(times, device)
    return TimedTarget(target, clock), TimedDrafter(drafter, clock), times
