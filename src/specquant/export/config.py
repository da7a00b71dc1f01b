"""ExportConfig: the one home of export defaults (`specquant export` builds its flags from these fields)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specquant.errors import SpecquantError
from specquant.spec_decode.config import SpecConfig

ENGINES = ("vllm", "llama.cpp")
DENSE_DTYPES = ("f32", "f16", "bf16")
INEXACT_POLICIES = ("error", "warn")
REPORT = "specquant-export.json"  # the export's report, written into every export directory


@dataclass
class ExportConfig:
    engine: str = field(default="llama.cpp", metadata={"choices": ENGINES})  # the CLI makes --for required
    # GGUF type of every tensor that is not one of our W4/W8 Linears (embeddings, dense Linears); norms and biases
    # stay F32 whatever this says, as llama.cpp's own converter keeps them.
    dense_dtype: str = field(default="f32", metadata={
        "choices": DENSE_DTYPES, "help": "GGUF type of unquantized matrices (norms and biases stay F32)"})
    # A quantized group whose value d·(q-8) cannot be written exactly in GGUF (its scale, or Q4_1's offset, is not
    # an fp16 number): "error" refuses the export, "warn" writes the nearest fp16 and reports the error per tensor.
    inexact: str = field(default="error", metadata={
        "choices": INEXACT_POLICIES,
        "help": "a quantized scale fp16 cannot hold exactly: refuse, or warn with the error"})
    # draft tokens per verify step in the printed engine command lines; our engine's default k
    num_speculative_tokens: int = field(default=SpecConfig.draft_len, metadata={
        "help": "draft tokens per verify step in the printed command lines"})
    # tensor-parallel size the printed vLLM command line uses (checked against heads / KV heads)
    tensor_parallel_size: int = field(default=1, metadata={
        "help": "vLLM tensor-parallel size (checked against heads / KV heads)"})
    # context the printed llama.cpp command lines ask for (0 = the model's max_position_embeddings)
    ctx_size: int = field(default=0, metadata={
        "help": "context for the printed command lines; 0 = the model's max_position_embeddings"})

    def validate(self) -> "ExportConfig":
        for name, allowed in (("engine", ENGINES), ("dense_dtype", DENSE_DTYPES), ("inexact", INEXACT_POLICIES)):
            if getattr(self, name) not in allowed:
                raise SpecquantError(f"{name}={getattr(self, name)!r} is not supported; use one of "
                                     f"{', '.join(allowed)}")
        if self.num_speculative_tokens < 1:
            raise SpecquantError(f"num_speculative_tokens={self.num_speculative_tokens} must be >= 1")
        if self.tensor_parallel_size < 1:
            raise SpecquantError(f"tensor_parallel_size={self.tensor_parallel_size} must be >= 1")
        if self.ctx_size < 0:
            raise SpecquantError(f"ctx_size={self.ctx_size} must be >= 0 (0 = the model's context length)")
        return self


def check_out(out, overwrite: bool):
    """An existing --out is replaced only with --overwrite and only when an earlier export made it (stricter than
    util.files: --overwrite never lets an export replace a directory specquant did not write)."""
    from specquant.util.files import MARKER, check_out_dir

    out = check_out_dir(out, overwrite=True)  # not a file, writable; the rule on existing contents follows
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise SpecquantError(f"--out {str(out)!r} already exists; pass --overwrite to replace an earlier export "
                                 "or choose a new directory")
        if not (out / REPORT).is_file() or not (out / MARKER).exists():
            raise SpecquantError(f"--out {str(out)!r} exists and was not written by `specquant export` (no {REPORT}); "
                                 "refusing to replace it: choose a new directory")


def write_marker(tmp, report: dict):
    import json
    from pathlib import Path

    (Path(tmp) / REPORT).write_text(json.dumps(report, indent=2, default=float) + "\n")
