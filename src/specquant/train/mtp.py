"""Training objective of the MTP drafter (`specquant distill draft --kind mtp`), on the shared trainer.

Per sequence x_0..x_{L-1}: the frozen target runs once (teacher-forced) and gives its post-norm hidden states h_i
and its next-token logits. The MTP runs cache-free over the L-1 pairs (h_i, x_{i+1}) (model/mtp.py), so its
output at i drafts x_{i+2}: the first draft of a step whose last exact position is i. With --mtp-steps S > 1 it also
replays the chained drafts 2..S of every such step (chained_outputs: its own output fed back at the next position
with the data's next token, attending to exactly what the drafter's cache holds then). The loss is the forward
KL(target || MTP) of each draft against the target's distribution for the token it drafts, over the full
vocabulary and through the target's lm_head, in chunks of positions; the mean over draft levels.

Only the MTP layer trains: the embedding and lm_head are the target's (shared, frozen), and the target is kept out
of the registered submodules. The objective's submodule is named `mtp`, so its state-dict names are the checkpoint
names (mtp.fc.weight, ...).

Stages (train/draft.py): stage 1 against the high-precision target, starting from --init (an MTP drafter
directory), else the target's own mtp.* tensors, else a fresh layer from `init_mtp`; stage 2 warm-starts from stage
1's best and adapts it to the W4 target's hidden states and distribution. `write_into_target` puts a trained layer's
tensors into a copy of a target checkpoint, so `--draft mtp` finds them there.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specquant.errors import SpecquantError
from specquant.model.mtp import MTPModel, mtp_from_tensors, mtp_layers_in, mtp_tensors, save_mtp_drafter
from specquant.train.trainer import HeldoutTask, bf16_state


def init_mtp(mtp: MTPModel, target, seed: int) -> MTPModel:
    """A fresh MTP layer that starts by reading the target's hidden state: layers.0 is a copy of the target's last
    full-attention layer (the same kind and shape), fc passes the hidden half through unchanged and reads the
    embedding half with a small random weight, and the output norm is the target's final norm."""
    if target.quantization:
        raise SpecquantError("a fresh MTP layer is copied from the high-precision target's layers, and this target "
                             "is quantized; train stage 1 against the fp target (--stage1-target) or pass --init")
    g = torch.Generator().manual_seed(seed)
    kinds = [layer.layer_type for layer in target.model.layers]
    full = [i for i, k in enumerate(kinds) if k == mtp.layers[0].layer_type]
    if not full:
        raise SpecquantError("the target has no full-attention layer to start the MTP layer from; pass --init")
    h = mtp.config.hidden_size
    with torch.no_grad():
        for layer in mtp.layers:
            layer.load_state_dict(target.model.layers[full[-1]].state_dict())
        mtp.fc.weight.zero_()
        mtp.fc.weight[:, :h].copy_(torch.randn(h, h, generator=g) * 0.02)
        mtp.fc.weight[:, h:].copy_(torch.eye(h))
        mtp.norm.weight.copy_(target.model.norm.weight)
    return mtp


def starting_mtp(target, init, seed: int, device) -> MTPModel:
    """Stage 1's / stage 2's MTP layer: --init's directory, else the target's mtp.*, else init_mtp."""
    dtype = target.model.embed_tokens.weight.dtype
    if init:
        from specquant.drafter_loader import load_mtp_drafter

        model = load_mtp_drafter(init, dtype, device)
        if model.quantization:
            raise SpecquantError(f"--init {init} is a W4 MTP drafter; train the dense one, then quantize it")
    elif target.extra_tensors and mtp_layers_in(target.extra_tensors):
        model = mtp_from_tensors(target.config, target.extra_tensors, dtype, device)
    else:
        model = init_mtp(MTPModel(target.config).to(device=device, dtype=dtype), target, seed)
    if (model.config.hidden_size, model.config.vocab_size) != (target.config.hidden_size, target.config.vocab_size):
        raise SpecquantError(f"--init {init} is an MTP layer of hidden size {model.config.hidden_size}; the target's "
                             f"is {target.config.hidden_size}: use one made for this target")
    return model.train()


