"""Tiny teacher / W4 student checkpoints for the QAD, trainer and regen tests (imported by tests/test_qad*.py).

They use the bundled tokenizer (vocab 8192), so the real data paths (calibration text, held-out text, regen
prompts) run unchanged, with 2 layers of width 64 so a training step takes milliseconds.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import torch

from specquant.model.checkpoint import BUNDLED_DIR, save_model
from specquant.model.config import ModelConfig
from specquant.model.decoder import Transformer
from specquant.quant import QuantConfig, quantize, save_quantized

TOKENIZER = BUNDLED_DIR / "tiny-target"
ROOT = Path(__file__).resolve().parent.parent


def tiny_lm(seed: int = 0, **overrides) -> Transformer:
    """A random Qwen3-layout LM over the bundled vocabulary; weights at trained-model scale (peaked logits)."""
    kw = dict(model_type="qwen3", vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, qk_norm=True, tie_word_embeddings=True,
              eos_token_id=0, max_position_embeddings=512)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                std = 1.0 if "embed" in name else 1 / math.sqrt(p.shape[1])
                p.normal_(0, std)
    return model


# a Qwen3.5 hybrid of the same size: one Gated DeltaNet layer (key heads != value heads), then gated attention
HYBRID = dict(model_type="qwen3_5_text", layer_types=("linear_attention", "full_attention"), attn_output_gate=True,
              zero_centred_norms=True, partial_rotary_factor=0.25, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
ARCHS = {"dense": {}, "hybrid": HYBRID}


def write_teacher(path: Path, seed: int = 0, arch: str = "dense", **overrides) -> Path:
    save_model(tiny_lm(seed, **{**ARCHS[arch], **overrides}), path, tokenizer_from=TOKENIZER)
    return path


def write_student(teacher: Path, path: Path, group_size: int = 32) -> Path:
    """RTN W4 of the teacher (no calibration needed), bf16 scales as `specquant quantize` writes by default."""
    from specquant.loader import load_model

    model = load_model(teacher)
    quantize(model, QuantConfig(method="rtn", group_size=group_size), scale_dtype=torch.bfloat16)
    model.to(torch.bfloat16)
    save_quantized(model, path, tokenizer_from=teacher)
    return path


def write_pair(root: Path, arch: str = "dense", **overrides) -> tuple[Path, Path]:
    """root/teacher (a tiny trained-shape LM of arch, ARCHS) and root/student (its RTN W4): the distillation tests'
    pair."""
    teacher = write_teacher(root / "teacher", arch=arch, **overrides)
    return teacher, write_student(teacher, root / "student")


def run_cli(args: list[str], **kw) -> subprocess.CompletedProcess:
    """`python -m specquant.cli ARGS` in a subprocess with one thread (the tests are timing-insensitive)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "specquant.cli", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, **kw)


def distill_args(pair: tuple[Path, Path], out: Path, *flags) -> list[str]:
    """`specquant distill target` on a (teacher, student) pair into out, with flags."""
    return ["distill", "target", "--teacher", str(pair[0]), "--student", str(pair[1]), "--out", str(out), *flags]


def run_in_process(args: list[str]) -> None:
    """The CLI in this process, on one thread like the subprocesses (so results can be compared bit for bit)."""
    from specquant.cli import main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(args) == 0
    finally:
        torch.set_num_threads(threads)
