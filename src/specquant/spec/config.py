"""SpecConfig: the one home of speculative decoding defaults."""

from __future__ import annotations

from dataclasses import dataclass

from specquant.errors import SpecquantError

MAX_DRAFT_LEN = 32


@dataclass
class SpecConfig:
    # k: draft tokens per verify step. 4 is provisional: the benchmarks/spec.py k sweep on the bundled pair has not
    # been run on an idle machine yet (acceptance at k=4: 0.81/0.67/0.56/0.47 per position, MAL 3.5).
    draft_len: int = 4
    # adaptive k: +2 after a fully accepted step, -1 after a rejection, within [1, max_draft_len]; and drafting
    # stops early when the draft's top probability falls below draft_confidence.
    adaptive: bool = False
    max_draft_len: int = 12
    draft_confidence: float = 0.3
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
