"""`specquant distill draft`: train a drafter against a target with the shared trainer, in one or two stages.

Kinds:
  block  the DFlash-style block drafter (train/block_draft.py's objective): a fresh one shaped for the target, or
         --init DIR to continue one.
  lm     today's small-LM drafter adapted by forward KL(target || draft) over the full vocabulary (train/qad.py's
         chunked KL): --init is the LM drafter to start from (default tiny-draft for the bundled target).
  mtp    Qwen3.5's MTP layer (train/mtp.py's objective): --init an MTP drafter directory, else the target's own
         mtp.* tensors, else a fresh layer copied from the target's last full-attention layer.

Stages (REFERENCE.md §3): with --stage1-target, stage 1 trains against that (high-precision) target into
OUT/stage1, then stage 2 warm-starts from stage 1's best weights and trains against --target (the W4 / QAD one)
into OUT/stage2 with a fresh optimizer and schedule. Without it there is one stage, into OUT. Each stage is a
resumable trainer run (OUT[/stageN]/checkpoints, log.jsonl, model/); --resume continues whichever stage stopped.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from specquant.errors import SpecquantError, require_positive
from specquant.spec_decode.drafters import block, lm, mtp
from specquant.train.mtp import mtp_task
from specquant.train.trainer import bf16_state

BLOCK_INITS = ("random", "target")


@dataclass
class DraftConfig:
    """Drafter-distillation settings beyond the shared TrainConfig (the block objective's own are in
    BlockDraftTrainConfig)."""

    init: str | None = field(default=None, metadata={
        "help": "start from this drafter checkpoint (block: a DFlashDraftModel dir; lm: a small LM; default lm: "
                "tiny-draft for the bundled target; mtp: an MTP drafter dir, default the target's mtp.* tensors)"})
    layers: int = field(default=2, metadata={"help": "block: drafter layers of a fresh drafter"})
    block_size: int = field(default=16, metadata={"help": "block: anchor + drafted tokens per forward"})
    target_layer_ids: str = field(default="", metadata={
        "help": "block: comma-separated 0-based target layers read (default: 4 spread over a dense target's "
                "layers; DFlash's 5 from 1 to N-3 on a hybrid)"})
    mask_token_id: int = field(default=-1, metadata={"help": "block: MASK token id (-1: the tokenizer's pad token)"})
    block_init: str = field(default="random", metadata={
        "help": "block: how a fresh drafter starts: random (small normal init) or target (its layers copied from "
                "the target's last layers, fc reading the last tapped layer)", "choices": BLOCK_INITS})
    stage2_steps: int = field(default=0, metadata={
        "help": "with --stage1-target: optimizer steps of stage 2's fresh schedule (0: the same as --steps)"})
    heldout: str | None = field(default=None, metadata={"help": "held-out text (default: bundled heldout.txt)"})
    eval_seq_len: int = field(default=256, metadata={"help": "tokens per held-out sequence"})
    kl_chunk: int = field(default=256, metadata={"help": "lm, mtp: positions per KL chunk"})
    mtp_steps: int = field(default=3, metadata={
        "help": "mtp: chained drafts per step trained (1: the first draft only; each more replays one more)"})

    def validate(self) -> "DraftConfig":
        require_positive(self, ("layers", "eval_seq_len", "kl_chunk", "mtp_steps"))
        if self.block_size < 2:
            raise SpecquantError(f"block_size={self.block_size} must be at least 2")
        if self.stage2_steps < 0:
            raise SpecquantError(f"stage2_steps={self.stage2_steps} must be >= 0 (0: the same as --steps)")
        if self.block_init not in BLOCK_INITS:
            raise SpecquantError(f"block_init {self.block_init!r} is unknown; use one of {', '.join(BLOCK_INITS)}")
        return self

    def layer_ids(self, target) -> list[int]:
        """--target-layer-ids, or the tap rule for the target's ModelConfig (model/block_draft.py)."""
        from specquant.model.block_draft import default_target_layer_ids

        if self.target_layer_ids:
            try:
                return [int(x) for x in self.target_layer_ids.split(",")]
            except ValueError:
                raise SpecquantError(f"--target-layer-ids {self.target_layer_ids!r} must be comma-separated "
                                     "integers, e.g. 1,3,5,6") from None
        return default_target_layer_ids(target)


