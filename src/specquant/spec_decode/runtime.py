"""RuntimeConfig: how an engine runs (dtype, device, W4 activations, compiled steps, threads), shared by `generate`,
`bench` and the gates. Its own module, away from SpecConfig: it names quant/'s activation modes, and importing
quant/ pulls in torch's compiler, which a process that only loads AOT packages must not pay (decode/aot.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specquant.decode.aot import AOT_MODES
from specquant.errors import SpecquantError
from specquant.quant.config import W4_ACTIVATIONS
from specquant.util.device import DEVICES
from specquant.util.dtypes import DTYPES


@dataclass
class RuntimeConfig:
    """How an engine runs its models (not what it computes: every setting keeps greedy speculative decoding
    exact against the same target). Each command exposes its share as flags (util/flags.py `fields`)."""

    dtype: str = field(default="float32", metadata={"help": "dtype of the models' weights and activations",
                                                    "choices": tuple(DTYPES)})
    device: str = field(default="cpu", metadata={"help": "device to run on", "choices": DEVICES})
    w4_activations: str = field(default="auto", metadata={
        "help": "a W4 target's activations: auto (int8 where the W4A8 kernel runs, as llama.cpp's Q4_0 x Q8_0 on "
                "CPUs; float elsewhere), float (W4A16, the checkpoint's arithmetic) or int8 (W4A8; kl gate and "
                "speed in docs/BENCH.md)", "choices": W4_ACTIVATIONS})
    draft_w4_activations: str = field(default="auto", metadata={
        "help": "a W4 drafter's activations: auto (int8 where the W4A8 kernel runs: a drafter only proposes, so "
                "only acceptance can change), float or int8", "choices": W4_ACTIVATIONS})
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
                                     ("draft_w4_activations", self.draft_w4_activations, W4_ACTIVATIONS),
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
