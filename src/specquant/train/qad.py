"""Grid-preserving quantization-aware distillation (QAD) of a W4 checkpoint toward its high-precision self.

The grid is the served one. Every QuantLinear of the student becomes a FakeQuantLinear that keeps the checkpoint's
scales (and zero points) as frozen buffers and trains a latent float weight, initialised at the dequantized codes,
so step 0 is exactly the loaded checkpoint. The forward uses fake_quant(latent) from specquant.quant.grid (the
same rounding quantize() uses) with a straight-through estimator: d fake_quant / d latent := 1. Export rounds the
latent weights onto that same grid, `codes = quantize_codes(latent, scale, zero)`, so the written codes dequantize
to exactly the weights the last training forward used (tests/test_qad.py asserts zero difference), and nothing is
re-observed or re-quantized off the grid.

The loss is the per-token forward KL(teacher || student) at T = 1 over the full vocabulary, averaged over every
position. The student's lm_head is applied to `kl_chunk` positions at a time under activation checkpointing, so
[batch, seq_len, vocab] logits never exist for the student or the teacher. The teacher runs under no_grad.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from specquant.errors import SpecquantError
from specquant.model.checkpoint import read_hf_config, resolve, save_model
from specquant.model.config import HYBRID_FIELDS, ModelConfig
from specquant.model.decoder import RMSNorm, Transformer
from specquant.model.norms import GatedRMSNorm, ZeroCentredRMSNorm
from specquant.quant.grid import dequantize, fake_quant, quantize_codes
from specquant.quant.linear import QuantLinear
from specquant.quant.pack import pack_codes
from specquant.quant.quality import compare, logprobs
from specquant.train.config import QADConfig
from specquant.util.dtypes import DTYPES

BUNDLED_HELDOUT = Path(__file__).resolve().parent.parent / "data" / "heldout.txt"


class _FakeQuantSTE(torch.autograd.Function):
    """fake_quant in the forward, identity in the backward (straight-through). A custom Function rather than the
    `w + (fq - w).detach()` idiom, whose float sum can differ from fq by an ulp: the forward must use exactly
    the weights the export writes."""

    @staticmethod
    def forward(ctx, latent, scale, zero, bits, group_size):
        return fake_quant(latent, scale, zero, bits, group_size).to(scale.dtype).to(latent.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None, None


class FakeQuantLinear(nn.Module):
    """A trainable latent weight [out, in] on a frozen grid: scale [out, groups], zero int8 [out, groups] | None."""

    def __init__(self, q: QuantLinear):
        super().__init__()
        self.in_features, self.out_features = q.in_features, q.out_features
        self.bits, self.group_size = q.bits, q.group_size
        self.register_buffer("scale", q.weight_scale.detach().clone())
        zero = q.zero_point()
        self.register_buffer("zero", None if zero is None else zero.clone())
        self.weight = nn.Parameter(q.dequantized_weight().to(torch.float32))  # step 0 == the checkpoint's weights
        self.bias = None if q.bias is None else nn.Parameter(q.bias.detach().clone(), requires_grad=False)

    def fake_quant_weight(self) -> torch.Tensor:
        """The weight the forward uses: the latent weight rounded onto the frozen grid ([out, in], scale dtype)."""
        return fake_quant(self.weight, self.scale, self.zero, self.bits, self.group_size).to(self.scale.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = _FakeQuantSTE.apply(self.weight, self.scale, self.zero, self.bits, self.group_size)
        return F.linear(x, w.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def codes(self, latent: torch.Tensor | None = None) -> torch.Tensor:
        """Integer codes int8 [out, in] of the latent weight (or of `latent`) on the frozen grid."""
        return quantize_codes(self.weight.detach() if latent is None else latent, self.scale, self.zero, self.bits)


def to_fake_quant(model: Transformer) -> list[str]:
    """Swap every QuantLinear of model for a FakeQuantLinear in place; returns their names."""
    names = [n for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    for name in names:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, FakeQuantLinear(model.get_submodule(name)))
    return names


NORMS = (RMSNorm, ZeroCentredRMSNorm, GatedRMSNorm)  # every norm kind a decoder layer holds (model/norms.py)


def set_trainable(model: Transformer, cfg: QADConfig) -> list[str]:
    """Latent weights of the fake-quant Linears train; norms / embeddings only when cfg says so. Everything else
    stays frozen: the Linears the checkpoint keeps dense (a hybrid's in_proj_a / in_proj_b) and Gated DeltaNet's
    conv1d, A_log and dt_bias, which the grid does not cover. Returns the trained parameters' names."""
    set_trainable_part(model, cfg.train_norms)
    if cfg.train_embeddings:
        model.model.embed_tokens.weight.requires_grad_(True)
        model.lm_head.weight.requires_grad_(True)  # the same tensor when tied
    return [n for n, p in model.named_parameters() if p.requires_grad]


def set_trainable_part(module: nn.Module, train_norms: bool) -> list[str]:
    """set_trainable's rule for any part of a model (lean QAD trains one decoder layer): latent weights train,
    norms when train_norms, nothing else."""
    for p in module.parameters():
        p.requires_grad_(False)
    for m in module.modules():
        if isinstance(m, FakeQuantLinear):
            m.weight.requires_grad_(True)
        elif isinstance(m, NORMS) and train_norms:
            m.weight.requires_grad_(True)
    return [n for n, p in module.named_parameters() if p.requires_grad]


# --- loss -----------------------------------------------------------------------------------------------------


def _chunk_kl_sum(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor, student_head: nn.Module,
                  teacher_head: nn.Module) -> torch.Tensor:
    """Σ over positions of KL(teacher || student) for hidden states [b, c, hidden] (one chunk)."""
    with torch.no_grad():
        teacher_logp = F.log_softmax(teacher_head(teacher_hidden).float(), dim=-1)  # [b, c, vocab]
    student_logp = F.log_softmax(student_head(student_hidden).float(), dim=-1)
    return (teacher_logp.exp() * (teacher_logp - student_logp)).sum()


def chunked_kl(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor, student_head: nn.Module,
               teacher_head: nn.Module, chunk: int) -> torch.Tensor:
    """Mean per-token KL(teacher || student) over hidden states [b, T, hidden], `chunk` positions at a time.

    Each chunk runs under activation checkpointing: its logits are freed after the forward and recomputed in the
    backward, so peak memory holds one chunk's [b, chunk, vocab], whatever T is."""
    b, t, _ = student_hidden.shape
    total = student_hidden.new_zeros((), dtype=torch.float32)
    for i in range(0, t, chunk):
        s, th = student_hidden[:, i : i + chunk], teacher_hidden[:, i : i + chunk]
        if torch.is_grad_enabled() and s.requires_grad and t > chunk:  # one chunk: nothing to save, no recompute
            total = total + checkpoint(_chunk_kl_sum, s, th, student_head, teacher_head, use_reentrant=False)
        else:
            total = total + _chunk_kl_sum(s, th, student_head, teacher_head)
    return total / (b * t)


class KLStudent(nn.Module):
    """forward(tokens [b, T]) -> (mean KL(teacher || student), stats). The teacher is held outside the module tree,
    so DDP / FSDP wrap the student only."""

    def __init__(self, student: Transformer, teacher: Transformer, kl_chunk: int):
        super().__init__()
        self.student = student
        self.kl_chunk = kl_chunk
        object.__setattr__(self, "_teacher", teacher)  # not a registered submodule on purpose

    def forward(self, tokens: torch.Tensor, logits_only: bool = False):
        if logits_only:  # evaluation enters here too, so FSDP has gathered the parameters
            return self.student(tokens)
        with torch.no_grad():
            teacher_hidden = self._teacher(tokens, hidden_only=True)
        student_hidden = self.student(tokens, hidden_only=True)
        kl = chunked_kl(student_hidden, teacher_hidden, self.student.lm_head, self._teacher.lm_head, self.kl_chunk)
        return kl, {"kl": kl.detach()}


# --- checks ---------------------------------------------------------------------------------------------------

# ModelConfig fields teacher and student must share (a hybrid's layer pattern and DeltaNet shape included)
ARCH_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings", "layer_types",
               "partial_rotary_factor", *HYBRID_FIELDS)


