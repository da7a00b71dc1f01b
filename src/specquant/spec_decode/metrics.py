"""Speculative decoding counters, named as vLLM's SpecDecodingStats names them.

num_drafts: verify steps that carried at least one draft token; num_draft_tokens: draft tokens proposed;
num_accepted_tokens: draft tokens kept; num_accepted_tokens_per_pos[i]: drafts whose token at position i (0-based)
was kept — cumulative, so num_accepted_tokens_per_pos[i] / num_drafts ≈ alpha^(i+1) for i.i.d. acceptance.
Derived as vLLM derives them: mean acceptance length = 1 + num_accepted_tokens / num_drafts (tokens emitted per
verify step, the recovered or bonus token included); acceptance rate = num_accepted_tokens / num_draft_tokens.
These properties are the one definition of both: the engine's stats, bench's report, its JSON and its prediction
(bench/predict.py's E) all read them from here.
Our addition: histogram[a] = drafts that accepted exactly a tokens (the prediction weighs per-step costs by it).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass(frozen=True)
class StepMetrics:
    """One step's counters: proposed draft tokens (0: the prefill or a step without drafts) and accepted ones;
    SpecMetrics.record_step adds them up."""

    proposed: int
    accepted: int


@dataclass
class SpecMetrics:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    histogram: list[int] = field(default_factory=list)  # index = accepted count in one draft

    def record_step(self, proposed: int, accepted: int):
        if proposed == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        _grow(self.num_accepted_tokens_per_pos, proposed)
        for i in range(accepted):
            self.num_accepted_tokens_per_pos[i] += 1
        _grow(self.histogram, accepted + 1)
        self.histogram[accepted] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify step that carried a draft; 0.0 when none did."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Fraction of proposed draft tokens that were accepted."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        return [a / self.num_drafts for a in self.num_accepted_tokens_per_pos] if self.num_drafts else []

    @property
    def mean_draft_len(self) -> float:
        """Draft tokens per draft (= k unless adaptive, a confidence stop or max_new_tokens cut a draft short)."""
        return self.num_draft_tokens / self.num_drafts if self.num_drafts else 0.0

    def merge(self, other: "SpecMetrics") -> "SpecMetrics":
        """Add other's counters into self (in place); returns self."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for mine, theirs in ((self.num_accepted_tokens_per_pos, other.num_accepted_tokens_per_pos),
                             (self.histogram, other.histogram)):
            _grow(mine, len(theirs))
            for i, v in enumerate(theirs):
                mine[i] += v
        return self

    def __add__(self, other: "SpecMetrics") -> "SpecMetrics":
        return SpecMetrics().merge(self).merge(other)

    @classmethod
    def total(cls, metrics) -> "SpecMetrics":
        """The sum of an iterable of SpecMetrics (None entries, e.g. target-only samples, are skipped)."""
        out = cls()
        for m in metrics:
            if m is not None:
                out.merge(m)
        return out

    def to_dict(self) -> dict:
        """The counters and the derived rates, for JSON reports."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d = {k: list(v) if isinstance(v, list) else v for k, v in d.items()}
        d.update(mean_acceptance_length=self.mean_acceptance_length, acceptance_rate=self.acceptance_rate,
                 acceptance_rate_per_pos=self.acceptance_rate_per_pos)
        return d


def _grow(lst: list[int], n: int):
    if len(lst) < n:
        lst.extend([0] * (n - len(lst)))