def norm_scale(norm) -> torch.Tensor:
    """The per-channel scale a target norm applies, as the drafter's plain RMSNorm (x * w) stores it: a hybrid's
    zero-centred norm keeps w as an offset from one (x * (1 + w)), so copying its weight would scale by w."""
    from specquant.model.norms import ZeroCentredRMSNorm

    w = norm.weight.detach().float()
    return 1.0 + w if isinstance(norm, ZeroCentredRMSNorm) else w


def init_block_drafter(drafter, target, seed: int, mode: str = "random"):
    """A fresh drafter's weights; the output norm always starts as the target's final norm, so the untrained drafter
    speaks through the target's lm_head at the target's scale.

    random: small normal init (residual projections scaled by depth).
    target: drafter layer i is a copy of target layer L - n + i (same shape: BlockDraftConfig.for_target), fc
    passes the last tapped layer's output through unchanged (the other taps start at a small random weight) and
    hidden_norm is the input norm of the target layer after that tap, so the last drafter layer starts by reading
    the context K/V its source layer reads in the target."""
    import math

    g = torch.Generator().manual_seed(seed)
    cfg = drafter.config
    depth = cfg.num_hidden_layers
    with torch.no_grad():
        for n, p in drafter.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * depth) if n.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=g) * std)
        drafter.norm.weight.copy_(norm_scale(target.model.norm))
        if mode == "random":
            return
        if mode != "target":
            raise SpecquantError(f"block_init {mode!r} is unknown; use one of {', '.join(BLOCK_INITS)}")
        layers = target.model.layers
        if depth > len(layers):
            raise SpecquantError(f"block_init target copies target layers, but the drafter has {depth} layers and "
                                 f"the target {len(layers)}; use fewer --layers or --block-init random")
        for i, layer in enumerate(drafter.layers):
            src = dict(layers[len(layers) - depth + i].named_parameters())
            for n, p in layer.named_parameters():
                if n not in src or src[n].shape != p.shape:
                    raise SpecquantError(f"block_init target: target layer has no {n} of shape {tuple(p.shape)}; "
                                         "use --block-init random")
                p.copy_(src[n].float())
        h, last = cfg.hidden_size, cfg.target_layer_ids[-1]
        drafter.fc.weight[:, -h:].copy_(torch.eye(h))
        nxt = min(last + 1, len(layers) - 1)
        drafter.hidden_norm.weight.copy_(norm_scale(layers[nxt].input_layernorm))


class LMDraftTask:
    """The trainer's task for --kind lm: KL(target || draft); best = lowest held-out KL."""

    best_key = "kl"

    def __init__(self, draft, target, eval_tokens, kl_chunk: int, tokenizer_from, run_meta: dict):
        from specquant.train.qad import KLStudent

        self.module = KLStudent(draft, target, kl_chunk)
        self.draft, self.target, self.eval_tokens = draft, target, eval_tokens
        self.tokenizer_from, self.run_meta = tokenizer_from, run_meta

    def evaluate(self) -> dict:
        from specquant.quant.quality import compare

        r = compare(self.target, self.draft, self.eval_tokens)
        return {"kl": r["kl"], "top1_agree": r["top1_agree"]}

    def check_start(self, metrics: dict) -> None:
        if not metrics["kl"] < 1e3:
            raise SpecquantError(f"step-0 held-out KL is {metrics['kl']}; the draft does not share this target's "
                                 "vocabulary or is broken")

    def export(self, out_dir: Path, state: dict[str, torch.Tensor]) -> None:
        from specquant.model.checkpoint import save_model

        tensors = bf16_state(state, "student.")
        if self.draft.config.tie_word_embeddings:
            tensors.pop("lm_head.weight", None)
        save_model(self.draft, out_dir, tokenizer_from=self.tokenizer_from, tensors=tensors,
                   extra_config={"torch_dtype": "bfloat16", "specquant_distill_draft": self.run_meta})


