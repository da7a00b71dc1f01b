"""SpecConfig: the one home of speculative decoding defaults."""

from __future__ import annotations

from dataclasses import dataclass

from specquant.errors import SpecquantError

MAX_DRAFT_LEN = 32


@dataclass
class SpecConfig:
    # k: draft tokens per verify step. From benchmarks/spec.py's k sweeps on the bundled pair (float32, full
    # attention, 2 threads; docs/BENCH.md): the measured optimum is flat over k=2..5 (within run-to-run spread),
    # k=3 had the best predicted speedup in every sweep and was once the clear fastest (1.51x vs <= 1.37x).
    draft_len: int = 3
    # adaptive k: +2 after a fully accepted step, -1 after a rejection, within [1, max_draft_len]; and drafting
    # stops early when the draft's top probability falls below draft_confidence (0 = never). Off by default: on the
    # bundled pair the draft's confidence is a weak signal (benchmarks/draft_confidence.py: tokens it drafts with top
    # probability < 0.01 still match the target's argmax 48% of the time, above its 0.17-0.31 step-cost ratio).
    adaptive: bool = False
    max_draft_len: int = 12
    draft_confidence: float = 0.0
    # drafter sliding window W (None = full attention): the draft attends to its last W positions only.
    draft_window: int | None = None
    # what the windowed draft is prefilled with: "full" prompt (information can flow from beyond W through the
    # layers) or only its last W tokens ("window": prefill cost bounded by W).
    draft_prefill: str = "window"

    def validate(self) -> "SpecConfig":
        if not 1 <= self.draft_len <= MAX_DRAFT_LEN:
            raise SpecquantError(f"draft length k={self.draft_len} is out of range; use 1..{MAX_DRAFT_LEN}")
        if self.adaptive and not self.draft_len <= self.max_draft_len <= MAX_DRAFT_LEN:
            raise SpecquantError(
                f"max_draft_len {self.max_draft_len} must lie in [draft_len={self.draft_len}, {MAX_DRAFT_LEN}]"
            )
        if self.draft_window is not None and self.draft_window < 1:
            raise SpecquantError(f"draft window {self.draft_window} must be at least 1 (or omit it for full attention)")
        if not 0.0 <= self.draft_confidence < 1.0:
            raise SpecquantError(f"draft_confidence {self.draft_confidence} must lie in [0, 1)")
        if self.draft_prefill not in ("full", "window"):
            raise SpecquantError(f"draft_prefill {self.draft_prefill!r} must be 'full' or 'window'")
        return self

    @property
    def longest_draft(self) -> int:
        return self.max_draft_len if self.adaptive else self.draft_len
