"""Train the bundled tiny-block-draft (DFlash-style block drafter for tiny-target) on this CPU; resumable.

Two phases, each resumable (rerun the same command after an interruption, even a SIGKILL):
  1. regen: the target's own generations, the reference recipe's data. Prompts are 32-token windows of the
     packaged calib.txt (held-out prompts from heldout.txt for evaluation); each is continued for 224 tokens by
     tiny-target, alternate rows greedily and sampled at T=0.7, top-p 0.8, top-k 20 (the reference's settings).
     Lines are {"prompt_ids", "completion_ids"} (the `specquant regen` format) appended batch by batch. 128 lines
     (32K tokens) because the shared 2-core CPU gave this job ~0.2 cores: that batch alone took 20 minutes.
  2. train: the block objective (specquant.train.block_draft) with AdamW and a cosine schedule. Every
     --save-every steps the drafter, AdamW state, step and RNG state are written as safetensors (atomic rename),
     and training continues from there on the next call. --export writes the bf16 checkpoint.

This is the interim loop written before the shared trainer (train/trainer.py, `specquant distill draft`) landed;
it runs the same objective and task object, so the weights are the same architecture either way.

    nice -n 10 .venv/bin/python scripts/train_block_draft.py --run-dir runs/block --export src/specquant/models/tiny-block-draft
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from specquant.decode.sampling import SamplingConfig, logits_to_probs, sample
from specquant.model.block_draft import BlockDraftConfig, BlockDraftModel
from specquant.loader import load_model
from specquant.model.checkpoint import load_tokenizer
from specquant.train.block_draft import (BlockDraftObjective, BlockDraftTask, BlockDraftTrainConfig,
                                         evaluate_blocks)
from specquant.train.draft import init_block_drafter

DATA = Path(__file__).resolve().parent.parent / "src" / "specquant" / "data"
PROMPT_LEN, GEN_LEN = 32, 224


def text_stream(tokenizer, path: Path) -> np.ndarray:
    docs = [d.strip() for d in path.read_text().split("\n\n\n") if d.strip()]
    ids: list[int] = []
    for d in docs:
        ids += tokenizer.encode(d, add_special_tokens=False) + [tokenizer.eos_token_id]
    return np.array(ids, dtype=np.int64)


@torch.no_grad()
def regen(target, stream: np.ndarray, out: Path, n: int, batch: int, seed: int):
    """Append target continuations of random prompt windows to `out` until it has n lines (resumable)."""
    done = sum(1 for _ in out.open()) if out.exists() else 0
    cfg = SamplingConfig(temperature=0.7, top_p=0.8, top_k=20)
    while done < n:
        b = min(batch, n - done)
        rng = np.random.default_rng([seed, done])
        starts = rng.integers(0, len(stream) - PROMPT_LEN, size=b)
        prompts = torch.from_numpy(np.stack([stream[s : s + PROMPT_LEN] for s in starts]))
        greedy = torch.arange(done, done + b) % 2 == 0  # alternate rows: greedy, sampled
        gen = torch.Generator().manual_seed(seed * 1000003 + done)
        target.setup_cache(b, PROMPT_LEN + GEN_LEN + 1)
        logits = target(prompts, 0, last_only=True)[:, -1]
        toks = []
        for i in range(GEN_LEN):
            nxt = torch.where(greedy, logits.argmax(-1), sample(logits_to_probs(logits, cfg), gen))
            toks.append(nxt)
            if i < GEN_LEN - 1:
                logits = target(nxt[:, None], PROMPT_LEN + i, last_only=True)[:, -1]
        target.clear_cache()
        comp = torch.stack(toks, 1)
        with out.open("a") as f:
            for p, c, g in zip(prompts.tolist(), comp.tolist(), greedy.tolist()):
                f.write(json.dumps({"prompt_ids": p, "completion_ids": c, "greedy": g}) + "\n")
        done += b
        print(json.dumps({"regen": str(out.name), "lines": done, "of": n}), flush=True)


def read_blocks(path: Path) -> torch.Tensor:
    rows = [json.loads(line) for line in path.open()]
    return torch.tensor([r["prompt_ids"] + r["completion_ids"] for r in rows], dtype=torch.long)


@torch.no_grad()
def teacher_outputs(objective, blocks: torch.Tensor, path: Path, chunk: int = 16):
    """The frozen target's features (bf16) and labels for every training sequence, computed once and kept in
    `path`: the data is visited several times, and the teacher forward is a third of a step's cost."""
    if path.exists():
        t = load_file(path)
        if t["labels"].shape == blocks.shape:
            return t["features"], t["labels"]
    feats, labels = [], []
    for i in range(0, len(blocks), chunk):
        f, lab = objective.teacher(blocks[i : i + chunk])
        feats.append(f.to(torch.bfloat16))
        labels.append(lab)
    out = {"features": torch.cat(feats), "labels": torch.cat(labels)}
    save_file(out, str(path) + ".tmp")
    os.replace(str(path) + ".tmp", path)
    return out["features"], out["labels"]


def lr_at(step, steps, lr, warmup, min_ratio=0.1):
    if step < warmup:
        return lr * (step + 1) / warmup
    prog = min(1.0, (step - warmup) / max(1, steps - warmup))
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * prog)))