def _block_task(target, target_dir, tokenizer, cfg: DraftConfig, bcfg, eval_tokens, init, seed, meta, dtype=None,
                device=None):
    from specquant.drafter_loader import load_block_draft
    from specquant.model.block_draft import BlockDraftConfig, BlockDraftModel
    from specquant.train.block_draft import BlockDraftObjective, BlockDraftTask

    device = target.model.embed_tokens.weight.device
    if init:
        drafter = load_block_draft(init, device=device)
        drafter.config.check_target(target.config)
        drafter.train()
    else:
        mask = cfg.mask_token_id if cfg.mask_token_id >= 0 else tokenizer.pad_token_id
        if mask is None:
            raise SpecquantError("the tokenizer has no pad token to use as MASK; pass --mask-token-id")
        dcfg = BlockDraftConfig.for_target(target.config, num_hidden_layers=cfg.layers, block_size=cfg.block_size,
                                           target_layer_ids=cfg.layer_ids(target.config),
                                           mask_token_id=mask)
        drafter = BlockDraftModel(dcfg).to(device)
        init_block_drafter(drafter, target, seed, cfg.block_init)
    objective = BlockDraftObjective(drafter, target, bcfg)
    return BlockDraftTask(objective, eval_tokens, tokenizer_from=target_dir,
                          extra_config={"specquant_distill_draft": {**meta, "objective": dataclasses.asdict(bcfg)}})


def _lm_task(target, target_dir, tokenizer, cfg: DraftConfig, bcfg, eval_tokens, init, seed, meta, dtype, device):
    from specquant.loader import load_model

    draft = load_model(init, dtype=dtype, device=str(device)).train()
    return LMDraftTask(draft, target, eval_tokens, cfg.kl_chunk, target_dir, meta)


@dataclass(frozen=True)
class Objective:
    """How one drafter kind (spec_decode/drafters/) is trained here."""

    # (target, target_dir, tokenizer, cfg, bcfg, eval_tokens, init, seed, meta, dtype, device) -> trainer task
    task: Callable
    needs_init: bool  # True: adapts an existing drafter (--init), never starts from scratch


# keyed by the drafter registry's kinds; a kind without a row here cannot be trained
OBJECTIVES = {block.KIND.name: Objective(_block_task, needs_init=False),
              lm.KIND.name: Objective(_lm_task, needs_init=True),
              mtp.KIND.name: Objective(mtp_task, needs_init=False)}
KINDS = tuple(OBJECTIVES)


