"""Lean QAD: train/qad.py's grid-preserving distillation one decoder block at a time, so memory holds one block and
never the model (`specquant distill target --lean`).

The order of work (the block-wise phase of EfficientQAT, on our frozen grid):

0. Gate. The held-out tokens stream through teacher and untrained student layer by layer (each layer's tensors read
   from its safetensors file, used, dropped); the step-0 held-out KL comes from the final hidden states. Above
   --max-start-kl the run refuses before writing anything, as full QAD does.
1. The training pool, the rows full QAD would read (steps x batch x grad_accum samples of the same data order, so
   both modes see the same tokens), is embedded by each model's own embedding.
2. Block i. The teacher's block i maps its inputs to the targets (no_grad), then is dropped. The student's block i,
   its QuantLinears as FakeQuantLinear (latent weights on the frozen grid, STE; train/qad.py), trains on its own
   inputs, the outputs of the blocks trained before it (so later blocks make up for earlier rounding), to minimize
   the mean squared error to the teacher's block outputs, in the shared loop (train/trainer.py: AdamW, cosine,
   clipping, checkpoints, resume) over sample indices. The block's best step by held-out MSE is exported as its
   compressed-tensors tensors (codes packed, scales unchanged), and the block rebuilt from exactly those tensors
   maps the student's activations on to block i + 1.
3. After the last block: the held-out KL from the final hidden states (quant/quality.compare_rows) and the W4
   checkpoint, the student's tensors with every block's replaced by its exported ones. What is written is what
   the propagation and the final evaluation ran (tests/test_qad_lean.py: zero difference, and the KL of the
   written checkpoint loaded by load_model equals the streamed one).

Memory: one teacher block and one student block with its latent weights, gradients and AdamW moments, the
activations of the pool and of the held-out set (samples x seq_len x hidden, fp32, a few tensors), and the
embedding / head at the two ends; docs/QAD.md has the arithmetic. Activation checkpointing would not help inside
one block: its backward needs the block's activations once, which is what it holds.

Resume: out/lean/state.json names the next block and out/lean/acts-NNN.safetensors holds the activations entering
it (activations written first, both atomically); a block's own run resumes from its checkpoints
(out/lean/blocks/layer-NNN, the shared loop's format). A SIGKILL anywhere resumes to the same result.
"""

from __future__ import annotations

import copy
import json
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from specquant.errors import SpecquantError
from specquant.model.checkpoint import TensorReader, load_submodule, read_hf_config, resolve, save_model
from specquant.model.config import ModelConfig
from specquant.model.decoder import Transformer
from specquant.model.rope import rope_tables
from specquant.quant.checkpoint import quantized_skeleton
from specquant.quant.linear import QuantLinear
from specquant.quant.quality import compare_rows
from specquant.train.config import LeanConfig, QADConfig, TrainConfig
from specquant.train.qad import (FakeQuantLinear, check_pair, fingerprint, grid_export, set_trainable_part,
                                 text_inputs, to_fake_quant)
from specquant.util.dtypes import DTYPES
from specquant.util.files import atomic_dir, atomic_write, claim_out_dir

STATE = "state.json"


# --- one model, one part at a time ----------------------------------------------------------------------------


