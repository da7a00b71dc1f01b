"""QuantConfig: the one home of weight-quantization defaults; the CLI flags are built from its fields.

Settings that belong to one algorithm live in that algorithm's own small dataclass (AWQConfig, GPTQConfig,
RTNConfig), and the algorithm is chosen by that object's type: `QuantConfig(method=AWQConfig(grid=10))`.
`QuantConfig(method="awq")` is shorthand for the method's default settings.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Union

from specquant.errors import SpecquantError, require_positive

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128, -1)  # -1: one scale per output channel (compressed-tensors strategy "channel")
HEAD_PRECISIONS = ("dense", "bf16", "w8", "w4")  # specquant.quant.head
# Activations of the 4-bit layers at run time (not a checkpoint property): float = W4A16, the checkpoint's
# arithmetic; int8 = W4A8 on the native W4A8 kernel (kernels/w4a8.py), GGUF's Q4_0 x Q8_0 and what llama.cpp runs
# on CPUs; auto = int8 where that kernel runs (a CPU with the native library), else float. auto is the default of
# targets and drafters alike (RuntimeConfig): its quality cost through the kl gate and its speed against W4A16 are
# in docs/BENCH.md ("Quantization quality"; "W4A8, the default W4 path"). A drafter only proposes, so for it the
# arithmetic can move the acceptance rate, never the output.
W4_ACTIVATIONS = ("auto", "float", "int8")
BUNDLED_CALIB = Path(__file__).resolve().parent.parent / "data" / "calib.txt"


@dataclass
class RTNConfig:
    """Round-to-nearest (quant/rtn.py): no settings of its own."""

    name: ClassVar[str] = "rtn"

    def validate(self) -> "RTNConfig":
        return self


@dataclass
class AWQConfig:
    """AWQ (quant/awq.py)."""

    name: ClassVar[str] = "awq"
    grid: int = field(default=20, metadata={"help": "AWQ: alpha grid points over [0, 1)", "flag": "--awq-grid"})
    block_samples: int = field(default=8, metadata={
        "help": "AWQ: calibration sequences scoring q/k/v scales on the attention output",
        "flag": "--awq-block-samples"})
    clip: bool = field(default=True, metadata={"help": "AWQ: per-group clipping search", "flag": "--awq-clip"})
    clip_grid: int = field(default=20, metadata={"help": "AWQ: clip shrink step = 1/awq_clip_grid",
                                                 "flag": "--awq-clip-grid"})
    clip_max_shrink: float = field(default=0.5, metadata={"help": "AWQ: largest fraction of the max cut away",
                                                          "flag": "--awq-clip-max-shrink"})

    def validate(self) -> "AWQConfig":
        require_positive(self, ("grid", "block_samples", "clip_grid"), prefix="awq ")
        if not 0.0 <= self.clip_max_shrink < 1.0:
            raise SpecquantError(f"awq clip_max_shrink={self.clip_max_shrink} must be in [0, 1)")
        return self


@dataclass
class GPTQConfig:
    """GPTQ (quant/gptq.py)."""

    name: ClassVar[str] = "gptq"
    damp: float = field(default=0.01, metadata={"help": "GPTQ: dampening, fraction of mean(diag H)",
                                                "flag": "--gptq-damp"})
    act_order: bool = field(default=False, metadata={"help": "GPTQ: process columns by descending diag(H)",
                                                     "flag": "--gptq-act-order"})
    block: int = field(default=128, metadata={"help": "GPTQ: columns per lazy-update block", "flag": "--gptq-block"})

    def validate(self) -> "GPTQConfig":
        if self.block < 1:
            raise SpecquantError(f"gptq block={self.block} must be a positive integer")
        if self.damp <= 0:
            raise SpecquantError(f"gptq damp={self.damp} must be > 0 (typical 0.01)")
        return self


MethodConfig = Union[RTNConfig, AWQConfig, GPTQConfig]
METHOD_CONFIGS: dict[str, type] = {c.name: c for c in (RTNConfig, AWQConfig, GPTQConfig)}
METHODS = tuple(METHOD_CONFIGS)


@dataclass
class QuantConfig:
    """Weight-only integer quantization of every targeted nn.Linear (W4A16 / W8A16)."""

    # the algorithm and its own settings; its flags are added by quant/cli.py (--method, --awq-*, --gptq-*)
    method: MethodConfig = field(default_factory=AWQConfig)
    bits: int = field(default=4, metadata={"help": "bits per weight", "choices": BITS})
    group_size: int = field(
        default=128,
        metadata={"help": "input channels sharing one scale; -1 = per output channel", "choices": GROUP_SIZES},
    )
    # Symmetric: codes in [-2^(b-1), 2^(b-1)-1], scale = absmax / (2^(b-1)-1), no zero point.
    # Asymmetric: same signed code range plus a signed zero point per group (compressed-tensors' convention).
    symmetric: bool = field(default=True, metadata={
        "help": "symmetric codes without zero points", "negate": "--asymmetric",
        "negate_help": "asymmetric codes with per-group zero points"})
    ignore: list[str] = field(
        default_factory=lambda: ["lm_head", "embed_tokens"],
        metadata={"help": "module-name patterns left unquantized (fnmatch; 're:' prefix = regex); a bare name "
                          "also matches as the last name component(s); a hybrid's DeltaNet in_proj_a / in_proj_b "
                          "stay dense whatever this says (quant.pipeline.DENSE_BY_KIND)", "metavar": "PATTERN"},
    )
    lm_head: str = field(
        default="dense",
        metadata={"help": "lm_head precision: dense (as the checkpoint), bf16, w8 (RTN per channel) or w4 (RTN "
                          "g32); overrides 'lm_head' in --ignore; KL/top-1 of each: docs/BENCH.md",
                  "choices": HEAD_PRECISIONS},
    )
    calib: str | None = field(default=None, metadata={"help": "calibration text file (default: bundled calib.txt)"})
    calib_samples: int = field(default=64, metadata={"help": "calibration sequences (AWQ/GPTQ; their calibration "
                                                              "forwards grow linearly with it)"})
    report_samples: int = field(default=0, metadata={"help": "RTN: calibration sequences run only to report "
                                                              "per-layer output errors (0: weight SQNR only; each "
                                                              "one costs about 4 forwards of --seq-len tokens)"})
    seq_len: int = field(default=256, metadata={"help": "tokens per calibration sequence"})
    seed: int = field(default=0, metadata={"help": "seed for token subsampling"})
    # Target-side vocabulary pruning (specquant/quant/prune_vocab.py): lossy, so opt-in and gated (specquant gate
    # --tasks kl). 0 keeps the whole vocabulary.
    prune_vocab: int = field(default=0, metadata={
        "help": "keep only token ids < N plus the tokenizer's special tokens: embedding, lm_head and tokenizer "
                "cut, the map in config.json (pruned_vocab); LOSSY: gate it with specquant gate --tasks kl "
                "(0: keep every id)", "metavar": "N"})

    def __post_init__(self):
        if self.group_size is None:
            self.group_size = -1
        if isinstance(self.method, str) and self.method in METHOD_CONFIGS:
            self.method = METHOD_CONFIGS[self.method]()  # shorthand: the method's default settings

    @property
    def method_name(self) -> str:
        return self.method.name

    def validate(self) -> "QuantConfig":
        """Check every field that does not depend on the model; raises SpecquantError."""
        if not isinstance(self.method, tuple(METHOD_CONFIGS.values())):
            raise SpecquantError(f"unknown quantization method {self.method!r}; use one of {', '.join(METHODS)}")
        if self.bits not in BITS:
            raise SpecquantError(f"bits={self.bits} is not supported; use 4 or 8 (--bits 4|8)")
        if self.group_size not in GROUP_SIZES:
            raise SpecquantError(
                f"group_size={self.group_size} is not supported; use one of 32, 64, 128 or -1 (per channel)"
            )
        if self.lm_head not in HEAD_PRECISIONS:
            raise SpecquantError(f"lm_head={self.lm_head!r} is not supported; use one of {', '.join(HEAD_PRECISIONS)}")
        if self.report_samples < 0:
            raise SpecquantError(f"report_samples={self.report_samples} must be >= 0 (0 skips the output-error report)")
        require_positive(self, ("calib_samples", "seq_len"))
        if self.prune_vocab < 0:
            raise SpecquantError(f"prune_vocab={self.prune_vocab} must be >= 0 (0 keeps the whole vocabulary; e.g. "
                                 "--prune-vocab 131072)")
        self.method.validate()
        if not isinstance(self.method, RTNConfig) or self.calib:
            self.calib_path()
        return self

    def calib_path(self) -> Path:
        path = Path(self.calib).expanduser() if self.calib else BUNDLED_CALIB
        if not path.is_file():
            raise SpecquantError(f"calibration file {str(path)!r} does not exist; pass an existing text file (--calib)")
        return path

    def group_for(self, name: str, in_features: int) -> int:
        """The group size for a layer: in_features when per-channel; raises if it does not divide in_features."""
        if self.group_size == -1:
            return in_features
        if in_features % self.group_size:
            divisors = [g for g in (32, 64, 128) if in_features % g == 0]
            hint = f"use --group-size {divisors[-1]}" if divisors else "use --group-size -1 (per channel)"
            raise SpecquantError(
                f"group_size={self.group_size} does not divide {name}.in_features={in_features}; {hint}, or add "
                f"{name!r} to --ignore"
            )
        if (in_features * self.bits) % 32:
            raise SpecquantError(f"{name}.in_features={in_features} cannot be packed into int32 at {self.bits} bits")
        return self.group_size

    def to_json(self) -> dict:
        """{"method": name, <common fields>, name: {the method's own settings}}."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "method"}
        d["ignore"] = list(self.ignore)
        d["method"] = self.method.name
        d[self.method.name] = dataclasses.asdict(self.method)
        return d

    @classmethod
    def from_json(cls, d: dict | str, strict: bool = True) -> "QuantConfig":
        """From to_json's dict (or its JSON text). Sections for other methods are ignored (one overrides dict may
        serve several methods); strict=False also drops fields this version does not know."""
        if isinstance(d, str):
            d = json.loads(d)
        d = dict(d)
        name = d.pop("method", "awq")
        if name not in METHOD_CONFIGS:
            raise SpecquantError(f"unknown quantization method {name!r}; use one of {', '.join(METHODS)}")
        sections = {n: d.pop(n) for n in METHODS if n in d}
        settings = _known(METHOD_CONFIGS[name], sections.get(name) or {}, strict, f"{name} setting")
        common = _known(cls, d, strict, "QuantConfig field", skip=("method",))
        return cls(method=METHOD_CONFIGS[name](**settings), **common)


def _known(cls, d: dict, strict: bool, what: str, skip=()) -> dict:
    known = {f.name for f in dataclasses.fields(cls)} - set(skip)
    unknown = sorted(set(d) - known)
    if unknown and strict:
        raise SpecquantError(f"unknown {what}(s) {unknown}; known: {', '.join(sorted(known))}")
    return {k: v for k, v in d.items() if k in known}
