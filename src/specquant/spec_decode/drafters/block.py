"""The block drafter (DFlash-style): one forward proposes up to block_size - 1 tokens from the target's features
(kind "block": one forward per step).

Its context is the target's hidden states of verified positions only (drafter.py's call order), taken from
forwards the target runs anyway: `prefill` projects the prompt's into the context cache; `accept` keeps the
accepted positions' features pending, and the next `propose` projects them in one batch. Under the hybrid drafter
most steps are suffix-drafted or undrafted, and projecting each step's few rows as they came cost a small forward
per step that nothing read (`flush` projects them now; the context K/V are the same either way,
test_block_spec.py). `propose` runs the block [last committed token, MASK x (B-1)] at positions n-1 .. n+B-2
against that context: the drafted tokens for positions n .. n+k-1 all come from one forward, so a step costs one
drafter forward whatever k is.

Sampling: token j is drawn from the drafter's marginal q_j at block position j, independently of the tokens drawn
before it. Rejection sampling stays exact: conditional on the prefix it was drawn from q_j, which is what the
verifier divides by (spec_decode/verify.py).

Pruned head: a model whose checkpoint has a token map (drafters/pruned_head.py) drafts through a PrunedHead made
from the target's lm_head rows; drafted ids map back to the full vocabulary, the target verifies over all of it.
"""

from __future__ import annotations

import torch

from specquant.decode.sampling import SamplingConfig, argmax, logits_to_probs, sample
from specquant.errors import SpecquantError
from specquant.model.block_draft import ARCHITECTURE, BlockDraftModel
from specquant.model.fuse import for_decoding
from specquant.spec_decode.config import SpecConfig
from specquant.spec_decode.drafter import Draft, DrafterKind
from specquant.spec_decode.drafters.pruned_head import PrunedHead, load_token_map, token_map_of
from specquant.spec_decode.tree import best_first_tree

# what vLLM's dflash method and llama.cpp's converter read from config.json
EXPORT_REQUIRED = ("block_size", "dflash_config.target_layer_ids", "dflash_config.mask_token_id")


