"""Training objective of the block drafter (REFERENCE.md §3): many blocks per sequence in one forward.

Per sequence: the frozen target runs once (teacher-forced) and its chosen layers' outputs are the context features;
`num_anchors` anchors are drawn uniformly among the trainable positions; every block [token at a, MASK x (B-1)] sees
the context strictly before a and itself (bidirectionally), never another block; the loss is cross-entropy on
block positions 1..B-1 weighted by exp(-(k-1)/gamma).

Labels: "data" trains on the data tokens (the reference: the data are the target's own generations, `specquant
regen`); "target" replaces them by the target's greedy prediction at each position, for corpus text the target did
not write.

`BlockDraftTask` follows the shared trainer's task protocol (train/trainer.py on the `qad` branch): `module.forward
(tokens) -> (loss, stats)`, `evaluate()`, `check_start()`, `export()`. Anchors come from torch's global RNG, whose
state the trainer checkpoints, so a resumed run draws the same anchors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specquant.errors import SpecquantError
from specquant.model.block_draft import BlockDraftModel
from specquant.model.checkpoint import save_block_drafter
from specquant.train.trainer import HeldoutTask, bf16_state

LABELS = ("data", "target")


@dataclass
class BlockDraftTrainConfig:
    """Defaults of the block drafter's objective (the optimizer/schedule live in the shared TrainConfig)."""

    num_anchors: int = field(default=16, metadata={"help": "blocks drawn per sequence (the reference draws 512 at "
                                                           "3072 tokens; 16 at 256 tokens is the same density)"})
    gamma: float = field(default=7.0, metadata={"help": "position weight exp(-(k-1)/gamma) of block position k"})
    labels: str = field(default="data", metadata={"help": "data: the data tokens (regen text); target: the "
                                                          "target's greedy prediction at each position (corpus text)",
                                                  "choices": LABELS})
    eval_samples: int = field(default=16, metadata={"help": "held-out sequences per evaluation"})

    def validate(self) -> "BlockDraftTrainConfig":
        if self.num_anchors < 1:
            raise SpecquantError(f"num_anchors={self.num_anchors} must be >= 1")
        if not self.gamma > 0:
            raise SpecquantError(f"gamma={self.gamma} must be > 0")
        if self.labels not in LABELS:
            raise SpecquantError(f"labels {self.labels!r} is unknown; use one of {', '.join(LABELS)}")
        return self


