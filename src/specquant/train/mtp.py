"""Training objective of the MTP drafter (`specquant distill draft --kind mtp`), on the shared trainer.

Per sequence x_0..x_{L-1}: the frozen target runs once (teacher-forced) and gives its post-norm hidden states h_i
and its next-token logits. The MTP runs cache-free over the L-1 pairs (h_i, x_{i+1}) (model/mtp.py), so its
output at i drafts x_{i+2}; the loss is the forward KL(target || MTP) between the target's distribution at position
i+1 (what the target predicts for x_{i+2}) and the MTP's, over the full vocabulary, both through the target's
lm_head, in chunks of positions. This is the first draft of every speculative step, scored against what the verifier
accepts; chained drafts (k > 1) reuse the same layer on its own output, as Qwen3.5 does, and are not trained apart.

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


class MTPObjective(nn.Module):
    """forward(tokens [b, L]) -> (KL(target || MTP) per position, stats); only the MTP layer is a submodule."""

    def __init__(self, mtp: MTPModel, target, kl_chunk: int = 256):
        super().__init__()
        self.mtp = mtp
        self.kl_chunk = kl_chunk
        self._target = (target,)  # frozen teacher: out of the registered submodules (DDP wraps the MTP only)
        for p in target.parameters():
            p.requires_grad_(False)

    @property
    def target(self):
        return self._target[0]

    def forward(self, tokens: torch.Tensor):
        target = self.target
        with torch.no_grad():
            was = target.training
            target.eval()
            target.clear_cache()
            hidden = target(tokens, hidden_only=True)  # [b, L, H] after the final norm
            target.train(was)
            embeds = target.model.embed_tokens(tokens[:, 1:])
        g = self.mtp(hidden[:, :-1], embeds)  # [b, L-1, H]: position i drafts x_{i+2}
        head = target.lm_head
        # target's distribution for x_{i+2} is its output at position i+1; the last MTP position has no label
        n = g.shape[1] - 1
        total, agree = g.new_zeros(()), 0
        for s in range(0, n, self.kl_chunk):
            e = min(n, s + self.kl_chunk)
            with torch.no_grad():
                target_logp = F.log_softmax(head(hidden[:, s + 1 : e + 1]).float(), -1)
            draft_logp = F.log_softmax(head(g[:, s:e]).float(), -1)
            kl = F.kl_div(draft_logp, target_logp, log_target=True, reduction="none").sum(-1)  # [b, e-s]
            total = total + kl.sum()
            agree += int((draft_logp.argmax(-1) == target_logp.argmax(-1)).sum())
        count = g.shape[0] * n
        return total / count, {"top1_agree": agree / count}


@torch.no_grad()
def evaluate_mtp(objective: MTPObjective, tokens: torch.Tensor, batch: int = 8) -> dict:
    """Held-out KL(target || MTP) and top-1 agreement of the first draft (a teacher-forced proxy of its greedy
    acceptance: the rate at which the first draft equals the target's greedy token)."""
    was = objective.mtp.training
    objective.mtp.eval()
    kl, agree, n = 0.0, 0.0, 0
    try:
        for i in range(0, len(tokens), batch):
            loss, stats = objective(tokens[i : i + batch])
            m = len(tokens[i : i + batch])
            kl, agree, n = kl + float(loss) * m, agree + stats["top1_agree"] * m, n + m
    finally:
        objective.mtp.train(was)
    return {"kl": kl / n, "top1_agree": agree / n}


class MTPTask:
    """The shared trainer's task: train the MTP layer, evaluate on held-out text, export an MTP drafter directory."""

    best_key = "kl"

    def __init__(self, objective: MTPObjective, heldout: torch.Tensor, tokenizer_from=None,
                 extra_config: dict | None = None):
        self.module = objective
        self.heldout = heldout
        self.tokenizer_from = tokenizer_from
        self.extra_config = extra_config or {}

    def evaluate(self) -> dict:
        return evaluate_mtp(self.module, self.heldout)

    def check_start(self, metrics: dict) -> None:
        if not math.isfinite(metrics["kl"]) or not metrics["kl"] < 1e3:
            raise SpecquantError(f"held-out KL of the MTP layer at step 0 is {metrics['kl']}; the target or its "
                                 "mtp.* tensors are broken")

    def export(self, out_dir: Path, state: dict[str, torch.Tensor]) -> None:
        tensors = {k.removeprefix("mtp."): v.to(torch.bfloat16) if v.is_floating_point() else v
                   for k, v in state.items() if k.startswith("mtp.")}
        save_mtp_drafter(self.module.mtp, out_dir, tensors=tensors, tokenizer_from=self.tokenizer_from,
                         extra_config={"torch_dtype": "bfloat16", **self.extra_config})


def mtp_task(target, target_dir, tokenizer, cfg, bcfg, eval_tokens, init, seed, meta, dtype=None, device=None):
    """train/draft.py's OBJECTIVES row for --kind mtp."""
    device = target.model.embed_tokens.weight.device
    mtp = starting_mtp(target, init, seed, device)
    return MTPTask(MTPObjective(mtp, target, cfg.kl_chunk), eval_tokens, tokenizer_from=target_dir,
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
