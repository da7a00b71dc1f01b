"""The none drafter (kind "none"): proposes nothing, so every step is the target's plain one-token decode step.

Target-only decoding is the engine with this drafter: one decoding loop (spec_decode/loop.py) for both, and a
step without drafts costs one one-token forward (no verify, no rollback). No checkpoint: `--draft none`.
"""

from __future__ import annotations

import torch

from specquant.decode.sampling import SamplingConfig
from specquant.spec_decode.drafter import Draft, DrafterKind


class NoDrafter:
    """A Drafter (spec_decode/drafter.py) that never proposes a token."""

    target_layers: tuple[int, ...] = ()
    max_draft_len = 0

    def check_request(self, prompt_len: int, max_new_tokens: int) -> None:
        pass

    def setup(self, batch: int, max_len: int) -> None:
        pass

    def prefill(self, prompt_ids: torch.Tensor, target_hidden: torch.Tensor | None) -> None:
        pass

    def propose(self, tokens: torch.Tensor, k: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        return Draft.empty(tokens.shape[0], tokens.device)

    def accept(self, length: int, target_hidden: torch.Tensor | None) -> None:
        pass

    def rollback(self, length: int) -> None:
        pass


KIND = DrafterKind(
    name="none", title="target only", detect=lambda hf: False, load=lambda name_or_dir, runtime: None,
    build=lambda model, target, spec, **engine_options: NoDrafter(), forwards_per_step=lambda k: 0,
    needs_checkpoint=False)