def position_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """Loss weight of block positions 1..B-1: exp(-(k-1)/gamma); early positions matter most for acceptance."""
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def block_loss(logits: torch.Tensor, labels: torch.Tensor, anchors: torch.Tensor, gamma: float,
               valid: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Weighted CE over block positions 1..B-1.

    logits [b, A, B-1, vocab]; labels [b, L]: the token expected at each position; anchors [b, A];
    valid [b, L] bool: positions whose label is trained (default all). Returns (loss, {per-position accuracy}).
    """
    b, A, K, V = logits.shape
    L = labels.shape[1]
    pos = anchors[:, :, None] + torch.arange(1, K + 1, device=anchors.device)  # [b, A, K]
    inside = pos < L
    pos_c = pos.clamp(max=L - 1)
    target = labels.gather(1, pos_c.reshape(b, -1)).view(b, A, K)
    ok = inside if valid is None else inside & valid.gather(1, pos_c.reshape(b, -1)).view(b, A, K)
    w = position_weights(K + 1, gamma, logits.device)[None, None, :] * ok
    ce = F.cross_entropy(logits.float().reshape(-1, V), target.reshape(-1), reduction="none").view(b, A, K)
    loss = (ce * w).sum() / w.sum().clamp(min=1e-9)
    ce = ce.detach()
    with torch.no_grad():
        hit = (logits.argmax(-1) == target) & ok
        acc = hit.sum((0, 1)).float() / ok.sum((0, 1)).clamp(min=1)
        # accepted length of each block under greedy verification: the run of hits from position 1
        run = torch.cumprod(hit.long(), dim=-1).sum(-1).float()
    return loss, {"acc_per_pos": acc.tolist(), "mean_run": float(run.mean()), "ce": float(ce[ok].mean()) if ok.any()
                  else math.nan}


class BlockDraftObjective(nn.Module):
    """forward(tokens [b, L]) -> (weighted block CE, stats); only the drafter is a registered submodule."""

    def __init__(self, drafter: BlockDraftModel, target, cfg: BlockDraftTrainConfig):
        super().__init__()
        self.drafter = drafter
        self.cfg = cfg.validate()
        self._target = (target,)  # frozen teacher: kept out of the registered submodules (DDP wraps the drafter)
        for p in target.parameters():
            p.requires_grad_(False)
        drafter.attach_target(target)

    @property
    def target(self):
        return self._target[0]

    @torch.no_grad()
    def teacher(self, tokens: torch.Tensor, labels: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [b, L] -> (features [b, L, taps*hidden], labels [b, L]: the token expected at each position).
        labels: override cfg.labels (evaluation always scores against the target's own predictions)."""
        mode = labels or self.cfg.labels
        target = self.target
        was_training = target.training
        target.eval()
        # hidden_only: the lm_head's logits are needed only for "target" labels
        logits, hidden = target(tokens, hidden_layers=tuple(self.drafter.config.target_layer_ids),
                                hidden_only=mode != "target")
        target.train(was_training)
        if mode == "target":  # label at position t = the target's argmax given tokens[:t]
            labels = torch.cat((tokens[:, :1], logits[:, :-1].argmax(-1)), 1)
        else:
            labels = tokens
        return hidden.flatten(2), labels

    def forward(self, tokens: torch.Tensor, features: torch.Tensor | None = None, labels: torch.Tensor | None = None):
        """tokens [b, L]; features/labels: the teacher's outputs when precomputed (data reused over epochs)."""
        b, L = tokens.shape
        B = self.drafter.config.block_size
        if features is None:
            features, labels = self.teacher(tokens)
        features = features.to(self.drafter.norm.weight.dtype)
        # an anchor needs some context before it and at least one label after it
        valid = torch.zeros(b, L, dtype=torch.bool, device=tokens.device)
        valid[:, 1 : L - 1] = True
        scores = torch.rand(b, L, device=tokens.device).masked_fill(~valid, -1.0)
        anchors = scores.topk(min(self.cfg.num_anchors, L - 2), dim=1).indices.sort(dim=1).values
        logits = self.drafter.block_logits(features, tokens, anchors)
        loss, stats = block_loss(logits, labels, anchors, self.cfg.gamma)
        acc = stats.pop("acc_per_pos")
        stats.update({"acc1": acc[0], f"acc{B - 1}": acc[-1]})
        return loss, stats


@torch.no_grad()
def evaluate_blocks(objective: BlockDraftObjective, blocks: torch.Tensor, batch: int = 8, seed: int = 999) -> dict:
    """Held-out metrics with fixed anchors, against the target's greedy predictions: weighted CE, per-position
    accuracy and the mean greedy run length. The run length is a teacher-forced proxy of acceptance (position k's
    label is the target's prediction given the data prefix, not given the drafted one); `specquant bench` and
    benchmarks/block_draft.py at dfedb37 measure the real mean acceptance length."""
    was = objective.drafter.training
    objective.drafter.eval()
    state = torch.get_rng_state()
    torch.manual_seed(seed)  # the same anchors at every evaluation, without disturbing the training RNG stream
    tot, n, run, acc = 0.0, 0, 0.0, None
    try:
        for i in range(0, len(blocks), batch):
            tokens = blocks[i : i + batch]
            features, labels = objective.teacher(tokens, labels="target")
            L = tokens.shape[1]
            scores = torch.rand(tokens.shape, device=tokens.device).masked_fill(
                torch.arange(L, device=tokens.device)[None] < 1, -1.0)
            scores[:, L - 1] = -1.0
            anchors = scores.topk(min(objective.cfg.num_anchors, L - 2), dim=1).indices.sort(dim=1).values
            logits = objective.drafter.block_logits(features, tokens, anchors)
            loss, st = block_loss(logits, labels, anchors, objective.cfg.gamma)
            m = len(tokens)
            tot, run, n = tot + float(loss) * m, run + st["mean_run"] * m, n + m
            a = torch.tensor(st["acc_per_pos"]) * m
            acc = a if acc is None else acc + a
    finally:
        torch.set_rng_state(state)
        objective.drafter.train(was)
    return {"loss": tot / n, "mean_run": run / n, "acc_per_pos": [round(float(x), 4) for x in acc / n]}


class BlockDraftTask(HeldoutTask):
    """The shared trainer's task: train `module` (the objective), evaluate on held-out blocks, export the drafter."""

    best_key = "loss"

    def evaluate(self) -> dict:
        ev = evaluate_blocks(self.module, self.heldout)
        return {"loss": ev["loss"], "acceptance_proxy": 1 + ev["mean_run"], "acc1": ev["acc_per_pos"][0]}

    def check_start(self, metrics: dict) -> None:
        if not metrics["loss"] < 1e4:
            raise SpecquantError(f"held-out block loss at step 0 is {metrics['loss']}; the target or data is broken")

    def export(self, out_dir: Path, state: dict[str, torch.Tensor]) -> None:
        drafter = self.module.drafter
        tensors = bf16_state(state, "drafter.")
        save_block_drafter(drafter, out_dir, extra_config=self.extra_config, tensors=tensors,
                           tokenizer_from=self.tokenizer_from)


@torch.no_grad()
def greedy_acceptance(drafter: BlockDraftModel, target, prompts: list[torch.Tensor], new_tokens: int, k: int):
    """Exact greedy speculative-decoding acceptance of the block drafter, without running the engine.

    Greedy speculative decoding emits exactly the target's greedy continuation, so each step accepts the longest
    prefix of the draft that matches it. One target greedy generation and one teacher-forced pass per prompt give
    that continuation and every position's features; then each step is one drafter forward. Returns a SpecMetrics
    (vLLM's counters: mean acceptance length, per-position acceptance) equal to what SpecEngine would record."""
    from specquant.spec_decode.engine import generate
    from specquant.spec_decode.metrics import SpecMetrics

    metrics = SpecMetrics()
    ids = tuple(drafter.config.target_layer_ids)
    for prompt in prompts:  # [1, P]
        p = prompt.shape[1]
        cont = generate(target, prompt, new_tokens, stop_on_eos=False).token_ids[0]
        seq = torch.cat([prompt, torch.tensor([cont], device=prompt.device)], 1)  # [1, P + new_tokens]
        target.clear_cache()
        _, hidden = target(seq, hidden_layers=ids, hidden_only=True)
        features = hidden.flatten(2).to(drafter.norm.weight.dtype)
        drafter.setup_cache(seq.shape[1] + drafter.config.block_size)
        n, end = p + 1, p + new_tokens  # committed: the prompt and the prefill's token
        while n < end:
            kk = min(k, end - n - 1)
            if kk <= 0:
                break
            drafter.append_context(features[:, drafter.context_len : n - 1])
            draft = drafter.propose(seq[0, n - 1], kk).argmax(-1)
            hits = (draft == seq[0, n : n + kk]).long()
            accepted = int(hits.cumprod(0).sum())
            metrics.record_step(kk, accepted)
            n += accepted + 1
    return metrics
