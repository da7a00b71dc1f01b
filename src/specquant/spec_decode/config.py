"""SpecConfig: the one home of speculative decoding defaults (how an engine runs is spec_decode/runtime.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specquant.errors import SpecquantError

MAX_DRAFT_LEN = 32
MAX_TREE_NODES = 63  # a tree's verify rows (nodes + root) within the native attention's 64 (model/attention.py)


@dataclass
class SpecConfig:
    # k = 3: the measured optimum on the bundled pair is flat over k = 2..5 and k = 3 predicted best (docs/BENCH.md)
    draft_len: int = field(default=3, metadata={"help": "draft tokens per verify step (k)"})
    adaptive: bool = field(default=False, metadata={
        "help": "adapt k to acceptance: +2 after a fully accepted draft, -1 after a rejection (spec_decode/adaptive.py)"})
    max_draft_len: int = field(default=12, metadata={"help": "adaptive: the largest k"})
    # off by default: on the bundled pair the draft's confidence is a weak signal (benchmarks/draft_confidence.py at dfedb37)
    draft_confidence: float = field(default=0.0, metadata={
        "help": "end a draft early when the draft's top probability is below this; 0 = never"})
    draft_window: int | None = field(default=None, metadata={
        "help": "drafter sliding window W: the draft attends to its last W positions (default: full attention)"})
    # "full": the windowed draft is prefilled with the whole prompt (information flows from beyond W through the
    # layers); "window": with its last W tokens only (prefill cost bounded by W)
    draft_prefill: str = field(default="window", metadata={
        "help": "what a windowed draft is prefilled with", "choices": ("full", "window")})

    # off by default: on a CPU every verify row costs about as much as a decode step's (docs/BENCH.md, "Tree verify")
    tree_nodes: int = field(default=0, metadata={
        "help": "draft a token tree of up to N tokens per step (several continuations, verified in one target "
                "forward of N + 1 rows; spec_decode/tree.py); 0 = a chain of --draft-len tokens"})

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
        if not 0 <= self.tree_nodes <= MAX_TREE_NODES:
            raise SpecquantError(f"tree_nodes {self.tree_nodes} is out of range; use 0 (a chain) .. {MAX_TREE_NODES}")
        if self.tree_nodes and self.adaptive:
            raise SpecquantError("--adaptive sizes chains; a tree's size is --tree-nodes (drop one of them)")
        if self.draft_prefill not in ("full", "window"):
            raise SpecquantError(f"draft_prefill {self.draft_prefill!r} must be 'full' or 'window'")
        return self

    @property
    def longest_draft(self) -> int:
        return self.max_draft_len if self.adaptive else self.draft_len