def save_ckpt(run: Path, drafter, opt, step: int):
    t = {f"model.{k}": v.detach().contiguous() for k, v in drafter.state_dict().items()}
    names = {id(p): n for n, p in drafter.named_parameters()}
    for p, st in opt.state.items():
        for k in ("exp_avg", "exp_avg_sq"):
            t[f"opt.{names[id(p)]}.{k}"] = st[k].contiguous()
        t[f"opt.{names[id(p)]}.step"] = torch.as_tensor(float(st["step"])).reshape(1)
    t["rng"] = torch.get_rng_state()
    tmp = run / "ckpt.safetensors.tmp"
    save_file(t, tmp, metadata={"step": str(step)})
    os.replace(tmp, run / "ckpt.safetensors")


def load_ckpt(run: Path, drafter, opt) -> int:
    path = run / "ckpt.safetensors"
    if not path.exists():
        return 0
    with safe_open(str(path), "pt") as f:
        step = int(f.metadata()["step"])
    t = load_file(path)
    drafter.load_state_dict({k[6:]: v for k, v in t.items() if k.startswith("model.")})
    for n, p in drafter.named_parameters():
        if f"opt.{n}.exp_avg" in t:
            opt.state[p] = {"exp_avg": t[f"opt.{n}.exp_avg"], "exp_avg_sq": t[f"opt.{n}.exp_avg_sq"],
                            "step": t[f"opt.{n}.step"].reshape(())}
    torch.set_rng_state(t["rng"])
    return step


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="tiny-target")
    ap.add_argument("--run-dir", default="runs/block")
    ap.add_argument("--export", help="write the final bf16 drafter checkpoint here")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--target-layer-ids", default="1,3,5,6")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--train-lines", type=int, default=128)
    ap.add_argument("--eval-lines", type=int, default=8)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--save-every", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--num-anchors", type=int, default=24)
    ap.add_argument("--gamma", type=float, default=7.0)
    ap.add_argument("--labels", default="data", choices=["data", "target"])
    ap.add_argument("--data", help="train on this .txt (corpus) instead of regen lines (use with --labels target)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--stop-after", type=int, default=0, help="stop (checkpointed) after N steps this call")
    args = ap.parse_args()
    run = Path(args.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    target = load_model(args.target)
    tok = load_tokenizer(args.target)
    t0 = time.time()
    if args.data:
        stream = torch.from_numpy(text_stream(tok, Path(args.data)))
        L = PROMPT_LEN + GEN_LEN
        train = stream[: len(stream) // L * L].view(-1, L)
    else:
        regen(target, text_stream(tok, DATA / "calib.txt"), run / "regen_train.jsonl", args.train_lines, 128,
              args.seed)
        train = read_blocks(run / "regen_train.jsonl")
    regen(target, text_stream(tok, DATA / "heldout.txt"), run / "regen_eval.jsonl", args.eval_lines, 16,
          args.seed + 1)
    heldout = read_blocks(run / "regen_eval.jsonl")
    print(json.dumps({"data_s": round(time.time() - t0), "train_seqs": len(train)}), flush=True)

    torch.manual_seed(args.seed)
    cfg = BlockDraftConfig.for_target(target.config, num_hidden_layers=args.layers, block_size=args.block_size,
                                      target_layer_ids=[int(x) for x in args.target_layer_ids.split(",")],
                                      mask_token_id=tok.pad_token_id)
    drafter = BlockDraftModel(cfg)
    init_block_drafter(drafter, target, args.seed)
    objective = BlockDraftObjective(drafter, target, BlockDraftTrainConfig(
        num_anchors=args.num_anchors, gamma=args.gamma, labels=args.labels))
    task = BlockDraftTask(objective, heldout, tokenizer_from=args.target)
    decay = [p for p in drafter.parameters() if p.dim() >= 2]
    rest = [p for p in drafter.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay}, {"params": rest}], lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    step = load_ckpt(run, drafter, opt)
    t0 = time.time()
    feats, labels = teacher_outputs(objective, train, run / f"teacher_{args.labels}.safetensors")
    print(json.dumps({"teacher_s": round(time.time() - t0)}), flush=True)
    log = (run / "log.jsonl").open("a")
    print(json.dumps({"params_M": round(drafter.num_parameters() / 1e6, 3), "start_step": step}), flush=True)
    t1, this_call = time.time(), 0
    while step < args.steps:
        rng = np.random.default_rng([args.seed, step])  # batch i is fixed by (seed, i): resumable and reproducible
        rows = torch.from_numpy(rng.choice(len(train), size=args.batch, replace=False))
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        loss, stats = objective(train[rows], feats[rows], labels[rows])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step, this_call = step + 1, this_call + 1
        rec = {"step": step, "loss": round(loss.item(), 4), **{k: round(v, 4) for k, v in stats.items()},
               "s_per_step": round((time.time() - t1) / this_call, 2)}
        log.write(json.dumps(rec) + "\n")
        if step % 10 == 0:
            print(json.dumps(rec), flush=True)
        stop = bool(args.stop_after and this_call >= args.stop_after)
        if step % args.save_every == 0 or step == args.steps or stop:
            save_ckpt(run, drafter, opt, step)
        if step % args.eval_every == 0 or step == args.steps:
            ev = {"step": step, "eval": evaluate_blocks(objective, heldout), "elapsed_s": round(time.time() - t1)}
            print(json.dumps(ev), flush=True)
            log.write(json.dumps(ev) + "\n")
        log.flush()
        if stop:
            return
    if args.export:
        task.extra_config = {"specquant_training": {**{k: v for k, v in vars(args).items() if k != "export"},
                                                     "tokens_seen": args.steps * args.batch * len(train[0])}}
        task.export(Path(args.export), {f"drafter.{k}": v for k, v in drafter.state_dict().items()})
        print(f"exported {args.export}", flush=True)


if __name__ == "__main__":
    main()
