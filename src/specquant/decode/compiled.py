"""Forward calls for decoding: the eager reference, or torch.compile on the small fixed decode/verify shapes.

Compiled steps need a shape-static cache (`setup_cache(static=True)`): positions travel as a tensor, attention spans
the whole buffer under a mask, so one graph serves every position. Prompts (long, variable T) run eagerly through
the same static cache. tests/test_compiled.py checks compiled against eager.
"""

from __future__ import annotations

import torch

from specquant.model.decoder import Transformer

COMPILED_MAX_T = 34  # verify shapes up to k+1 with k <= 32, plus the 2-token draft catch-up


def _raise_recompile_limit(n: int = 64):
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name) and getattr(cfg, name) < n:
            setattr(cfg, name, n)


class Stepper:
    """`stepper(tokens [batch, T], start, last_only) -> logits`; compiled for T <= COMPILED_MAX_T when enabled.

    `step` also returns the hidden states of `hidden_layers` (None when empty), for drafters that read them."""

    def __init__(self, model: Transformer, compile: bool = False):
        self.model = model
        self.compile = compile
        self.compiled = None
        if compile:
            _raise_recompile_limit()
            self.compiled = torch.compile(model, dynamic=False)

    def setup(self, batch: int, max_seq_len: int, **kw):
        self.model.setup_cache(batch, max_seq_len, static=self.compile, **kw)

    def __call__(self, tokens: torch.Tensor, start: int, last_only: bool, hidden_layers: tuple[int, ...] = ()):
        t = tokens.shape[1]
        if self.compiled is None or t > COMPILED_MAX_T:
            return self.model(tokens, start, last_only, hidden_layers=hidden_layers)
        pos = torch.arange(start, start + t, device=tokens.device)
        return self.compiled(tokens, 0, last_only, pos, hidden_layers=hidden_layers)

    def step(self, tokens: torch.Tensor, start: int, last_only: bool,
             hidden_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits [batch, T or 1, vocab], hidden [batch, T, len(hidden_layers), hidden_size] or None)."""
        out = self(tokens, start, last_only, hidden_layers)
        return out if hidden_layers else (out, None)

    def rollback(self, length: int):
        self.model.rollback(length)
