"""Vocabulary-pruned draft heads: a drafter's output head over the N most frequent token ids only (no drafter kind;
the block and LM kinds use it, and any drafter that drafts through a head can: an MTP head too).

Why: a drafter's head costs vocab x hidden per drafted position, the largest per-token cost of a small drafter over
a large vocabulary. A drafter only proposes; the target verifies over its full vocabulary, so a draft that never
proposes a pruned id changes acceptance, never the output.

The map. `token_ids` [N] int64, ascending: the kept ids of the full vocabulary, stored in the drafter checkpoint's
config.json under CONFIG_KEY ({"token_ids": [...], "source": "..."}; `specquant distill prune-head`
(train/prune_head.py) writes it).
Engines that do not read the key (vLLM, llama.cpp) run the checkpoint's full head as before.

Drafting through a PrunedHead: logits [.., N] over the kept ids; a drafted index i maps back to token_ids[i]
(`to_vocab`), and in sampling mode its draft distribution becomes [.., vocab] with zero mass outside the kept ids
(`to_vocab_probs`). Rejection sampling stays exact: the verifier accepts x with min(1, p(x) / q(x)), q(x) > 0 for
every drafted x, and resamples from max(0, p - q), which keeps all of p's mass on the pruned ids (verify.py).

The reference path is the full head's logits at the kept ids (`reference_logits`); the pruned matmul is compared
with it in tests/test_pruned_head.py.
"""

from __future__ import annotations

import torch
from torch import nn

from specquant.decode.sampling import SamplingConfig, argmax, logits_to_probs, sample
from specquant.errors import SpecquantError

CONFIG_KEY = "draft_vocab"
ATTRIBUTE = "draft_vocab"  # a loaded draft model's kept ids (a [N] tensor), when its checkpoint has a map


class PrunedHead(nn.Module):
    """The rows `token_ids` of a head (a dense Linear, a BF16 CastLinear or a W4 / W8 QuantLinear), as a module of
    the same kind:
    x [..., hidden] -> logits [..., N]."""

    def __init__(self, head: nn.Module, token_ids: torch.Tensor):
        super().__init__()
        vocab = head.out_features
        device = next(iter([*head.parameters(), *head.buffers()])).device
        # imported here, not at the top: quant/ loads the native kernels and torch.compile's machinery, which a
        # plain decode (and a fresh process running an AOT package, tests/test_aot.py) never needs
        from specquant.quant.head import cut_rows
        from specquant.quant.prune_vocab import check_token_ids

        self.register_buffer("token_ids", check_token_ids(token_ids, vocab).to(device), persistent=False)
        self.vocab_size = vocab
        self.rows = cut_rows(head, self.token_ids)

    @property
    def num_kept(self) -> int:
        return self.token_ids.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rows(x)

    def to_vocab(self, ids: torch.Tensor) -> torch.Tensor:
        """Indices into the kept ids [...] -> full-vocabulary token ids [...]."""
        return self.token_ids[ids]

    def to_vocab_probs(self, probs: torch.Tensor) -> torch.Tensor:
        """A distribution over the kept ids [..., N] -> over the full vocabulary [..., vocab], zero elsewhere."""
        out = probs.new_zeros(*probs.shape[:-1], self.vocab_size)
        return out.index_copy_(-1, self.token_ids, probs)

    def draft(self, logits: torch.Tensor, sampling: SamplingConfig,
              generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits [k, N] -> (full-vocabulary tokens [k], their draft distributions [k, vocab] or None when greedy)."""
        if sampling.greedy:
            return self.to_vocab(argmax(logits)), None
        probs = logits_to_probs(logits, sampling)  # [k, N]
        return self.to_vocab(sample(probs, generator)), self.to_vocab_probs(probs)

    def extra_repr(self) -> str:
        return f"kept={self.num_kept}, vocab={self.vocab_size}"


def reference_logits(head: nn.Module, token_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The plain path: the full head's logits [..., vocab], then the kept columns [..., N]."""
    return head(x)[..., token_ids]


# --- the map in config.json (train/prune_head.py builds and writes it) ------------------------------------------------


def read_token_map(hf: dict, vocab_size: int) -> torch.Tensor | None:
    """The kept ids [N] from a checkpoint's config.json dict, or None when it has no map."""
    entry = hf.get(CONFIG_KEY)
    if entry is None:
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("token_ids"), list):
        raise SpecquantError(f'config.json "{CONFIG_KEY}" must be an object with a "token_ids" list; rebuild it '
                             "(specquant distill prune-head)")
    from specquant.quant.prune_vocab import check_token_ids  # lazily: see PrunedHead

    return check_token_ids(entry["token_ids"], vocab_size)


def load_token_map(model: nn.Module, checkpoint_dir, vocab_size: int) -> nn.Module:
    """Record the map of checkpoint_dir's config.json (if any) on a loaded draft model (ATTRIBUTE); returns model."""
    from specquant.model.checkpoint import read_hf_config, resolve

    ids = read_token_map(read_hf_config(resolve(checkpoint_dir)), vocab_size)
    if ids is not None:
        setattr(model, ATTRIBUTE, ids)
    return model


def token_map_of(model: nn.Module) -> torch.Tensor | None:
    return getattr(model, ATTRIBUTE, None)


def prune_lm_head(model, token_ids: torch.Tensor):
    """A draft Transformer's lm_head replaced by its PrunedHead (the LM drafter then maps drafted ids back);
    returns model. Its embeddings are untouched (a tied head keeps its embedding)."""
    if isinstance(model.lm_head, PrunedHead):
        raise SpecquantError("this draft model's head is already pruned; load the checkpoint again to prune anew")
    model.lm_head = PrunedHead(model.lm_head, token_ids)
    return model
