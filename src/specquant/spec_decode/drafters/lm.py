"""The LM drafter: an independent small causal LM sharing the target's tokenizer, one draft token per forward
(kind "lm": k forwards per step).

Its KV cache may run a sliding window (SpecConfig.draft_window): a ring buffer, so its step cost and memory stay
bounded by W. A windowed draft may be prefilled with only the last W prompt tokens ("window"): its positions are
then shifted by the skipped length, which RoPE (relative) does not see.

Pruned head: a checkpoint with a token map (drafters/pruned_head.py) loads with its lm_head cut to the kept rows
(a PrunedHead); drafted indices map back to full-vocabulary ids before they are fed back or proposed.
"""

from __future__ import annotations

import torch

from specquant.decode.compiled import Stepper
from specquant.decode.graphs import GraphStepper
from specquant.decode.result import check_context
from specquant.decode.sampling import SamplingConfig, argmax, logits_to_probs, sample
from specquant.errors import SpecquantError
from specquant.model.config import SUPPORTED_MODEL_TYPES
from specquant.model.decoder import Transformer
from specquant.spec_decode.config import SpecConfig
from specquant.spec_decode.drafter import Draft, DrafterKind, check_vocab
from specquant.spec_decode.drafters.pruned_head import PrunedHead, load_token_map, prune_lm_head, token_map_of