def run_draft(kind: str, target: str, out, train, cfg: DraftConfig, bcfg, data: str | None = None,
              stage1_target: str | None = None, resume: bool = False, overwrite: bool = False,
              device: str = "cpu", dtype: str = "float32", progress: bool = True) -> dict | None:
    """Every input is checked before --out is touched. Returns the result on rank 0 (None elsewhere)."""
    from specquant.loader import load_model
    from specquant.model.checkpoint import load_tokenizer, resolve
    from specquant.util.dtypes import DTYPES
    from specquant.quant.config import BUNDLED_CALIB
    from specquant.quant.quality import heldout_tokens
    from specquant.train.outdir import check_stages_parent, clear_our_outputs, prepare_out
    from specquant.util.files import claim_out_dir
    from specquant.train.data import BlockOrder, load_blocks
    from specquant.train.qad import BUNDLED_HELDOUT
    from specquant.train.trainer import Trainer, setup_distributed

    if kind not in KINDS:
        raise SpecquantError(f"--kind {kind!r} is unknown; use one of {', '.join(KINDS)}")
    cfg.validate()
    out = Path(out).expanduser()
    stages = [("stage1", stage1_target), ("stage2", target)] if stage1_target else [("", target)]
    dirs = {name: (out / name if name else out) for name, _ in stages}
    if stage1_target:
        check_stages_parent(out, list(dirs), overwrite)
    resuming = {name: prepare_out(d, resume, overwrite) for name, d in dirs.items()}
    heldout = Path(cfg.heldout).expanduser() if cfg.heldout else BUNDLED_HELDOUT
    data_path = Path(data).expanduser() if data else BUNDLED_CALIB
    for p, flag in ((heldout, "--heldout"), (data_path, "--data")):
        if not p.is_file():
            raise SpecquantError(f"{flag} {str(p)!r} does not exist; pass a text or `specquant regen` .jsonl file")
    if data_path.resolve() == heldout.resolve():
        raise SpecquantError(f"--data {str(data_path)!r} is the held-out evaluation text; train on other text")
    target_dirs = {name: resolve(t) for name, t in stages}
    rank, world, dev = setup_distributed(device)
    tokenizer = load_tokenizer(target_dirs[stages[-1][0]])
    results, init = [], cfg.init
    objective = OBJECTIVES[kind]
    if objective.needs_init and init is None:
        if target_dirs[stages[-1][0]] != resolve("tiny-target"):
            raise SpecquantError(f"--kind {kind} needs --init: the drafter to adapt")
        init = "tiny-draft"  # the bundled target's own small LM drafter
    for name, t in stages:
        stage_train = dataclasses.replace(train, steps=cfg.stage2_steps) if name == "stage2" and cfg.stage2_steps \
            else train
        target_model = load_model(target_dirs[name], dtype=DTYPES[dtype], device=str(dev))
        for p in target_model.parameters():
            p.requires_grad_(False)
        vocab = target_model.config.vocab_size
        blocks = load_blocks(data_path, tokenizer, train.seq_len, vocab)
        eval_tokens = heldout_tokens(tokenizer, heldout, bcfg.eval_samples, cfg.eval_seq_len).to(dev)
        meta = {"kind": kind, "stage": name or "single", "target": str(target_dirs[name]), "data": str(data_path),
                "init": str(init) if init else None, "train": stage_train.to_json(), "draft": dataclasses.asdict(cfg)}
        task = objective.task(target_model, target_dirs[name], tokenizer, cfg, bcfg, eval_tokens, init, train.seed,
                              meta, DTYPES[dtype], dev)
        d = dirs[name]
        if stage1_target and rank == 0:
            claim_out_dir(out, overwrite=True)  # marked as ours: a rerun there needs no --overwrite for its parent
        if overwrite and not resuming[name] and rank == 0 and d.exists():
            clear_our_outputs(d)
        trainer = Trainer(task, BlockOrder(blocks, train.seed), stage_train, d, device=dev, progress=progress,
                          run_info={"kind": kind, "stage": meta["stage"], "target": meta["target"]})
        result = trainer.fit(resume=resuming[name])
        if rank == 0:
            evals = [json.loads(ln) for ln in (d / "log.jsonl").read_text().splitlines()]
            evals = [e for e in evals if e.get("event") == "eval"]
            start = next((e for e in evals if e["step"] == 0), None)
            best = next((e for e in reversed(evals) if e["step"] == result["best"]["step"]), None)
            results.append({"stage": meta["stage"], "target": meta["target"], **result, "start_eval": start,
                            "best_eval": best, "model": str(d / "model"), "train_blocks": len(blocks)})
        init = d / "model"  # stage 2 warm-starts from stage 1's best weights, with a fresh optimizer and schedule
    if rank != 0:
        return None
    return {"kind": kind, "stages": results, "model": results[-1]["model"]}
