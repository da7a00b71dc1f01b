"""Train the bundled tiny-target or tiny-hybrid (CE on the corpus) or tiny-draft (KL to the target's logits).

Deterministic given --seed: batch i is drawn from a generator seeded by (seed, i), so a resumed run sees exactly the
batches an uninterrupted one would. Resumable: every --ckpt-every steps the model and AdamW state are written as
safetensors (never pickle) to --run-dir; rerunning the same command continues from the last checkpoint.
Runs on CPU (bf16 autocast) or CUDA. `--export DIR` writes the final weights as a bf16 HF checkpoint.

    python scripts/train_bundled.py --role target --steps 2000 --run-dir runs/target --export src/specquant/models/tiny-target
    python scripts/train_bundled.py --role draft --teacher src/specquant/models/tiny-target --steps 1500 \
        --run-dir runs/draft --export src/specquant/models/tiny-draft
    python scripts/train_bundled.py --role hybrid --steps 1200 --run-dir runs/hybrid --tokens data/tokens-heldout \
        --export src/specquant/models/tiny-hybrid       # as scripts/train_tiny_hybrid.sh runs it, in phases
    python scripts/train_bundled.py --evaluate src/specquant/models/tiny-target   # held-out perplexity of a checkpoint

--role hybrid is a Qwen3.5-style target (qwen3_5_text): Gated DeltaNet and gated full attention layers in the 3:1
pattern, zero-centred norms, partial RoPE, without the MTP layer (`specquant distill draft --kind mtp` trains that).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from specquant.model.checkpoint import save_model
from specquant.loader import load_model
from specquant.model.config import ModelConfig
from specquant.model.decoder import Transformer

# Architecture presets: 8k vocab, tied embeddings; Qwen3 layout unless HF_PRESETS names the role.
PRESETS = {
    # Sized by measurement on a 2-core CPU without bf16 matmul units (fp32 training, ~800 tok/s at this size):
    # the largest target that sees a few million tokens in about an hour.
    "target": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=6,
                   num_key_value_heads=2, head_dim=64),
    "draft": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64),
}
# Roles whose architecture is an HF config.json dict, built with ModelConfig.from_hf: the model trained is then
# exactly the one its exported checkpoint loads as (the hybrid's per-family flags are from_hf's to set).
HF_PRESETS = {
    # Qwen3.5's layout in miniature: every 4th layer full attention (full_attention_interval), DeltaNet value heads
    # twice its key heads, partial RoPE on a quarter of each head. Sized by measuring steps on this 2-core CPU at
    # one thread (docs/MODELS.md): the largest that sees enough tokens in the training budget.
    "hybrid": dict(model_type="qwen3_5_text", hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64, full_attention_interval=4,
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                   linear_value_head_dim=64, linear_conv_kernel_dim=4,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                   tie_word_embeddings=True, eos_token_id=0),
}
# residual-branch output projections of each layer kind: initialised smaller, scaled by depth (GPT-2)
RESIDUAL_OUT = ("o_proj.weight", "down_proj.weight", "out_proj.weight")
# 1-D parameters of a DeltaNet that are not norms: kept at the mixer's own init (A in transformers' range, dt_bias
# ones) and out of weight decay, as flash-linear-attention trains them
NO_DECAY = ("A_log", "dt_bias")


def model_config(role: str, vocab_size: int) -> ModelConfig:
    """The architecture of a role: PRESETS' Qwen3 layout, or HF_PRESETS' config.json read as a checkpoint's is."""
    if role in HF_PRESETS:
        return ModelConfig.from_hf({**HF_PRESETS[role], "vocab_size": vocab_size, "max_position_embeddings": 2048})
    return ModelConfig(vocab_size=vocab_size, max_position_embeddings=2048, rope_theta=10000.0, **PRESETS[role])


