"""The shared training loop: data order, AdamW, cosine schedule, clipping, accumulation, checkpoints, torchrun, logs.

How a new distillation plugs in (QAD in train/qad.py is the worked example):

1. Write a *task* object with four members (see `Task` below):
     module    an nn.Module whose forward(tokens [batch, seq_len]) returns (loss, {name: float}); exactly its
               parameters with requires_grad=True are trained. Keep frozen helpers (a teacher) out of its registered
               submodules, so DDP/FSDP wrap only the student.
     evaluate() held-out metrics as a dict of floats; it must contain `best_key` (lower is better).
     check_start(metrics)  called once with the step-0 metrics; raise SpecquantError to refuse to train.
   Optional: fsdp_units, submodules (decoder layers) that `--strategy fsdp` shards one by one; evaluate() must
   then run its forwards through `module` (FSDP2 gathers parameters in module's forward hooks).
     export(out_dir, state)  write the deployable checkpoint atomically from `state`, module's full state_dict
               ({name: tensor}, unsharded even under FSDP; read weights from it, not from the module).
2. Build token blocks with train.data.load_blocks and call
     `Trainer(task, BlockOrder(blocks, cfg.seed), cfg, out_dir).fit(resume=...)`.
3. Add the CLI: one entry in train/cli.py's SUBCOMMANDS ({"draft": (add_flags, run)}), reusing
   `add_train_flags` / `train_config_from_args` so every TrainConfig flag and default is shared.

What the loop guarantees: a resumed run is bit-identical to an uninterrupted one (the checkpoint holds the trained
tensors, the optimizer state, the schedule position, the RNG state and the data position, written atomically);
`torchrun --nproc_per_node N` runs DDP (gloo on CPU, NCCL on CUDA) or FSDP2 (`--strategy fsdp`), with the global
batch = batch × grad_accum × N; log.jsonl and a tqdm bar on rank 0; the best held-out step is exported to
`out_dir/model`.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import logging
import math
import os
import re
import shutil
import time
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

from specquant.errors import SpecquantError
from specquant.util.files import atomic_dir, claim_out_dir
from specquant.train.config import RESUME_KEYS, TrainConfig
from specquant.train.data import BlockOrder

log = logging.getLogger(__name__)
CKPT_RE = re.compile(r"^step-(\d{7})$")


class Task(Protocol):
    module: nn.Module
    best_key: str

    def evaluate(self) -> dict: ...

    def check_start(self, metrics: dict) -> None: ...

    def export(self, out_dir: Path, state: dict[str, torch.Tensor]) -> None: ...


class HeldoutTask:
    """The part of a Task every drafter objective shares: the objective as `module`, its held-out tokens, and what its
    export writes beside the weights (the tokenizer's source, extra config.json keys)."""

    def __init__(self, objective: nn.Module, heldout: torch.Tensor, tokenizer_from=None,
                 extra_config: dict | None = None):
        self.module = objective
        self.heldout = heldout
        self.tokenizer_from = tokenizer_from
        self.extra_config = extra_config or {}


def bf16_state(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The tensors of `state` under `prefix` (a submodule of the trained module), prefix removed, floats in bf16:
    what an export saves."""
    return {k.removeprefix(prefix): v.to(torch.bfloat16) if v.is_floating_point() else v
            for k, v in state.items() if k.startswith(prefix)}


# --- processes ------------------------------------------------------------------------------------------------


def setup_distributed(device: str) -> tuple[int, int, torch.device]:
    """Join the torchrun process group when WORLD_SIZE > 1 (gloo on CPU, NCCL on CUDA): (rank, world, device)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, torch.device(device)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device.startswith("cuda"):
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
        # The group we joined is left at exit, while the interpreter is whole: without destroy_process_group, gloo's
        # worker threads can still hold finished collectives' tensors when Python finalizes, and freeing them then
        # aborts the process ("terminate called without an active exception", SIGABRT) after a run that succeeded:
        # seen twice in test_trainer's FSDP run (PyTorch issue 190489 has a plain all_gather repro).
        atexit.register(_leave_group)
    return dist.get_rank(), world, dev


def _leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocator peak on GPU, peak resident set size (ru_maxrss) on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over cfg.warmup steps, then cosine from lr to lr·min_lr_ratio at cfg.steps."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(params: list[nn.Parameter], cfg: TrainConfig, device: torch.device):
    """(optimizer, name). 8-bit AdamW (bitsandbytes) needs CUDA; "auto" falls back to torch's AdamW elsewhere."""
    kw = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)
    want8 = cfg.optimizer == "adamw8bit" or (cfg.optimizer == "auto" and device.type == "cuda")
    if want8:
        try:
            import bitsandbytes as bnb  # a maintained 8-bit AdamW; its kernels run on CUDA only

            if device.type != "cuda":
                raise RuntimeError(f"bitsandbytes' 8-bit AdamW does not run on {device.type}")
            return bnb.optim.AdamW8bit(params, **kw), "bitsandbytes.AdamW8bit"
        except (ImportError, RuntimeError) as e:
            if cfg.optimizer == "adamw8bit":
                raise SpecquantError(f"--optimizer adamw8bit is unavailable ({e}); install bitsandbytes on a CUDA "
                                     "machine, or use --optimizer adamw") from None
            log.warning("8-bit AdamW unavailable (%s): using torch.optim.AdamW (fp32 state)", e)
    return torch.optim.AdamW(params, **kw), "torch.optim.AdamW"


# --- checkpoints ----------------------------------------------------------------------------------------------


def _flatten_optimizer(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Optimizer state_dict -> (tensors for safetensors, the JSON-able rest); no pickle needed for either."""
    tensors, meta = {}, {"param_groups": state["param_groups"], "state": {}}
    for pid, st in state["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"{pid}/{k}"] = v.detach().cpu().contiguous()
            else:
                meta["state"].setdefault(str(pid), {})[k] = v
    return tensors, meta


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict = {}
    for key, v in tensors.items():
        pid, k = key.split("/", 1)
        state.setdefault(pid, {})[k] = v
    for pid, st in meta["state"].items():
        state.setdefault(pid, {}).update(st)
    return {"state": state, "param_groups": meta["param_groups"]}


def _rng_state() -> dict[str, torch.Tensor]:
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"cuda{i}"] = s
    return out


def _set_rng_state(rng: dict[str, torch.Tensor]):
    torch.set_rng_state(rng["cpu"])
    cuda = [rng[k] for k in sorted(rng) if k.startswith("cuda")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


def checkpoints(out_dir: Path) -> list[Path]:
    """Complete checkpoints under out_dir/checkpoints, oldest first (temp dirs of an interrupted save are not)."""
    root = out_dir / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if CKPT_RE.match(p.name) and (p / "state.json").exists()]
    return sorted(found, key=lambda p: int(CKPT_RE.match(p.name).group(1)))


# --- the loop -------------------------------------------------------------------------------------------------


class Trainer:
    def __init__(self, task: Task, data: BlockOrder, cfg: TrainConfig, out_dir, device: torch.device | None = None,
                 progress: bool | str = True, run_info: dict | None = None):
        self.task, self.data, self.cfg = task, data, cfg.validate()
        self.out_dir = Path(out_dir)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.device = device or next(task.module.parameters()).device
        self.progress = progress if self.rank == 0 else False  # util/progress.py: True, BAR_ONLY or False
        self.run_info = run_info or {}
        self.names = [n for n, p in task.module.named_parameters() if p.requires_grad]
        if not self.names:
            raise SpecquantError("the task has no trainable parameter; nothing to train")
        self.wrapped = self._wrap(task.module)
        params = [p for p in self.wrapped.parameters() if p.requires_grad]
        self.optimizer, self.optimizer_name = make_optimizer(params, cfg, self.device)
        self.step, self.samples = 0, 0
        self.best = {"step": None, "value": math.inf}

    def _wrap(self, module: nn.Module) -> nn.Module:
        if self.world == 1:
            return module
        if self.cfg.strategy == "fsdp":
            from torch.distributed.fsdp import fully_shard

            # FSDP2 shards in place: each unit (e.g. a decoder layer) is gathered only while it runs, the rest
            # with the root. Every forward, evaluation included, must then enter through task.module.
            for unit in getattr(self.task, "fsdp_units", ()):
                fully_shard(unit)
            return fully_shard(module)
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DDP(module, device_ids=ids)

    # checkpoint I/O: full (unsharded) tensors, written by rank 0
    def _opts(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=True, cpu_offload=True)

    def full_model_state(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer of task.module as full tensors (a collective under FSDP: all ranks call)."""
        if self.world == 1:
            return {k: v.detach() for k, v in self.task.module.state_dict().items()}
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.wrapped, options=self._opts())

    def save_checkpoint(self):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        model_sd = self.full_model_state()  # collective; with cpu_offload only rank 0 receives the tensors
        optim_sd = get_optimizer_state_dict(self.wrapped, self.optimizer, options=self._opts())
        if self.rank == 0:
            trainable = {n: model_sd[n].detach().cpu().contiguous() for n in self.names}
            opt_tensors, opt_meta = _flatten_optimizer(optim_sd)
            state = {"step": self.step, "samples_consumed": self.samples, "schedule": {"step": self.step,
                     "lr": lr_at(self.step, self.cfg)}, "best": self.best, "config": self.cfg.to_json(),
                     "optimizer": {"name": self.optimizer_name, **opt_meta}, "world_size": self.world,
                     "run": self.run_info}
            final = self.out_dir / "checkpoints" / f"step-{self.step:07d}"
            with atomic_dir(final) as tmp:
                save_file(trainable, tmp / "trainable.safetensors")
                save_file(opt_tensors, tmp / "optimizer.safetensors")
                save_file(_rng_state(), tmp / "rng.safetensors")
                (tmp / "state.json").write_text(json.dumps(state, indent=1) + "\n")
            for old in checkpoints(self.out_dir)[: -self.cfg.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
        self._barrier()

    def load_checkpoint(self, path: Path):
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        state = json.loads((path / "state.json").read_text())
        old = state["config"]
        changed = {k: (old.get(k), getattr(self.cfg, k)) for k in RESUME_KEYS if old.get(k) != getattr(self.cfg, k)}
        if changed:
            raise SpecquantError(f"--resume with different settings than the checkpoint in {path}: {changed}; "
                                 "resume with the original flags or start a new --out")
        trainable = load_file(path / "trainable.safetensors")
        if set(trainable) != set(self.names):
            raise SpecquantError(f"checkpoint {path} trains other parameters than this run; start a new --out")
        opts = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(self.wrapped, trainable, options=opts)
        optim_sd = _unflatten_optimizer(load_file(path / "optimizer.safetensors"), state["optimizer"])
        set_optimizer_state_dict(self.wrapped, self.optimizer, optim_sd, options=opts)
        _set_rng_state(load_file(path / "rng.safetensors"))
        self.step, self.samples, self.best = state["step"], state["samples_consumed"], state["best"]

    def _barrier(self):
        if self.world > 1:
            dist.barrier()

    # logging
    def _log(self, row: dict):
        if self.rank == 0:
            with (self.out_dir / "log.jsonl").open("a") as f:
                f.write(json.dumps(row, default=float) + "\n")

    def _trim_log(self):
        """After a resume, drop log lines past the checkpoint's step (the resumed run writes them again)."""
        path = self.out_dir / "log.jsonl"
        if self.rank != 0 or not path.exists():
            return
        keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln).get("step", 0) <= self.step]
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(ln + "\n" for ln in keep))
        tmp.replace(path)

    # evaluation and best-step export
    def evaluate(self) -> dict:
        """Held-out metrics: rank 0 evaluates (every rank under FSDP, whose forward is collective)."""
        self.task.module.eval()
        try:
            if self.cfg.strategy == "fsdp" or self.rank == 0:
                metrics = self.task.evaluate()
            else:
                metrics = None
        finally:
            self.task.module.train()
        if self.world > 1:
            box = [metrics]
            dist.broadcast_object_list(box, src=0)
            metrics = box[0]
        return metrics

    def _eval_and_export(self) -> dict:
        return self._record_eval(self.evaluate())

    def _record_eval(self, metrics: dict) -> dict:
        value = metrics[self.task.best_key]
        is_best = value < self.best["value"]
        if is_best:
            self.best = {"step": self.step, "value": value}
            state = self.full_model_state()
            if self.rank == 0:
                self.task.export(self.out_dir / "model", state)
            self._barrier()
        self._log({"step": self.step, "event": "eval", **metrics, "best_step": self.best["step"]})
        return metrics

    def fit(self, resume: bool = False) -> dict:
        """Train to cfg.steps; returns {"best": ..., "final_eval": ..., "steps": ..., "seconds_per_step": ...}."""
        cfg = self.cfg
        found = checkpoints(self.out_dir) if resume else []
        if found and self.rank == 0:  # a save killed mid-write leaves its temp dir (ours): drop it
            for stale in (self.out_dir / "checkpoints").glob(".step-*"):
                shutil.rmtree(stale, ignore_errors=True)
        if found:
            self.load_checkpoint(found[-1])
            self._trim_log()
            self._log({"step": self.step, "event": "resume", "checkpoint": found[-1].name})
        else:
            torch.manual_seed(cfg.seed)
        start_metrics = None
        if self.step == 0:  # the gate runs before anything is written: a refused run leaves no output behind
            start_metrics = self.evaluate()
            self.task.check_start(start_metrics)
        if self.rank == 0:  # marked as specquant's (util/files.py); the CLI has already checked --out
            claim_out_dir(self.out_dir, overwrite=True)
            log.info("optimizer: %s", self.optimizer_name)
        self._log({"step": self.step, "event": "train_start", "optimizer": self.optimizer_name, "world": self.world,
                   "global_batch": cfg.batch * cfg.grad_accum * self.world, "config": cfg.to_json(),
                   "run": self.run_info})
        if start_metrics is not None:
            self._record_eval(start_metrics)
        self.task.module.train()
        from specquant.util.progress import progress_for

        bar = progress_for(self.progress, cfg.steps - self.step, "train", "step")
        params = [p for p in self.wrapped.parameters() if p.requires_grad]
        step_times, final = [], None
        while self.step < cfg.steps:
            t0 = time.perf_counter()
            loss, stats = self._train_step(params)
            dt = time.perf_counter() - t0
            step_times.append(dt)
            tokens = cfg.batch * cfg.grad_accum * self.world * cfg.seq_len
            if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                self._log({"step": self.step, "loss": loss, **stats, "lr": lr_at(self.step - 1, cfg),
                           "tokens_per_s": tokens / dt, "seconds": dt, "samples_consumed": self.samples})
            bar.update(1, status=", ".join([f"loss {loss:.4f}", *(f"{k} {v:.4f}" for k, v in stats.items()),
                                            f"{tokens / dt:.0f} tok/s"]))
            last = self.step == cfg.steps
            if last or (cfg.eval_every and self.step % cfg.eval_every == 0):
                final = self._eval_and_export()
            if last or self.step % cfg.save_every == 0:
                self.save_checkpoint()
        bar.close()
        if final is None:  # resumed at (or past) the last step, e.g. with --steps lowered to stop a run early:
            final = self._eval_and_export()  # nothing left to train, but these weights may be the best: record them
        self._log({"step": self.step, "event": "train_end", "best_step": self.best["step"],
                   "rank_digests": self.rank_digests(), "peak_memory_mb": peak_memory_mb(self.device),
                   "median_seconds_per_step": sorted(step_times)[len(step_times) // 2] if step_times else None})
        return {"best": self.best, "final_eval": final, "steps": self.step,
                "seconds_per_step": sorted(step_times)[len(step_times) // 2] if step_times else None,
                "optimizer": self.optimizer_name, "peak_memory_mb": peak_memory_mb(self.device)}

    def rank_digests(self) -> list[str]:
        """sha256 of each rank's own copy of the trained tensors (equal under DDP, or the ranks diverged)."""
        h = hashlib.sha256()
        for name, p in self.task.module.named_parameters():
            if p.requires_grad:
                local = p.detach()
                local = local.to_local() if hasattr(local, "to_local") else local  # FSDP2: this rank's shard
                h.update(name.encode())
                h.update(local.float().cpu().contiguous().numpy().tobytes())
        if self.world == 1:
            return [h.hexdigest()]
        out = [None] * self.world
        dist.all_gather_object(out, h.hexdigest())
        return out

    def _train_step(self, params: list[nn.Parameter]) -> tuple[float, dict]:
        cfg = self.cfg
        lr = lr_at(self.step, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total, stats_sum = 0.0, {}
        for micro in range(cfg.grad_accum):
            start = self.samples + (micro * self.world + self.rank) * cfg.batch
            tokens = self.data.rows(start, cfg.batch).to(self.device)
            sync = micro == cfg.grad_accum - 1
            ctx = self.wrapped.no_sync() if (not sync and hasattr(self.wrapped, "no_sync")) else contextlib.nullcontext()
            with ctx:
                loss, stats = self.wrapped(tokens)
                (loss / cfg.grad_accum).backward()
            total += float(loss.detach()) / cfg.grad_accum
            for k, v in stats.items():
                stats_sum[k] = stats_sum.get(k, 0.0) + float(v) / cfg.grad_accum
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.samples += cfg.batch * cfg.grad_accum * self.world
        if self.world > 1:  # the logged loss is the global mean (every rank sees the same tokens per step)
            vals = torch.tensor([total, *stats_sum.values()], dtype=torch.float64)
            dist.all_reduce(vals)
            vals /= self.world
            total, stats_sum = float(vals[0]), dict(zip(stats_sum, vals[1:].tolist()))
        return total, stats_sum