def check_pair(teacher_dir: Path, student_dir: Path) -> tuple[dict, dict]:
    """Validate the teacher / student checkpoints before anything is loaded; returns their config.json dicts."""
    t_hf, s_hf = read_hf_config(teacher_dir), read_hf_config(student_dir)
    if not s_hf.get("quantization_config"):
        raise SpecquantError(f"student {str(student_dir)!r} is not quantized (no quantization_config); pass the "
                             "output of `specquant quantize` as --student")
    if t_hf.get("quantization_config"):
        raise SpecquantError(f"teacher {str(teacher_dir)!r} is quantized; pass the high-precision checkpoint the "
                             "student was quantized from as --teacher")
    # compared as parsed, so spellings of one architecture (layer_types written out or implied) are equal
    t_cfg, s_cfg = ModelConfig.from_hf(t_hf), ModelConfig.from_hf(s_hf)
    diff = {f: (getattr(t_cfg, f), getattr(s_cfg, f)) for f in ARCH_FIELDS if getattr(t_cfg, f) != getattr(s_cfg, f)}
    if diff:
        pairs = ", ".join(f"{k}: teacher {a} vs student {b}" for k, (a, b) in diff.items())
        raise SpecquantError(f"teacher and student differ in architecture ({pairs}); the student must be the "
                             "teacher quantized")
    return t_hf, s_hf