class Streamed:
    """A checkpoint as a meta-device skeleton plus its tensor files: part(name) materializes one submodule
    (a decoder layer, the final norm, the head) with its tensors, and nothing else is in memory."""

    def __init__(self, path: Path, hf: dict, dtype: torch.dtype, device, fake_quant: bool):
        self.path, self.dtype, self.device, self.fake_quant = path, dtype, device, fake_quant
        self.stored_dtype = DTYPES[hf.get("torch_dtype") or "float32"]  # what an export writes floats in
        self.reader = TensorReader(path)
        if hf.get("quantization_config"):
            self.skeleton = quantized_skeleton(hf, dtype)
        else:
            with torch.device("meta"):
                self.skeleton = Transformer(ModelConfig.from_hf(hf))
        self.config = self.skeleton.config

    def part(self, name: str, tensors: dict[str, torch.Tensor] | None = None) -> nn.Module:
        """Submodule `name` on device, filled from the checkpoint (or from `tensors`, names relative to it); its
        QuantLinears become FakeQuantLinear when fake_quant (step 0 == the checkpoint's weights)."""
        module = copy.deepcopy(self.skeleton.get_submodule(name))
        if tensors is None:
            tensors = self.reader.under(f"{name}.")
            if name == "lm_head" and self.config.tie_word_embeddings:
                tensors = {"weight": self.reader.get("model.embed_tokens.weight")}
        load_submodule(module, tensors, self.device, self.dtype)
        for m in module.modules():
            if isinstance(m, QuantLinear):
                m.invalidate()
        if self.fake_quant and isinstance(module, QuantLinear):  # a quantized head on its own
            return FakeQuantLinear(module).eval()
        if self.fake_quant:
            to_fake_quant(module)
        return module.eval()

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Embedding rows of tokens [n, T] -> [n, T, hidden] in dtype (the table is read, indexed and dropped)."""
        table = self.reader.get("model.embed_tokens.weight")
        return table[tokens].to(self.device, self.dtype)


def layer_forward(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """One decoder layer on x [b, T, hidden] at positions 0..T-1, as Transformer.forward runs it without a cache."""
    t = x.shape[1]
    cfg = layer._lean_config
    cos, sin = rope_tables(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings, t)
    cos, sin = cos.to(x.device, x.dtype), sin.to(x.device, x.dtype)
    plan = getattr(layer.mixer, "plan", None)
    return layer(x, cos, sin, 0, None, None if plan is None else plan(0, t, x.dtype, x.device))


def _layer(model: Streamed, i: int, tensors=None) -> nn.Module:
    layer = model.part(f"model.layers.{i}", tensors)
    layer._lean_config = model.config  # rope_tables' arguments; not a submodule, not in the state dict
    return layer


@torch.no_grad()
def map_rows(fn, x: torch.Tensor, batch: int) -> torch.Tensor:
    """fn over x [n, T, hidden] in batches of `batch` rows."""
    return torch.cat([fn(x[i : i + batch]) for i in range(0, len(x), batch)])


@torch.no_grad()
def head_eval(teacher: Streamed, student: Streamed, t_hidden: torch.Tensor, s_hidden: torch.Tensor,
              tokens: torch.Tensor) -> dict:
    """compare()'s KL / perplexity / top-1 from each model's final hidden states [n, T, hidden] (before the final
    norm), the heads applied a batch at a time."""
    heads = {}
    for key, model, hidden in (("teacher", teacher, t_hidden), ("student", student, s_hidden)):
        norm, head = model.part("model.norm"), model.part("lm_head")
        heads[key] = (lambda i, j, norm=norm, head=head, hidden=hidden: head(norm(hidden[i:j])))
    r = compare_rows(heads["teacher"], heads["student"], tokens.to(t_hidden.device))
    return {k: r[k] for k in ("kl", "kl_sem", "ppl", "ppl_ref", "top1_agree", "samples")}


@torch.no_grad()
def stream_eval(teacher: Streamed, student: Streamed, tokens: torch.Tensor, batch: int) -> dict:
    """Held-out metrics of the untrained student, every layer streamed once: the step-0 gate."""
    t_x, s_x = teacher.embed(tokens), student.embed(tokens)
    for i in range(teacher.config.num_hidden_layers):
        t_layer = _layer(teacher, i)
        t_x = map_rows(lambda x: layer_forward(t_layer, x), t_x, batch)
        del t_layer
        s_layer = _layer(student, i)
        s_x = map_rows(lambda x: layer_forward(s_layer, x), s_x, batch)
        del s_layer
    return head_eval(teacher, student, t_x, s_x, tokens)


class PeakRSS:
    """Peak resident memory per phase of the run (the ends' evaluation, each block), so a block's own peak is seen
    under the evaluation's: Linux's VmHWM, reset between phases through /proc/self/clear_refs ("5"). Elsewhere (or
    where the reset is refused) every phase reports the process peak so far (ru_maxrss)."""

    def __init__(self):
        self.overall = 0.0
        self.reset()

    @staticmethod
    def _hwm_mb() -> float | None:
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return None

    def reset(self):
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass

    def phase(self) -> float:
        """Peak MB since the last phase() (or the process peak where that cannot be told); starts the next."""
        from specquant.train.trainer import peak_memory_mb

        hwm = self._hwm_mb()
        peak = hwm if hwm is not None else peak_memory_mb(torch.device("cpu"))
        self.overall = max(self.overall, peak)
        self.reset()
        return peak


# --- one block through the shared loop ------------------------------------------------------------------------


class BlockObjective(nn.Module):
    """forward(idx [b, 1] sample indices) -> (MSE of the student block's outputs to the teacher's, stats). The
    activations are plain attributes, not buffers: they are data, not state the loop saves."""

    def __init__(self, layer: nn.Module, inputs: torch.Tensor, targets: torch.Tensor):
        super().__init__()
        self.layer = layer
        self.inputs, self.targets = inputs, targets  # [n, T, hidden] each

    def forward(self, idx: torch.Tensor):
        rows = idx[:, 0]
        mse = F.mse_loss(layer_forward(self.layer, self.inputs[rows]), self.targets[rows])
        return mse, {"mse": mse.detach()}


class BlockTask:
    """The trainer's task for one block (train/trainer.py): held-out MSE picks the best step, whose grid tensors
    the export writes under the block's checkpoint names."""

    best_key = "mse"

    def __init__(self, index: int, objective: BlockObjective, eval_inputs: torch.Tensor, eval_targets: torch.Tensor,
                 dtype: torch.dtype, batch: int):
        self.index, self.module, self.dtype, self.batch = index, objective, dtype, batch
        self.eval_inputs, self.eval_targets = eval_inputs, eval_targets

    @torch.no_grad()
    def evaluate(self) -> dict:
        out = map_rows(lambda x: layer_forward(self.module.layer, x), self.eval_inputs, self.batch)
        per_sample = (out - self.eval_targets).double().pow(2).flatten(1).mean(1)  # [samples]
        n = len(per_sample)
        sem = float(per_sample.std() / n**0.5) if n > 1 else 0.0
        return {"mse": float(per_sample.mean()), "mse_sem": sem, "samples": n}

    def check_start(self, metrics: dict) -> None:
        """The model-level gate ran before any block (stream_eval); a block has nothing to refuse."""

    def export(self, out_dir: Path, state: dict[str, torch.Tensor]) -> None:
        layer_state = {k.removeprefix("layer."): v for k, v in state.items() if k.startswith("layer.")}
        tensors = grid_export(self.module.layer, layer_state, self.dtype)
        with atomic_dir(out_dir) as tmp:
            save_file({f"model.layers.{self.index}.{k}": v for k, v in tensors.items()},
                      tmp / "block.safetensors")


def _block_tensors(block_dir: Path, index: int) -> dict[str, torch.Tensor]:
    prefix = f"model.layers.{index}."
    return {k.removeprefix(prefix): v for k, v in load_file(block_dir / "model" / "block.safetensors").items()}


def train_block(i: int, teacher: Streamed, student: Streamed, acts: dict, train: TrainConfig, qad: QADConfig,
                lean: LeanConfig, root: Path, progress: bool, peaks: PeakRSS) -> tuple[dict, dict]:
    """Train block i on acts (teacher / student inputs of the pool and of the held-out set); returns (the
    activations entering block i + 1, a summary row)."""
    from specquant.train.data import BlockOrder
    from specquant.train.trainer import Trainer, checkpoints

    t0 = time.perf_counter()
    fb = lean.lean_forward_batch
    t_layer = _layer(teacher, i)
    targets = map_rows(lambda x: layer_forward(t_layer, x), acts["teacher"], fb)
    eval_targets = map_rows(lambda x: layer_forward(t_layer, x), acts["teacher_eval"], fb)
    del t_layer
    s_layer = _layer(student, i)
    if not set_trainable_part(s_layer, qad.train_norms):
        raise SpecquantError(f"layer {i} of the student holds no quantized Linear; lean QAD trains the W4 layers")
    objective = BlockObjective(s_layer, acts["student"], targets)
    task = BlockTask(i, objective, acts["student_eval"], eval_targets, student.stored_dtype, fb)
    block_dir = root / "blocks" / f"layer-{i:03d}"
    resuming = bool(checkpoints(block_dir))
    if block_dir.exists() and not resuming:  # killed before its first checkpoint: start the block over
        shutil.rmtree(block_dir)
    index = torch.arange(len(acts["student"])).unsqueeze(1)  # [n, 1]: the loop's "token rows" are sample indices
    trainer = Trainer(task, BlockOrder(index, train.seed + i), train, block_dir, device=student.device,
                      progress=progress)
    result = trainer.fit(resume=resuming)
    del trainer, objective, task, s_layer
    # the next block's inputs from exactly the exported tensors (the best step's codes), as the checkpoint runs them
    trained = _layer(student, i, _block_tensors(block_dir, i))
    nxt = {"teacher": targets, "teacher_eval": eval_targets,
           "student": map_rows(lambda x: layer_forward(trained, x), acts["student"], fb),
           "student_eval": map_rows(lambda x: layer_forward(trained, x), acts["student_eval"], fb)}
    evals = [json.loads(ln) for ln in (block_dir / "log.jsonl").read_text().splitlines()]
    evals = [e for e in evals if e.get("event") == "eval"]
    row = {"event": "block", "block": i, "layer_type": student.config.layer_types[i] if student.config.layer_types
           else "full_attention", "mse_start": evals[0]["mse"], "mse_best": result["best"]["value"],
           "best_step": result["best"]["step"], "steps": result["steps"],
           "seconds_per_step": result["seconds_per_step"], "seconds": time.perf_counter() - t0,
           "peak_rss_block_mb": peaks.phase(), "optimizer": result["optimizer"]}
    return nxt, row


# --- the run --------------------------------------------------------------------------------------------------


def _acts_path(root: Path, i: int) -> Path:
    return root / f"acts-{i:03d}.safetensors"


def _save_state(root: Path, i: int, acts: dict, state: dict):
    """Activations entering block i, then the state that points at them: a kill between the two leaves the old
    state, whose own activations are still there."""
    tmp = _acts_path(root, i).with_name(f".acts-{i:03d}.tmp")
    save_file({k: v.cpu().contiguous() for k, v in acts.items()}, tmp)
    tmp.replace(_acts_path(root, i))
    state["next_block"] = i
    atomic_write(root / STATE, json.dumps(state, indent=1) + "\n")
    for old in root.glob("acts-*.safetensors"):
        if old != _acts_path(root, i):
            old.unlink()


def _log(out: Path, row: dict):
    with (out / "log.jsonl").open("a") as f:
        f.write(json.dumps(row, default=float) + "\n")


def prepare_lean_out(out: Path, resume: bool, overwrite: bool) -> bool:
    """prepare_out's rule with lean's resume point (out/lean/state.json); changes nothing on disk."""
    from specquant.util.files import check_out_dir

    check_out_dir(out, overwrite=True)
    if not out.exists() or not any(out.iterdir()):
        return False
    if resume and (out / "lean" / STATE).exists():
        return True
    if overwrite:
        return False
    what = "holds no lean run to resume" if resume else "is not empty"
    raise SpecquantError(f"--out {str(out)!r} {what}; pass --overwrite to start over there, "
                         f"{'' if resume else '--resume to continue its run, '}or choose a new directory")


def run_lean_qad(teacher: str, student: str, out, train: TrainConfig, qad: QADConfig, lean: LeanConfig,
                 data: str | None = None, resume: bool = False, overwrite: bool = False, device: str = "cpu",
                 dtype: str = "float32", progress: bool = True) -> dict:
    """`specquant distill target --lean` as a function. Every input is checked before --out is touched."""
    import os

    from specquant.model.checkpoint import load_tokenizer
    from specquant.quant.quality import heldout_tokens
    from specquant.train.data import BlockOrder, load_blocks
    from specquant.train.outdir import clear_our_outputs

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise SpecquantError("--lean runs in one process (one block at a time); under torchrun use full QAD with "
                             "--strategy fsdp, or drop torchrun")
    if qad.train_embeddings:
        raise SpecquantError("--train-embeddings needs the whole model resident; lean QAD trains decoder blocks: "
                             "drop --train-embeddings or drop --lean")
    lean.validate()
    out = Path(out).expanduser()
    resuming = prepare_lean_out(out, resume, overwrite)
    heldout, data_path = text_inputs(qad, data)
    t_dir, s_dir = resolve(teacher), resolve(student)
    if t_dir.resolve() == s_dir.resolve():
        raise SpecquantError("--teacher and --student are the same checkpoint; the student must be the quantized one")
    _, s_hf = check_pair(t_dir, s_dir)
    dev, work_dtype = torch.device(device), DTYPES[dtype]
    t_model = Streamed(t_dir, read_hf_config(t_dir), work_dtype, dev, fake_quant=False)
    s_model = Streamed(s_dir, s_hf, work_dtype, dev, fake_quant=True)
    tokenizer = load_tokenizer(s_dir)
    cfg = s_model.config
    blocks = load_blocks(data_path, tokenizer, train.seq_len, cfg.vocab_size)
    eval_tokens = heldout_tokens(tokenizer, heldout, qad.eval_samples, qad.eval_seq_len)
    n_pool = lean.lean_samples or train.steps * train.batch * train.grad_accum
    meta = {"mode": "lean", "teacher": str(t_dir), "teacher_sha256": fingerprint(t_dir), "student": str(s_dir),
            "student_sha256": fingerprint(s_dir), "data": str(data_path), "heldout": str(heldout),
            "train": train.to_json(), "qad": qad.to_json(), "lean": lean.to_json(), "pool_samples": n_pool}
    root = out / "lean"
    state = json.loads((root / STATE).read_text()) if resuming else None
    if state is not None and state["meta"] != meta:
        raise SpecquantError(f"--resume with different settings or checkpoints than the run in {str(out)!r}; "
                             "resume with the original flags or start a new --out")
    peaks = PeakRSS()
    if state is None:
        start = stream_eval(t_model, s_model, eval_tokens, lean.lean_forward_batch)
        if start["kl"] > qad.max_start_kl:  # the gate runs before anything is written
            raise SpecquantError(
                f"step-0 held-out KL(teacher || student) is {start['kl']:.4f} > --max-start-kl {qad.max_start_kl}; "
                "the student is not a quantization of this teacher or its grid is broken (re-quantize the teacher, "
                "or raise --max-start-kl if this gap is expected)")
        if overwrite and out.exists():
            clear_our_outputs(out)
        claim_out_dir(out, overwrite=True)
        root.mkdir(parents=True, exist_ok=True)
        pool = BlockOrder(blocks, train.seed).rows(0, n_pool)  # [n_pool, seq_len]: full QAD's rows, in its order
        acts = {"teacher": t_model.embed(pool), "student": s_model.embed(pool),
                "teacher_eval": t_model.embed(eval_tokens), "student_eval": s_model.embed(eval_tokens)}
        state = {"meta": meta, "start_eval": start, "blocks": [], "peak_rss_start_mb": peaks.phase()}
        _log(out, {"step": 0, "event": "eval", **start})
        _save_state(root, 0, acts, state)
    else:
        _log(out, {"event": "resume", "next_block": state["next_block"]})
        acts = {k: v.to(dev) for k, v in load_file(_acts_path(root, state["next_block"])).items()}
    for i in range(state["next_block"], cfg.num_hidden_layers):
        acts, row = train_block(i, t_model, s_model, acts, train, qad, lean, root, progress, peaks)
        state["blocks"].append(row)
        _save_state(root, i + 1, acts, state)
        _log(out, row)
        shutil.rmtree(root / "blocks" / f"layer-{i:03d}" / "checkpoints", ignore_errors=True)
    if "final_eval" not in state:
        final = head_eval(t_model, s_model, acts["teacher_eval"], acts["student_eval"], eval_tokens)
        export(s_model, root, out / "model", s_dir, meta)
        state["final_eval"], state["peak_rss_end_mb"] = final, peaks.phase()
        atomic_write(root / STATE, json.dumps(state, indent=1) + "\n")
        _log(out, {"step": train.steps, "event": "eval", **final})
    rows = state["blocks"]
    per_step = sorted(r["seconds_per_step"] for r in rows if r["seconds_per_step"] is not None)

    return {"mode": "lean", "start_eval": state["start_eval"], "best_eval": state["final_eval"],
            "best": {"step": train.steps, "value": state["final_eval"]["kl"]}, "model": str(out / "model"),
            "log": str(out / "log.jsonl"), "blocks": rows, "steps": train.steps, "pool_samples": n_pool,
            "seconds_per_step": per_step[len(per_step) // 2] if per_step else None,
            "seconds_per_block": sorted(r["seconds"] for r in rows)[len(rows) // 2] if rows else None,
            "optimizer": rows[0]["optimizer"] if rows else None,
            "peak_memory_mb": max(peaks.overall, peaks.phase()), "train_blocks": len(blocks),
            **({"peak_cuda_mb": torch.cuda.max_memory_allocated(dev) / 2**20} if dev.type == "cuda" else {}),
            "peak_rss_blocks_mb": max((r["peak_rss_block_mb"] for r in rows), default=None),
            "peak_rss_start_mb": state.get("peak_rss_start_mb"), "peak_rss_end_mb": state.get("peak_rss_end_mb"),
            "eval_samples": len(eval_tokens)}


def export(student: Streamed, root: Path, model_dir: Path, s_dir: Path, meta: dict):
    """The W4 checkpoint: the student's tensors as stored, every decoder layer's replaced by its block's export."""
    tensors = {n: student.reader.get(n) for n in student.reader.names()}
    for i in range(student.config.num_hidden_layers):
        block = load_file(root / "blocks" / f"layer-{i:03d}" / "model" / "block.safetensors")
        prefix = f"model.layers.{i}."
        stale = [n for n in tensors if n.startswith(prefix) and n not in block]
        assert not stale, f"layer {i}: the block export lacks {stale[:3]}"
        tensors.update(block)
    hf = read_hf_config(s_dir)
    extra = {"torch_dtype": hf.get("torch_dtype") or "float32", "quantization_config": hf["quantization_config"],
             "specquant_qad": meta}
    save_model(student.skeleton, model_dir, tokenizer_from=s_dir, extra_config=extra, tensors=tensors)
