"""Sampling rules: temperature, top-k, top-p. One function turns logits into the distribution that is sampled,
so target-only decoding, the draft and the verifier all see exactly the same transformation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specquant.errors import SpecquantError


@dataclass
class SamplingConfig:
    temperature: float = field(default=0.0, metadata={"help": "sampling temperature; 0 = greedy (argmax)"})
    top_k: int = field(default=0, metadata={"help": "keep the k most likely tokens; 0 = off"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus mass; 1 = off"})
    seed: int = field(default=0, metadata={"help": "sampling seed"})

    def validate(self) -> "SamplingConfig":
        if self.temperature < 0:
            raise SpecquantError(f"temperature {self.temperature} is negative; use 0 (greedy) or a positive value")
        if self.top_k < 0:
            raise SpecquantError(f"top_k {self.top_k} is negative; use 0 (off) or a positive count")
        if not 0.0 < self.top_p <= 1.0:
            raise SpecquantError(f"top_p {self.top_p} is outside (0, 1]; use 1.0 to switch it off")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def logits_to_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """logits [..., vocab] -> float32 probabilities after temperature, top-k and top-p (sampling mode only)."""
    logits = logits.float() / cfg.temperature
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if cfg.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token that crosses it is kept)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= cfg.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def argmax(x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """x [..., vocab] -> the index of the first maximum of each row, exactly torch.argmax(x, -1).

    Hand-picked over torch.argmax for the decode loops' per-step argmaxes: max(dim).indices returns the same first
    maximal index (both documented so; tests/test_sampling.py compares them on ties) and on CPU runs 2-3x faster
    (torch 2.13: 20 us vs 58 us for [4, 8192] float32; benchmarks/spec_overhead.py at dfedb37 counts them per step).
    """
    return x.max(dim=-1, keepdim=keepdim).indices


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row of probs [..., vocab] with the exponential race (no host sync): argmax p / E."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return argmax(probs / noise)


def next_token(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """logits [..., vocab] -> token ids [...]."""
    if cfg.greedy:
        return argmax(logits)
    return sample(logits_to_probs(logits, cfg), generator)