@dataclass
class TrainConfig:
    role: str = "target"
    steps: int = 2000
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 60
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 1234
    ckpt_every: int = 100
    eval_every: int = 200
    autocast_bf16: bool = False  # bf16 autocast only pays on CPUs with bf16 matmul units (AMX) or on CUDA
    log_every: int = 10


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def get_batch(data: np.ndarray, step: int, cfg: TrainConfig) -> torch.Tensor:
    rng = np.random.default_rng([cfg.seed, step])
    starts = rng.integers(0, len(data) - cfg.seq_len - 1, size=cfg.batch_size)
    return torch.from_numpy(np.stack([data[s : s + cfg.seq_len + 1].astype(np.int64) for s in starts]))


def save_ckpt(run_dir: Path, model, opt, step: int, cfg: TrainConfig):
    tensors = {f"model.{k}": v.detach().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    names = {id(p): n for n, p in model.named_parameters()}
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            if st:
                tensors[f"opt.{names[id(p)]}.exp_avg"] = st["exp_avg"].contiguous()
                tensors[f"opt.{names[id(p)]}.exp_avg_sq"] = st["exp_avg_sq"].contiguous()
                tensors[f"opt.{names[id(p)]}.step"] = torch.as_tensor(st["step"], dtype=torch.float32).reshape(1)
    tmp = run_dir / "ckpt.safetensors.tmp"
    save_file(tensors, tmp, metadata={"step": str(step), "train_config": json.dumps(asdict(cfg))})
    tmp.rename(run_dir / "ckpt.safetensors")


def load_ckpt(run_dir: Path, model, opt) -> int:
    path = run_dir / "ckpt.safetensors"
    if not path.exists():
        return 0
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        step = int(f.metadata()["step"])
    tensors = load_file(path)
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")}, strict=False)
    for n, p in model.named_parameters():
        if f"opt.{n}.exp_avg" in tensors:
            opt.state[p] = {
                "exp_avg": tensors[f"opt.{n}.exp_avg"],
                "exp_avg_sq": tensors[f"opt.{n}.exp_avg_sq"],
                "step": tensors[f"opt.{n}.step"].reshape(()),
            }
    return step


@torch.no_grad()
def evaluate(model, val: np.ndarray, cfg: TrainConfig, device, teacher=None, batches: int = 8) -> dict:
    model.eval()
    ev = TrainConfig(**{**asdict(cfg), "seed": cfg.seed + 999, "batch_size": 8})
    nll, n, agree = 0.0, 0, 0
    for i in range(batches):
        b = get_batch(val, i, ev).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.autocast_bf16):
            logits = model(b[:, :-1]).float()
        nll += F.cross_entropy(logits.flatten(0, 1), b[:, 1:].flatten(), reduction="sum").item()
        n += b[:, 1:].numel()
        if teacher is not None:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.autocast_bf16):
                t_logits = teacher(b[:, :-1]).float()
            agree += (t_logits.argmax(-1) == logits.argmax(-1)).sum().item()
    model.train()
    out = {"val_loss": nll / n, "val_ppl": math.exp(nll / n)}
    if teacher is not None:
        out["greedy_agreement"] = agree / n
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=[*PRESETS, *HF_PRESETS], default="target")
    ap.add_argument("--tokens", default="data/tokens")
    ap.add_argument("--run-dir", help="checkpoints and log.jsonl (required unless --evaluate)")
    ap.add_argument("--evaluate", metavar="MODEL", help="only print MODEL's held-out loss / perplexity on --tokens' "
                    "val.bin (the windows training evaluates on) and exit")
    ap.add_argument("--teacher", help="draft only: distil from this target checkpoint (KL on logits)")
    ap.add_argument("--tokenizer-from", default="src/specquant/models/tiny-target")
    ap.add_argument("--export", help="write final bf16 weights + tokenizer here")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--compile", action="store_true", help="torch.compile the step (helps on CUDA; slow to build on CPU)")
    ap.add_argument("--stop-after", type=int, default=0, help="stop (checkpointed) after this many steps this call")
    for f, v in asdict(TrainConfig()).items():
        if f == "role":
            continue
        if isinstance(v, bool):
            ap.add_argument(f"--{f.replace('_', '-')}", action="store_true", default=v)
        else:
            ap.add_argument(f"--{f.replace('_', '-')}", type=type(v), default=v)
    args = ap.parse_args()
    cfg = TrainConfig(**{f: getattr(args, f) for f in asdict(TrainConfig())})
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    val = np.memmap(Path(args.tokens) / "val.bin", dtype=np.uint16, mode="r")
    if args.evaluate:
        model = load_model(args.evaluate, dtype=torch.float32, device=device)
        print(json.dumps({"model": args.evaluate, **evaluate(model, val, cfg, device)}), flush=True)
        return
    if not args.run_dir:
        ap.error("--run-dir is required to train")
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    meta = json.loads((Path(args.tokens) / "meta.json").read_text())
    train = np.memmap(Path(args.tokens) / "train.bin", dtype=np.uint16, mode="r")

    torch.manual_seed(cfg.seed)
    mcfg = model_config(cfg.role, meta["vocab_size"])
    model = Transformer(mcfg).to(device)
    with torch.no_grad():  # GPT-2 style init: small normal weights, residual projections scaled by depth
        for n, p in model.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * mcfg.num_hidden_layers) if n.endswith(RESIDUAL_OUT) else 0.02
                torch.nn.init.normal_(p, std=std)
    teacher = None
    if cfg.role == "draft":
        if not args.teacher:
            ap.error("--role draft needs --teacher (the trained target)")
        teacher = load_model(args.teacher, dtype=torch.bfloat16 if cfg.autocast_bf16 else torch.float32, device=device)
        for p in teacher.parameters():
            p.requires_grad_(False)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and not n.endswith(NO_DECAY)]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or n.endswith(NO_DECAY)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    step = load_ckpt(run_dir, model, opt)
    print(f"{cfg.role}: {model.num_parameters() / 1e6:.2f}M params, start step {step}/{cfg.steps}", flush=True)
    fwd = torch.compile(model) if args.compile else model
    tfwd = torch.compile(teacher) if teacher is not None and args.compile else None
    log = open(run_dir / "log.jsonl", "a")
    t0, tokens_done, done_this_call = time.time(), 0, 0
    while step < cfg.steps:
        b = get_batch(train, step, cfg).to(device)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.autocast_bf16):
            logits = fwd(b[:, :-1])
            if teacher is None:
                loss = F.cross_entropy(logits.float().flatten(0, 1), b[:, 1:].flatten())
            else:
                with torch.no_grad():
                    t_logp = F.log_softmax((tfwd or teacher)(b[:, :-1]).float(), -1)
                s_logp = F.log_softmax(logits.float(), -1)
                # forward KL(teacher || draft), T=1, full vocabulary, mean over tokens
                loss = (t_logp.exp() * (t_logp - s_logp)).sum(-1).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        done_this_call += 1
        tokens_done += b[:, :-1].numel()
        if step % cfg.log_every == 0:
            rate = tokens_done / (time.time() - t0)
            rec = {"step": step, "loss": round(loss.item(), 4), "lr": lr_at(step, cfg), "tok_s": round(rate)}
            print(json.dumps(rec), flush=True)
            log.write(json.dumps(rec) + "\n")
            log.flush()
        stopping = bool(args.stop_after and done_this_call >= args.stop_after)
        if step % cfg.ckpt_every == 0 or step == cfg.steps or stopping:
            save_ckpt(run_dir, model, opt, step, cfg)
        if step % cfg.eval_every == 0 or step == cfg.steps or stopping:
            ev = evaluate(model, val, cfg, device, teacher)
            rec = {"step": step, **{k: round(v, 4) for k, v in ev.items()}, "elapsed_s": round(time.time() - t0)}
            print(json.dumps(rec), flush=True)
            log.write(json.dumps(rec) + "\n")
            log.flush()
        if stopping:
            break
    if step >= cfg.steps and args.export:
        save_model(model.to(torch.bfloat16).cpu(), args.export, tokenizer_from=args.tokenizer_from,
                   extra_config={"specquant_training": {**asdict(cfg), "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len}})
        print(f"exported {args.export}", flush=True)


if __name__ == "__main__":
    main()
