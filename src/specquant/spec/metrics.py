"""Speculative decoding counters, named as vLLM names them.

drafts: verify steps that carried at least one draft token; draft_tokens: tokens proposed; accepted: draft tokens
kept; accepted_per_pos[i]: steps whose draft token at position i (0-based) was kept — cumulative, so
accepted_per_pos[i] / drafts ≈ alpha^(i+1) for i.i.d. acceptance; histogram[a]: steps that accepted exactly a.
mean acceptance length = 1 + accepted / drafts (tokens emitted per verify step, bonus/recovered included).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class SpecMetrics:
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    histogram: list[int] = field(default_factory=list)  # index = accepted count in one step
    target_forwards: int = 0  # prefill + verify forwards of the target
    draft_forwards: int = 0
    draft_s: float = 0.0
    target_s: float = 0.0

    def record_step(self, proposed: int, accepted: int):
        if proposed == 0:
            return
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted += accepted
        _grow(self.accepted_per_pos, proposed)
        for i in range(accepted):
            self.accepted_per_pos[i] += 1
        _grow(self.histogram, accepted + 1)
        self.histogram[accepted] += 1

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.drafts if self.drafts else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Fraction of proposed draft tokens that were accepted."""
        return self.accepted / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def per_position_rate(self) -> list[float]:
        return [a / self.drafts for a in self.accepted_per_pos] if self.drafts else []

    def merge(self, other: "SpecMetrics") -> "SpecMetrics":
        for name in ("drafts", "draft_tokens", "accepted", "target_forwards", "draft_forwards", "draft_s", "target_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in ((self.accepted_per_pos, other.accepted_per_pos), (self.histogram, other.histogram)):
            _grow(mine, len(theirs))
            for i, v in enumerate(theirs):
                mine[i] += v
        return self

    def to_dict(self) -> dict:
        d = asdict(self)
        d["mean_acceptance_length"] = self.mean_acceptance_length
        d["acceptance_rate"] = self.acceptance_rate
        d["per_position_rate"] = self.per_position_rate
        return d


def _grow(lst: list[int], n: int):
    if len(lst) < n:
        lst.extend([0] * (n - len(lst)))
