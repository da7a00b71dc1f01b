"""The one place the gates touch the inference engine: load a target (and draft), score tokens, generate.

Everything else in specquant.gate goes through `EvalEngine`, so an engine or loader restructuring changes this
file only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specquant.decode.sampling import SamplingConfig
from specquant.errors import SpecquantError
from specquant.model.checkpoint import load_tokenizer, resolve
from specquant.spec_decode.build import build_engine
from specquant.spec_decode.config import SpecConfig
from specquant.spec_decode.runtime import RuntimeConfig


class EvalEngine:
    """A target (plus an optional draft for speculative decoding: any drafter kind) and its tokenizer."""

    def __init__(self, target: str, draft: str | None = None, runtime: RuntimeConfig | None = None,
                 draft_len: int = 3):
        runtime = (runtime or RuntimeConfig()).validate()
        resolve(target)
        self.tokenizer = load_tokenizer(target)
        self.engine = build_engine(target, draft, runtime, SpecConfig(draft_len=draft_len),
                                   target_tokenizer=self.tokenizer)
        self.target = self.engine.target
        self.device = torch.device(runtime.device)

    @property
    def max_length(self) -> int:
        return self.target.config.max_position_embeddings

    @property
    def eos_ids(self) -> list[int]:
        return list(self.target.config.eos_ids)

    @property
    def draft_steps(self) -> int:
        """Verify steps that carried draft tokens so far (0 without a draft)."""
        return self.engine.metrics.num_drafts

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
        result = self.engine.generate(torch.tensor([ids], device=self.device), max_new_tokens, sampling)
        return result.token_ids[0], result.stats