class LMDrafter:
    """A Drafter (spec_decode/drafter.py) over a draft Transformer."""

    target_layers: tuple[int, ...] = ()
    max_draft_len = None  # one forward per token: as many as k asks

    def __init__(self, model: Transformer, config: SpecConfig, compile: bool = False, graphs: bool = False,
                 aot: str = "off"):
        self.model = model
        self.head = model.lm_head if isinstance(model.lm_head, PrunedHead) else None
        # graphs: one-token and catch-up steps replayed as CUDA graphs (decode/graphs.py; eager stand-in on CPU)
        # compiled: the one-token step and the 2-token catch-up after a fully accepted verify (the shapes every
        # round repeats); aot (decode.aot packages): the one-token step only, since each package is its own
        # ~25 s build and most draft forwards are single tokens
        if graphs and aot != "off":
            raise SpecquantError("CUDA-graph steps and AOT packages do not combine; use one")
        self.step = GraphStepper(model, compile) if graphs else Stepper(
            model, compile, compile_shapes=(1, 2), aot=aot, aot_shapes=((1, True),))
        self.window = config.draft_window
        self.window_prefill = config.draft_prefill == "window"
        # stop drafting once the draft's top probability falls below this (0 = never); see SpecConfig
        self.confidence = config.draft_confidence
        self.longest = config.longest_draft
        self.offset = 0  # positions skipped by a window-only prefill: cache position = sequence position - offset
        self.valid = 0  # the cache holds sequence positions offset .. valid-1

    def check_request(self, prompt_len: int, max_new_tokens: int) -> None:
        if not self.window and self.model.config.sliding_window is None:  # a window never runs out of context
            check_context(self.model, prompt_len, max_new_tokens, role="draft")

    def setup(self, batch: int, max_len: int) -> None:
        # the ring cache must survive a rollback of a whole draft (longest + 1 positions)
        self.step.setup(batch, max_len, max_block=max(64, self.longest + 2), window=self.window if self.window else -1)

    def _forward(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """ids [1, T] at sequence positions start.. -> logits [vocab] at the last one."""
        return self.step(ids, start - self.offset, last_only=True)[0, -1]

    def prefill(self, prompt_ids: torch.Tensor, target_hidden: torch.Tensor | None = None) -> None:
        """All prompt tokens but the last (the first propose feeds it); only the last W with a window prefill."""
        plen = prompt_ids.shape[1]
        self.offset = max(0, plen - self.window) if self.window and self.window_prefill else 0
        self.valid = self.offset
        if plen - 1 > self.valid:
            self._forward(prompt_ids[:, self.valid : plen - 1], self.valid)
            self.valid = plen - 1

    def propose(self, tokens: torch.Tensor, k: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        n = tokens.shape[1]
        logits = self._forward(tokens[:, self.valid : n], self.valid)  # catch up on what the cache lacks
        self.valid = n
        if sampling.greedy and not self.confidence:
            return Draft(self._greedy(logits, n, k))
        drafted, probs = [], []
        for i in range(k):
            if sampling.greedy:
                x = int(argmax(logits))
                if self.confidence and i > 0 and torch.softmax(logits.float(), -1)[x] < self.confidence:
                    break
            else:
                p = logits_to_probs(logits, sampling)  # [vocab], or [N] through a pruned head
                x = int(sample(p, generator))
                if self.confidence and i > 0 and p.max() < self.confidence:
                    break
                probs.append(p if self.head is None else self.head.to_vocab_probs(p))
            if self.head is not None:
                x = int(self.head.token_ids[x])
            drafted.append(x)
            if i < k - 1:
                logits = self._forward(torch.tensor([[x]], device=tokens.device), n + i)
                self.valid = n + i + 1
        return Draft(torch.tensor([drafted], dtype=torch.long, device=tokens.device),
                     torch.stack(probs)[None] if probs else None)

    def _greedy(self, logits: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """k argmax drafts [1, k] from logits [vocab] at position n-1; the tokens never leave the device, so
        drafting waits for no host sync (what lets CUDA-graph steps run back to back)."""
        drafted = []
        for i in range(k):
            x = argmax(logits, keepdim=True)  # [1]
            if self.head is not None:
                x = self.head.to_vocab(x)
            drafted.append(x)
            if i < k - 1:
                logits = self._forward(x.view(1, 1), n + i)
                self.valid = n + i + 1
        return torch.stack(drafted, dim=1) if drafted else torch.empty(1, 0, dtype=torch.long, device=logits.device)

    def accept(self, length: int, target_hidden: torch.Tensor | None = None) -> None:
        self.rollback(length)

    def rollback(self, length: int) -> None:
        self.valid = min(self.valid, length)
        self.model.rollback(self.valid - self.offset)


def _load(name_or_dir, runtime):
    from specquant.loader import load_model

    model = load_model(name_or_dir, runtime.dtype, runtime.device, fuse=True,
                       w4_activations=runtime.draft_w4_activations)
    load_token_map(model, name_or_dir, model.config.vocab_size)
    ids = token_map_of(model)
    return model if ids is None else prune_lm_head(model, ids)


def _build(model: Transformer, target: Transformer, spec: SpecConfig, compile: bool = False, graphs: bool = False,
           aot: str = "off", target_tokenizer=None, draft_tokenizer=None, **engine_options) -> LMDrafter:
    from specquant.quant.prune_vocab import prune_draft_vocab, vocab_map_of

    target_map = vocab_map_of(target)
    if target_map is not None and model.config.vocab_size != target.config.vocab_size:
        # a vocabulary-pruned target (specquant/quant/prune_vocab.py) and a draft over the full vocabulary: the draft
        # is cut to the target's rows; a pruned draft head's map is over the full vocabulary, so not with it
        if token_map_of(model) is not None:
            raise SpecquantError("a draft with a pruned head (draft_vocab) cannot draft for a vocabulary-pruned "
                                 "target; use the draft checkpoint without draft_vocab")
        model = prune_draft_vocab(model, target_map, target_tokenizer, draft_tokenizer)
        target_tokenizer = draft_tokenizer = None  # checked through the map
    check_vocab(target.config.vocab_size, model.config.vocab_size, target_tokenizer, draft_tokenizer)
    return LMDrafter(model, spec, compile, graphs, aot)


KIND = DrafterKind(
    name="lm", title="LM drafter",
    # after "block" in the table: a block drafter's config.json names a causal LM model_type too
    detect=lambda hf: hf.get("model_type") in SUPPORTED_MODEL_TYPES,
    load=_load, build=_build, forwards_per_step=lambda k: k, model_class=Transformer, standalone=True,
    vllm_method="draft_model", cost="decoder")