def fingerprint(model_dir: Path) -> str:
    """sha256 over the checkpoint's safetensors files (sorted by name): which weights produced a result."""
    h = hashlib.sha256()
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        h.update(f.name.encode())
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


# --- export ---------------------------------------------------------------------------------------------------


def export_tensors(student: Transformer, state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict:
    """The compressed-tensors state dict of the student, from its full state dict `state` (latent weights rounded
    onto the frozen grid; every other tensor cast to dtype)."""
    out = grid_export(student, state, dtype)
    if student.config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def grid_export(module: nn.Module, state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict:
    """export_tensors for any module (a whole student, or one decoder layer in lean QAD): its FakeQuantLinears'
    latent weights in `state` as packed codes on their frozen grid with the unchanged scales, every other tensor of
    `state` cast to dtype; names as in `state`."""
    out: dict[str, torch.Tensor] = {}
    fq = {n: m for n, m in module.named_modules() if isinstance(m, FakeQuantLinear)}
    for name, t in state.items():
        if name.rpartition(".")[0] in fq:
            continue
        out[name] = t.detach().to(dtype) if t.is_floating_point() else t.detach()
    for name, m in fq.items():
        prefix = f"{name}." if name else ""
        latent = state[f"{prefix}weight"].detach().to(m.weight.device)
        scale = m.scale.to(dtype)
        assert torch.equal(scale.to(m.scale.dtype), m.scale), f"{name}: scales do not survive the {dtype} round trip"
        out[f"{prefix}weight_packed"] = pack_codes(m.codes(latent), m.bits)
        out[f"{prefix}weight_scale"] = scale
        out[f"{prefix}weight_shape"] = torch.tensor([m.out_features, m.in_features], dtype=torch.int64)
        if m.zero is not None:
            out[f"{prefix}weight_zero_point"] = pack_codes(m.zero, m.bits, dim=0)
        if m.bias is not None:
            out[f"{prefix}bias"] = state[f"{prefix}bias"].detach().to(dtype)
    return {k: v.cpu().contiguous() for k, v in out.items()}


def exported_weight(m: FakeQuantLinear, latent: torch.Tensor) -> torch.Tensor:
    """What a loader reconstructs from the exported codes (for the zero-difference test)."""
    return dequantize(m.codes(latent), m.scale, m.zero)


# The teacher is frozen and the held-out tokens fixed, so its log-probabilities are the same at every evaluation:
# computed once and kept when they fit this many bytes (the bundled target's 8 x 256 positions: 64 MiB), else
# computed again each time (a large vocabulary over many samples would not fit)
TEACHER_CACHE_BYTES = 512 << 20


class QADTask:
    """The trainer's task for `specquant distill target` (see train/trainer.py for the protocol)."""

    best_key = "kl"

    def __init__(self, teacher: Transformer, student: Transformer, eval_tokens: torch.Tensor, cfg: QADConfig,
                 student_dir: Path, student_hf: dict, run_meta: dict):
        self.teacher, self.student, self.cfg = teacher.eval(), student, cfg
        self.eval_tokens = eval_tokens  # [samples, eval_seq_len]
        self.student_dir, self.student_hf, self.run_meta = student_dir, student_hf, run_meta
        self.module = KLStudent(student, teacher, cfg.kl_chunk)
        self.fsdp_units = list(student.model.layers)
        self._teacher_logprobs = None  # logprobs(teacher, eval_tokens), on the first evaluate (TEACHER_CACHE_BYTES)

    def evaluate(self) -> dict:
        """KL to the teacher, perplexity, top-1 agreement on held-out text (specquant.quant.quality.compare)."""
        device = next(self.teacher.parameters()).device
        tokens = self.eval_tokens.to(device)
        reference = self.teacher
        if tokens.numel() * self.teacher.config.vocab_size * 4 <= TEACHER_CACHE_BYTES:
            if self._teacher_logprobs is None:
                self._teacher_logprobs = logprobs(self.teacher, tokens)
            reference = self._teacher_logprobs
        r = compare(reference, lambda batch: self.module(batch, logits_only=True), tokens)
        return {k: r[k] for k in ("kl", "kl_sem", "ppl", "ppl_ref", "top1_agree", "samples")}

    def check_start(self, metrics: dict) -> None:
        if metrics["kl"] > self.cfg.max_start_kl:
            raise SpecquantError(
                f"step-0 held-out KL(teacher || student) is {metrics['kl']:.4f} > --max-start-kl "
                f"{self.cfg.max_start_kl}; the student is not a quantization of this teacher or its grid is broken "
                "(re-quantize the teacher, or raise --max-start-kl if this gap is expected)")

    def export(self, out_dir: Path, state: dict[str, torch.Tensor]) -> None:
        """Write the student as a compressed-tensors pack-quantized checkpoint, atomically, in its original dtype.
        state: KLStudent's full state dict (keys "student.<name>")."""
        dtype_name = self.student_hf.get("torch_dtype") or "float32"
        student_state = {k.removeprefix("student."): v for k, v in state.items()}
        tensors = export_tensors(self.student, student_state, DTYPES[dtype_name])
        extra = {"torch_dtype": dtype_name, "quantization_config": self.student_hf["quantization_config"],
                 "specquant_qad": self.run_meta}
        save_model(self.student, out_dir, tokenizer_from=self.student_dir, extra_config=extra, tensors=tensors)


def load_pair(teacher: str, student: str, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """(teacher model, fake-quant student, teacher dir, student dir, student config.json) after check_pair."""
    from specquant.loader import load_model

    t_dir, s_dir = resolve(teacher), resolve(student)
    if t_dir.resolve() == s_dir.resolve():
        raise SpecquantError("--teacher and --student are the same checkpoint; the student must be the quantized one")
    _, s_hf = check_pair(t_dir, s_dir)
    t_model = load_model(t_dir, dtype=dtype, device=device)
    s_model = load_model(s_dir, dtype=dtype, device=device)
    if not to_fake_quant(s_model):
        raise SpecquantError(f"student {str(s_dir)!r} holds no quantized Linear; pass a `specquant quantize` output")
    for p in t_model.parameters():
        p.requires_grad_(False)
    return t_model, s_model, t_dir, s_dir, s_hf


def text_inputs(qad: QADConfig, data: str | None) -> tuple[Path, Path]:
    """(held-out text, training data) after the checks every QAD mode makes before --out is touched."""
    from specquant.quant.config import BUNDLED_CALIB

    heldout = Path(qad.heldout).expanduser() if qad.heldout else BUNDLED_HELDOUT
    data_path = Path(data).expanduser() if data else BUNDLED_CALIB
    if not heldout.is_file():
        raise SpecquantError(f"held-out text {str(heldout)!r} does not exist; pass a text file (--heldout)")
    if data_path.exists() and data_path.resolve() == heldout.resolve():
        raise SpecquantError(f"--data {str(data_path)!r} is the held-out evaluation text; train on other text")
    return heldout, data_path


# --- the run --------------------------------------------------------------------------------------------------


def run_qad(teacher: str, student: str, out, train, qad: QADConfig, data: str | None = None, resume: bool = False,
            overwrite: bool = False, device: str = "cpu", dtype: str = "float32", progress: bool = True) -> dict | None:
    """`specquant distill target` as a function. Every input is checked before --out is touched. Returns the
    result dict on rank 0 (None on other ranks)."""
    from specquant.model.checkpoint import load_tokenizer
    from specquant.quant.quality import heldout_tokens
    from specquant.train.outdir import clear_our_outputs, prepare_out
    from specquant.train.data import BlockOrder, load_blocks
    from specquant.train.trainer import Trainer, setup_distributed

    out = Path(out).expanduser()
    resuming = prepare_out(out, resume, overwrite)
    heldout, data_path = text_inputs(qad, data)
    rank, world, dev = setup_distributed(device)
    t_model, s_model, t_dir, s_dir, s_hf = load_pair(teacher, student, str(dev), DTYPES[dtype])
    tokenizer = load_tokenizer(s_dir)
    blocks = load_blocks(data_path, tokenizer, train.seq_len, s_model.config.vocab_size)
    eval_tokens = heldout_tokens(tokenizer, heldout, qad.eval_samples, qad.eval_seq_len)
    names = set_trainable(s_model, qad)
    meta = {"teacher": str(t_dir), "teacher_sha256": fingerprint(t_dir), "student": str(s_dir),
            "student_sha256": fingerprint(s_dir), "data": str(data_path), "heldout": str(heldout),
            "train": train.to_json(), "qad": qad.to_json(), "trained_tensors": len(names)}
    task = QADTask(t_model, s_model, eval_tokens, qad, s_dir, s_hf, meta)
    if overwrite and not resuming and rank == 0 and out.exists():
        clear_our_outputs(out)
    trainer = Trainer(task, BlockOrder(blocks, train.seed), train, out, device=dev, progress=progress,
                      run_info={k: meta[k] for k in ("teacher", "student", "data", "heldout")})
    result = trainer.fit(resume=resuming)
    if rank != 0:
        return None
    evals = [json.loads(ln) for ln in (out / "log.jsonl").read_text().splitlines() if '"eval"' in ln]
    evals = [e for e in evals if e.get("event") == "eval"]
    start = next(e for e in evals if e["step"] == 0)
    best = next(e for e in reversed(evals) if e["step"] == result["best"]["step"])
    return {**result, "start_eval": start, "best_eval": best, "model": str(out / "model"),
            "log": str(out / "log.jsonl"), "train_blocks": len(blocks), "eval_samples": len(eval_tokens)}
