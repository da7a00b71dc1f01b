"""SpecConfig: the one home of speculative decoding defaults; RuntimeConfig: how an engine runs (dtype, device,
W4 activations, compiled steps, threads), shared by `generate`, `bench` and the gates."""

from __future__ import annotations

from dataclasses import dataclass, field

from specquant.decode.aot import AOT_MODES
from specquant.errors import SpecquantError
from specquant.quant.config import DRAFT_W4_ACTIVATIONS, W4_ACTIVATIONS
from specquant.util.device import DEVICES
from specquant.util.dtypes import DTYPES

MAX_DRAFT_LEN = 32


@dataclass
class SpecConfig:
    # k = 3: the measured optimum on the bundled pair is flat over k = 2..5 and k = 3 predicted best (docs/BENCH.md)
    draft_len: int = field(default=3, metadata={"help": "draft tokens per verify step (k)"})
    adaptive: bool = field(default=False, metadata={
        "help": "adapt k to acceptance: +2 after a fully accepted draft, -1 after a rejection (spec_decode/adaptive.py)"})
    max_draft_len: int = field(default=12, metadata={"help": "adaptive: the largest k"})
    # off by default: on the bundled pair the draft's confidence is a weak signal (benchmarks/draft_confidence.py)
    draft_confidence: float = field(default=0.0, metadata={
        "help": "end a draft early when the draft's top probability is below this; 0 = never"})
    draft_window: int | None = field(default=None, metadata={
        "help": "drafter sliding window W: the draft attends to its last W positions (default: full attention)"})
    # "full": the windowed draft is prefilled with the whole prompt (information flows from beyond W through the
    # layers); "window": with its last W tokens only (prefill cost bounded by W)
    draft_prefill: str = field(default="window", metadata={
        "help": "what a windowed draft is prefilled with", "choices": ("full", "window")})

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


@dataclass
class RuntimeConfig:
    """How an engine runs its models (not what it computes: every setting keeps greedy speculative decoding
    exact against the same target). Each command exposes its share as flags (util/flags.py `fields`)."""

    dtype: str = field(default="float32", metadata={"help": "dtype of the models' weights and activations",
                                                    "choices": tuple(DTYPES)})
    device: str = field(default="cpu", metadata={"help": "device to run on", "choices": DEVICES})
    w4_activations: str = field(default="float", metadata={
        "help": "a W4 target's activations: float (W4A16, as the checkpoint) or int8 (W4A8, GGUF's Q4_0 x Q8_0 on "
                "the native VNNI kernel: cheaper verify steps, slightly lower quality)", "choices": W4_ACTIVATIONS})
    draft_w4_activations: str = field(default="auto", metadata={
        "help": "a W4 drafter's activations: auto (int8 where the W4A8 kernel runs: a drafter only proposes, so "
                "only acceptance can change), float or int8", "choices": DRAFT_W4_ACTIVATIONS})
    compile: bool = field(default=False, metadata={
        "store_true": True,
        "help": "torch.compile the decode / verify steps (graphs cached on disk under $SPECQUANT_CACHE/compile). "
                "Off by default: on CPU it pays only past ~2000 new tokens per process with a warm cache, more "
                "with a cold one (docs/SHAPES.md)"})
    # "off" here, so engines built by bench and the gates never pick up packages; `specquant generate` defaults
    # to "cached" (decode.aot.AotConfig says why)
    aot: str = field(default="off", metadata={
        "choices": AOT_MODES,
        "help": "AOTInductor-packaged steps (the decode step; speculative: the full-length verify step and the "
                "LM draft's steps). 'cached' uses them when on disk (under $SPECQUANT_CACHE/compile/aot) and runs "
                "eagerly otherwise; 'build' builds missing ones first (~25 s each on one core, once per machine, "
                "thread count and request-length bucket); 'off': always eager"})
    threads: int = field(default=0, metadata={"help": "torch threads; 0 = torch's default (OMP_NUM_THREADS)"})

    def validate(self) -> "RuntimeConfig":
        device_type = str(self.device).split(":")[0]  # cuda:1 is a cuda device
        for name, value, allowed in (("dtype", self.dtype, tuple(DTYPES)), ("device", device_type, DEVICES),
                                     ("w4_activations", self.w4_activations, W4_ACTIVATIONS),
                                     ("draft_w4_activations", self.draft_w4_activations, DRAFT_W4_ACTIVATIONS),
                                     ("aot", self.aot, AOT_MODES)):
            if value not in allowed:
                raise SpecquantError(f"{name.replace('_', '-')} {getattr(self, name)!r} is not supported; use one "
                                     f"of {', '.join(allowed)}")
        if self.compile and self.aot == "build":
            raise SpecquantError("--compile and --aot build are two ways to compile the same step; pick one")
        if self.threads < 0:
            raise SpecquantError(f"threads {self.threads} must be 0 (torch's default) or a positive count")
        return self

    @property
    def step_aot(self) -> str:
        """The AOT mode the steps run with: compile replaces packages."""
        return "off" if self.compile else self.aot
