"""TrainConfig (the shared training loop) and QADConfig (distilling the W4 target on its frozen grid): the one home
of their defaults; the `distill` CLI flags are built from these fields."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from specquant.errors import SpecquantError, require_positive

OPTIMIZERS = ("auto", "adamw", "adamw8bit")
STRATEGIES = ("ddp", "fsdp")


@dataclass
class TrainConfig:
    """Everything the shared loop (train/trainer.py) needs; nothing model-specific."""

    # Defaults: QAD of the bundled 15.7M target on CPU (docs/QAD.md). lr: a code moves only when its latent weight
    # drifts half a grid step (median scale 0.008 there, so 0.004); Adam moves a weight ~lr per step, so 2e-4 lets
    # a consistently pushed code move after ~20 steps while gradient noise rarely gets that far in 200. Measured:
    # 2e-4 recovered 73% / 70% of the AWQ gap at g32 / g128, 1e-4 65% / 58.5%; 1e-3 raised the training KL
    # ten-fold within 10 steps. The reference's 2e-6 is for a 4B model trained 5000 steps.
    steps: int = field(default=200, metadata={"help": "optimizer steps"})
    lr: float = field(default=2e-4, metadata={"help": "peak learning rate (after warm-up)"})
    min_lr_ratio: float = field(default=0.0, metadata={"help": "cosine floor as a fraction of --lr"})
    warmup: int = field(default=10, metadata={"help": "linear warm-up steps"})
    batch: int = field(default=4, metadata={"help": "sequences per micro-batch per process"})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    seq_len: int = field(default=64, metadata={"help": "tokens per training sequence"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    beta1: float = field(default=0.9, metadata={"help": "AdamW beta1"})
    beta2: float = field(default=0.95, metadata={"help": "AdamW beta2"})
    eps: float = field(default=1e-8, metadata={"help": "AdamW epsilon"})
    grad_clip: float = field(default=1.0, metadata={"help": "clip the global gradient norm to this (0 = off)"})
    optimizer: str = field(default="auto", metadata={
        "help": "auto = bitsandbytes' 8-bit AdamW on CUDA when installed, else torch's AdamW", "choices": OPTIMIZERS})
    eval_every: int = field(default=50, metadata={"help": "held-out evaluation every N steps (0 = start and end only)"})
    save_every: int = field(default=50, metadata={"help": "checkpoint every N steps"})
    keep_checkpoints: int = field(default=2, metadata={"help": "newest checkpoints kept on disk"})
    log_every: int = field(default=1, metadata={"help": "log.jsonl line every N steps"})
    seed: int = field(default=0, metadata={"help": "seed for data order and any randomness in the loss"})
    strategy: str = field(default="ddp", metadata={
        "help": "multi-process wrapping under torchrun: ddp, or fsdp for models that do not fit one device",
        "choices": STRATEGIES})

    def validate(self) -> "TrainConfig":
        require_positive(self, ("steps", "batch", "grad_accum", "seq_len", "save_every", "keep_checkpoints",
                                "log_every"))
        for name in ("warmup", "eval_every"):
            if getattr(self, name) < 0:
                raise SpecquantError(f"{name}={getattr(self, name)} must be >= 0")
        if not self.lr > 0:
            raise SpecquantError(f"lr={self.lr} must be > 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise SpecquantError(f"min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise SpecquantError(f"betas ({self.beta1}, {self.beta2}) must be in [0, 1)")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise SpecquantError("grad_clip and weight_decay must be >= 0")
        if self.optimizer not in OPTIMIZERS:
            raise SpecquantError(f"optimizer {self.optimizer!r} is unknown; use one of {', '.join(OPTIMIZERS)}")
        if self.strategy not in STRATEGIES:
            raise SpecquantError(f"strategy {self.strategy!r} is unknown; use one of {', '.join(STRATEGIES)}")
        return self

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


# Fields whose change makes a resumed run a different run (steps may grow: the cosine is then re-shaped, which
# the checkpoint records, so it is allowed but logged).
RESUME_KEYS = ("lr", "min_lr_ratio", "warmup", "batch", "grad_accum", "seq_len", "weight_decay", "beta1", "beta2",
               "eps", "grad_clip", "seed")


@dataclass
class QADConfig:
    """Quantization-aware distillation of a W4 checkpoint toward its high-precision self (train/qad.py)."""

    max_start_kl: float = field(default=0.5, metadata={
        "help": "refuse to train when the step-0 held-out KL(teacher || student) is above this: a wrong teacher or "
                "a broken grid (the reference recipe gates at 0.005 from the expected start value)"})
    kl_chunk: int = field(default=256, metadata={
        "help": "positions per KL chunk; logits exist for one chunk at a time, so memory is bounded in seq_len"})
    train_norms: bool = field(default=False, metadata={"help": "also train RMSNorm weights (kept frozen by default)"})
    train_embeddings: bool = field(default=False, metadata={
        "help": "also train embed_tokens / lm_head (frozen by default; tied in the bundled models)"})
    heldout: str | None = field(default=None, metadata={
        "help": "held-out text for evaluation (default: bundled heldout.txt, never used for training)"})
    eval_samples: int = field(default=32, metadata={"help": "held-out sequences per evaluation"})
    eval_seq_len: int = field(default=256, metadata={"help": "tokens per held-out sequence"})

    def validate(self) -> "QADConfig":
        if not self.max_start_kl > 0:
            raise SpecquantError(f"max_start_kl={self.max_start_kl} must be > 0")
        require_positive(self, ("kl_chunk", "eval_samples", "eval_seq_len"))
        return self

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class LeanConfig:
    """Lean QAD (train/lean_qad.py): the student trained one decoder block at a time against the teacher's block
    outputs, the teacher read layer by layer from its files, so memory holds one block, not the model."""

    lean: bool = field(default=False, metadata={
        "help": "block-wise QAD whose memory does not grow with the model (docs/QAD.md: which mode for which "
                "hardware); single process", "store_true": True})
    lean_samples: int = field(default=0, metadata={
        "help": "training sequences whose activations each block trains on (0 = steps x batch x grad-accum: the "
                "rows full QAD reads, so both see the same tokens)"})
    lean_forward_batch: int = field(default=8, metadata={
        "help": "sequences per no-grad pass when the teacher's blocks and the trained blocks map activations on"})

    def validate(self) -> "LeanConfig":
        if self.lean_samples < 0:
            raise SpecquantError(f"lean_samples={self.lean_samples} must be >= 0 (0 = steps x batch x grad-accum)")
        require_positive(self, ("lean_forward_batch",))
        return self

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class RegenConfig:
    """`specquant regen`: teacher-written continuations as distillation data (train/regen.py)."""

    max_new_tokens: int = field(default=128, metadata={"help": "new tokens per prompt"})
    temperature: float = field(default=1.0, metadata={
        "help": "sampling temperature (0 = greedy); 1 samples the teacher's own distribution"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling mass (1 = off)"})
    seed: int = field(default=0, metadata={"help": "sampling seed (batch i uses seed + i, so resumes repeat it)"})
    batch: int = field(default=16, metadata={"help": "prompts generated together (rows of equal prompt length)"})
    prompt_tokens: int = field(default=32, metadata={"help": "bundled prompts: tokens taken from each paragraph"})
    limit: int = field(default=0, metadata={"help": "use only the first N prompts (0 = all)"})

    def validate(self) -> "RegenConfig":
        require_positive(self, ("max_new_tokens", "batch", "prompt_tokens"))
        if self.limit < 0:
            raise SpecquantError(f"limit={self.limit} must be >= 0 (0 = all prompts)")
        return self