class BlockDrafter:
    """A Drafter (spec_decode/drafter.py) over a BlockDraftModel attached to its target."""

    def __init__(self, model: BlockDraftModel, target, config: SpecConfig):
        ids = token_map_of(model)
        # the target's head stays whole (it verifies); the drafter gets its own copy of the kept rows
        self.head = None if ids is None else PrunedHead(target.lm_head, ids)
        self.model = model.attach_target(target, lm_head=self.head)
        self.target_layers = tuple(model.config.target_layer_ids)
        # window: SpecConfig.draft_window when set, else the checkpoint's own serve-time window (or none)
        self.window = config.draft_window if config.draft_window else -1
        self.max_draft_len = model.config.block_size - 1  # the block's mask positions
        # features of positions model.context_len .. context_len + pending_len - 1, not yet projected (module doc)
        self._pending: list[torch.Tensor] = []
        self._pending_len = 0

    @property
    def context_len(self) -> int:
        """Verified positions the drafter holds: projected into its cache, or pending."""
        return self.model.context_len + self._pending_len

    def _take_pending(self) -> torch.Tensor | None:
        """The pending features as one tensor (None: none), no longer pending."""
        if not self._pending:
            return None
        features = self._pending[0] if len(self._pending) == 1 else torch.cat(self._pending, 1)
        self._pending, self._pending_len = [], 0
        return features

    def flush(self) -> None:
        """Project the pending features into the context cache (propose does this in its own forward)."""
        features = self._take_pending()
        if features is not None:
            self.model.append_context(features)

    def _truncate(self, length: int) -> None:
        """Forget positions >= length, pending or projected."""
        if length < self.model.context_len:
            self._pending, self._pending_len = [], 0
            self.model.rollback(length)
            return
        keep = length - self.model.context_len
        if keep < self._pending_len:
            kept, n = [], 0
            for f in self._pending:
                if n >= keep:
                    break
                kept.append(f[:, : keep - n])
                n += kept[-1].shape[1]
            self._pending, self._pending_len = kept, keep

    def _append(self, hidden: torch.Tensor) -> None:
        # a copy: the target may hand out a view of a buffer its next forward overwrites (static-buffer steps)
        self._pending.append(self._features(hidden).clone())
        self._pending_len += hidden.shape[1]

    def check_request(self, prompt_len: int, max_new_tokens: int) -> None:
        pass  # its context is the target's; the engine checks the target

    def setup(self, batch: int, max_len: int) -> None:
        if batch != 1:
            raise SpecquantError(f"the block drafter runs batch 1; got batch {batch}")
        self.model.setup_cache(max_len, window=self.window)

    @staticmethod
    def _features(hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, layers, H] -> [B, T, layers * H]: the concatenation over layers the drafter's fc reads."""
        return hidden.reshape(*hidden.shape[:2], -1)

    def prefill(self, prompt_ids: torch.Tensor, target_hidden: torch.Tensor | None) -> None:
        if target_hidden is None:
            raise SpecquantError("the block drafter needs the target's hidden states; the target returned none")
        self._truncate(0)
        # projected now, not kept pending: a long prompt's features would be a large copy, and the first propose
        # needs them anyway
        self.model.append_context(self._features(target_hidden))

    def propose(self, tokens: torch.Tensor, k: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        n = tokens.shape[1]
        assert self.context_len == n - 1, (self.context_len, n)  # context = verified prefix
        k = min(k, self.max_draft_len)
        # [k, vocab], or [k, N] through a pruned head; the pending features are appended by the same forward
        logits = self.model.propose(tokens[0, n - 1], k, self._take_pending())
        if self.head is not None:
            drafted, probs = self.head.draft(logits, sampling, generator)  # [k] full ids, [k, vocab] | None
            return Draft(drafted[None], None if probs is None else probs[None])
        if sampling.greedy:
            return Draft(argmax(logits)[None])
        probs = logits_to_probs(logits, sampling)  # [k, vocab]
        return Draft(sample(probs, generator)[None], probs[None])

    def propose_tree(self, tokens: torch.Tensor, nodes: int, depth: int, sampling: SamplingConfig,
                     generator: torch.Generator | None) -> Draft:
        """A draft tree from the same one forward: the best `nodes` root paths under the block positions'
        distributions (tree.best_first_tree, DDTree's construction). Its tokens are chosen, not drawn, so they are
        point masses (probs None) in sampling mode too."""
        n = tokens.shape[1]
        assert self.context_len == n - 1, (self.context_len, n)
        logits = self.model.propose(tokens[0, n - 1], min(depth, self.max_draft_len),
                                    self._take_pending())  # [depth, vocab or N]
        drafted, parents = best_first_tree(torch.log_softmax(logits.float(), -1), nodes)
        ids = torch.tensor(drafted, dtype=torch.long, device=tokens.device)
        if self.head is not None:
            ids = self.head.to_vocab(ids)
        return Draft(ids[None], parents=tuple(parents))

    def accept(self, length: int, target_hidden: torch.Tensor | None) -> None:
        if target_hidden is None:
            raise SpecquantError("the block drafter needs the target's hidden states; the target returned none")
        t = target_hidden.shape[1]
        self._truncate(min(self.context_len, length - t))
        self._append(target_hidden)
        assert self.context_len == length

    def rollback(self, length: int) -> None:
        self._truncate(min(self.context_len, length))


def _detect(hf: dict) -> bool:
    return ARCHITECTURE in (hf.get("architectures") or []) or "dflash_config" in hf


def _missing(hf: dict) -> list[str]:
    missing = [key for key in EXPORT_REQUIRED if _get(hf, key) is None]
    if ARCHITECTURE not in (hf.get("architectures") or []):
        missing.insert(0, f"architectures [{ARCHITECTURE!r}]")
    return missing


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


def _load(name_or_dir, runtime) -> BlockDraftModel:
    from specquant.drafter_loader import load_block_draft

    model = load_block_draft(name_or_dir, runtime.dtype, runtime.device, runtime.draft_w4_activations)
    for_decoding(model, model.layers)  # its layers as one native call each (model/native_layer.py block_step)
    return load_token_map(model, name_or_dir, model.config.vocab_size)


def _build(model: BlockDraftModel, target, spec: SpecConfig, **engine_options) -> BlockDrafter:
    from specquant.quant.prune_vocab import retarget_block_draft, vocab_map_of

    target_map = vocab_map_of(target)
    if target_map is not None and model.config.vocab_size != target.config.vocab_size:
        if token_map_of(model) is not None:  # its map is over the full vocabulary, the target's head is not
            raise SpecquantError("a block drafter with a pruned head (draft_vocab) cannot draft for a "
                                 "vocabulary-pruned target; use the drafter checkpoint without draft_vocab")
        model = retarget_block_draft(model, target_map)  # a vocabulary-pruned target (specquant/quant/prune_vocab.py)
    return BlockDrafter(model, target, spec)  # its one forward runs eagerly: no compile / graphs / aot options


KIND = DrafterKind(
    name="block", title="block drafter", detect=_detect, load=_load, build=_build,
    forwards_per_step=lambda k: 1 if k else 0, model_class=BlockDraftModel, vllm_method="dflash",
    fixed_draft_len=lambda hf: int(hf["block_size"]) - 1, missing=_missing, cost="block")
