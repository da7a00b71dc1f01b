"""The one place the gates touch the inference engine: load a target (and draft), score tokens, generate.

Everything else in specquant.gate goes through `EvalEngine`, so an engine or loader restructuring changes this
file only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specquant.spec_decode.engine import generate
from specquant.decode.sampling import SamplingConfig
from specquant.errors import SpecquantError
from specquant.loader import load_model
from specquant.model.checkpoint import load_tokenizer, resolve


class EvalEngine:
    """A target (plus an optional draft for speculative decoding) and its tokenizer."""

    def __init__(self, target: str, draft: str | None = None, dtype: str = "float32", device: str = "cpu",
                 draft_len: int = 3, w4_activations: str = "float", draft_w4_activations: str = "auto"):
        resolve(target)
        if draft is not None:
            resolve(draft)
        self.tokenizer = load_tokenizer(target)
        self.target = load_model(target, dtype, device, fuse=True, w4_activations=w4_activations)
        self.device = torch.device(device)
        self.spec = None
        if draft is not None:
            from specquant.spec_decode.config import SpecConfig
            from specquant.spec_decode.engine import SpecEngine

            draft_model = load_model(draft, dtype, device, fuse=True, w4_activations=draft_w4_activations)
            self.spec = SpecEngine(self.target, draft_model, SpecConfig(draft_len=draft_len),
                                   self.tokenizer, load_tokenizer(draft))

    @property
    def max_length(self) -> int:
        return self.target.config.max_position_embeddings

    @property
    def eos_ids(self) -> list[int]:
        return list(self.target.config.eos_ids)

    @property
    def draft_steps(self) -> int:
        """Verify steps that carried draft tokens so far (0 without a draft)."""
        return self.spec.metrics.num_drafts if self.spec is not None else 0

    @torch.no_grad()
    def logprobs(self, ids: list[int]) -> torch.Tensor:
        """Cache-free forward over ids -> float32 log-probabilities [len(ids), vocab] of each next token."""
        self.target.clear_cache()
        logits = self.target(torch.tensor([ids], device=self.device))[0]
        return F.log_softmax(logits.float(), dim=-1)

    def generate(self, ids: list[int], max_new_tokens: int, sampling: SamplingConfig) -> tuple[list[int], dict]:
        """New tokens after ids (stops after EOS) and the engine's stats; speculative when a draft was given."""
        if max_new_tokens < 1:
            raise SpecquantError(f"max_new_tokens {max_new_tokens} must be at least 1")
        prompt = torch.tensor([ids], device=self.device)
        if self.spec is not None:
            result = self.spec.generate(prompt, max_new_tokens, sampling)
        else:
            result = generate(self.target, prompt, max_new_tokens, sampling)
        return result.token_ids[0], result.stats