def chain_layout(n: int, steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The entries of a chained replay over n exact positions: (level [E], position [E], mask [E, E] bool).

    Level 0 is entry (h_p, x_{p+1}) at position p = 0..n-1, built from the target. Level s >= 1 of anchor a
    (a = 0..n-1-s) is the s-th chained draft of a step whose last exact position is a: it sits at position a + s and
    sees what the drafter's cache holds then, the exact entries at positions <= a and its own anchor's chained
    entries of levels 1..s (spec_decode/drafters/mtp.py)."""
    level = torch.cat([torch.full((n - s,), s) for s in range(steps)])
    anchor = torch.cat([torch.arange(n - s) for s in range(steps)])
    pos = anchor + level
    exact = (level == 0)[None, :] & (pos[None, :] <= anchor[:, None])
    chained = ((level[:, None] >= 1) & (level[None, :] >= 1) & (anchor[None, :] == anchor[:, None])
               & (level[None, :] <= level[:, None]))
    return level, pos, exact | chained


def chained_outputs(mtp: MTPModel, hidden: torch.Tensor, tokens: torch.Tensor, embed: nn.Module,
                    steps: int) -> list[torch.Tensor]:
    """hidden [b, L, H] (the target's, post-norm), tokens [b, L] -> [g of level s: [b, L-1-s, H] for s < steps]:
    the MTP's output of every draft a speculative step of `steps` drafts makes, teacher-forced (the drafted tokens
    are the data's). Level s at anchor a drafts x_{a+s+2}. Level s runs on every level below it (one cache-free
    forward with chain_layout's mask), the way the drafter's KV cache holds them."""
    n = tokens.shape[1] - 1
    outs = [mtp(hidden[:, :-1], embed(tokens[:, 1:]))]  # level 0: causal over the exact entries
    for s in range(1, min(steps, n)):
        _, pos, mask = chain_layout(n, s + 1)
        inputs = torch.cat([hidden[:, :-1]] + [outs[r - 1][:, : n - r] for r in range(1, s + 1)], 1)
        next_tokens = torch.cat([tokens[:, 1:]] + [tokens[:, r + 1 :] for r in range(1, s + 1)], 1)
        g = mtp(inputs, embed(next_tokens), positions=pos.to(tokens.device), mask=mask.to(tokens.device))
        outs.append(g[:, -(n - s) :])
    return outs


class MTPObjective(nn.Module):
    """forward(tokens [b, L]) -> (mean over draft levels of KL(target || MTP) per position, stats); only the MTP
    layer is a registered submodule."""

    def __init__(self, mtp: MTPModel, target, kl_chunk: int = 256, steps: int = 1):
        super().__init__()
        self.mtp = mtp
        self.kl_chunk, self.steps = kl_chunk, steps
        self._target = (target,)  # frozen teacher: out of the registered submodules (DDP wraps the MTP only)
        for p in target.parameters():
            p.requires_grad_(False)

    @property
    def target(self):
        return self._target[0]

    def _kl(self, g: torch.Tensor, target_hidden: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Mean KL(target || MTP) and top-1 agreement of g [b, T, H] against the target at target_hidden [b, T, H]."""
        head = self.target.lm_head
        total, agree = g.new_zeros((), dtype=torch.float32), 0
        for s in range(0, g.shape[1], self.kl_chunk):
            e = min(g.shape[1], s + self.kl_chunk)
            with torch.no_grad():
                target_logp = F.log_softmax(head(target_hidden[:, s:e]).float(), -1)
            draft_logp = F.log_softmax(head(g[:, s:e]).float(), -1)
            total = total + F.kl_div(draft_logp, target_logp, log_target=True, reduction="sum")
            agree += int((draft_logp.argmax(-1) == target_logp.argmax(-1)).sum())
        count = g.shape[0] * g.shape[1]
        return total / count, agree / count

    def forward(self, tokens: torch.Tensor):
        target = self.target
        with torch.no_grad():
            was = target.training
            target.eval()
            target.clear_cache()
            hidden = target(tokens, hidden_only=True)  # [b, L, H] after the final norm
            target.train(was)
        levels = chained_outputs(self.mtp, hidden, tokens, target.model.embed_tokens, self.steps)
        losses, stats = [], {}
        for s, g in enumerate(levels):
            # level s drafts x_{a+s+2}: the target's distribution for it is its output at position a+s+1
            kl, agree = self._kl(g, hidden[:, s + 1 :])
            losses.append(kl)
            stats[f"top1_agree_{s + 1}"] = agree
        stats["top1_agree"] = stats.pop("top1_agree_1")
        return torch.stack(losses).mean(), stats


@torch.no_grad()
def evaluate_mtp(objective: MTPObjective, tokens: torch.Tensor, batch: int = 8) -> dict:
    """Held-out KL(target || MTP), mean over draft levels, and top-1 agreement of each level's draft (a
    teacher-forced proxy of per-position acceptance: the rate at which that draft is the target's greedy token)."""
    was = objective.mtp.training
    objective.mtp.eval()
    sums, n = {}, 0
    try:
        for i in range(0, len(tokens), batch):
            loss, stats = objective(tokens[i : i + batch])
            m = len(tokens[i : i + batch])
            for k, v in {"kl": float(loss), **stats}.items():
                sums[k] = sums.get(k, 0.0) + v * m
            n += m
    finally:
        objective.mtp.train(was)
    return {k: v / n for k, v in sums.items()}


class MTPTask(HeldoutTask):
    """The shared trainer's task: train the MTP layer, evaluate on held-out text, export an MTP drafter directory."""

    best_key = "kl"

    def evaluate(self) -> dict:
        return evaluate_mtp(self.module, self.heldout)

    def check_start(self, metrics: dict) -> None:
        if not math.isfinite(metrics["kl"]) or not metrics["kl"] < 1e3:
            raise SpecquantError(f"held-out KL of the MTP layer at step 0 is {metrics['kl']}; the target or its "
                                 "mtp.* tensors are broken")

    def export(self, out_dir: Path, state: dict[str, torch.Tensor]) -> None:
        tensors = bf16_state(state, "mtp.")
        save_mtp_drafter(self.module.mtp, out_dir, tensors=tensors, tokenizer_from=self.tokenizer_from,
                         extra_config={"torch_dtype": "bfloat16", **self.extra_config})


def mtp_task(target, target_dir, tokenizer, cfg, bcfg, eval_tokens, init, seed, meta, dtype=None, device=None):
    """train/draft.py's OBJECTIVES row for --kind mtp."""
    device = target.model.embed_tokens.weight.device
    mtp = starting_mtp(target, init, seed, device)
    return MTPTask(MTPObjective(mtp, target, cfg.kl_chunk, cfg.mtp_steps), eval_tokens, tokenizer_from=target_dir,
                   extra_config={"specquant_distill_draft": meta})


def write_into_target(mtp_dir, target_dir, out, overwrite: bool = False) -> Path:
    """A copy of the target checkpoint at `out` whose mtp.* tensors are the MTP drafter directory's (any the
    target had are replaced), so `--draft mtp` on that target drafts with them. A sharded target is refused."""
    from safetensors.torch import save_file

    from specquant.drafter_loader import load_mtp_drafter
    from specquant.model.checkpoint import load_tensors, read_hf_config, resolve
    from specquant.util.files import atomic_dir

    target_dir, mtp_dir = resolve(target_dir), resolve(mtp_dir)
    if not (target_dir / "model.safetensors").exists():
        raise SpecquantError(f"{target_dir} has no single model.safetensors (sharded?); write the MTP layer into a "
                             "single-file checkpoint")
    mtp = load_mtp_drafter(mtp_dir)
    if mtp.quantization:
        raise SpecquantError(f"{mtp_dir} is a W4 MTP drafter; a target checkpoint keeps its mtp.* tensors dense "
                             "(as Qwen3.5 ships them): write the dense one")
    tensors = {k: v for k, v in load_tensors(target_dir).items() if not k.startswith("mtp.")}
    dtype = next(v.dtype for k, v in tensors.items() if k.endswith("embed_tokens.weight"))
    tensors.update({k: v.to(dtype) for k, v in mtp_tensors(mtp).items()})
    hf = read_hf_config(target_dir)
    hf["mtp_num_hidden_layers"] = len(mtp.layers)  # Qwen3_5TextConfig's field
    with atomic_dir(Path(out), overwrite) as tmp:
        for f in target_dir.iterdir():
            if f.is_file() and f.name not in ("model.safetensors", "config.json"):
                shutil.copy2(f, tmp / f.name)
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp / "model.safetensors",
                  metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    return Path(out)
