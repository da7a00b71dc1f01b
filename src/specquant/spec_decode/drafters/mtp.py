"""The MTP drafter (kind "mtp"): Qwen3.5's own multi-token-prediction layer (model/mtp.py) drafts from the target's
last hidden state; one MTP forward per drafted token.

`--draft mtp` builds it from the target checkpoint's `mtp.*` tensors (no directory); an MTP drafter directory
(config.json architectures [Qwen3_5MTP], written by `specquant distill draft --kind mtp`, dense or W4) works too.

Positions. The MTP's entry at position i pairs the target's post-norm hidden state h_i with the token x_{i+1}
(model/mtp.py) and predicts x_{i+2}. With the committed sequence x_0..x_{n-1}, the target has processed positions
< n-1, so h_0..h_{n-2} are known: `propose` runs the MTP over every position whose h it has not consumed yet, up to
n-2 (one forward: after a verify, the accepted positions), which drafts x_n; each further draft chains the MTP's own
output g at the next position with the token just drafted. Only the entries built from the target's hidden states
are kept: `accept` rolls the MTP's KV cache back to them (positions < n-1 of the step that drafted), so the chained
entries, built from the MTP's own g, are always recomputed from the target's h once it has verified them.

Head precision (MTPDrafter's `head`): "shared" runs the target's own lm_head (dense, or whatever the target holds);
"bf16" / "w8" / "w4" give the drafter its own head of that precision, made from the target's dense head weight
(quant/head.py's RTN, as `specquant quantize --lm-head`), so only the drafts change: the target still verifies with
its own head. An MTP drafter directory names its choice in config.json (`specquant_mtp_head`).
"""

from __future__ import annotations

import torch
from torch import nn

from specquant.decode.sampling import SamplingConfig, argmax, logits_to_probs, sample
from specquant.errors import SpecquantError
from specquant.model.decoder import Transformer
from specquant.model.fuse import for_decoding
from specquant.model.mtp import HEAD_KEY, HEADS, MTPModel, is_mtp_config, mtp_from_tensors
from specquant.spec_decode.config import SpecConfig
from specquant.spec_decode.drafter import Draft, DrafterKind

__all__ = ["HEADS", "HEAD_KEY", "KIND", "MTPDrafter"]  # HEADS / HEAD_KEY are model.mtp's, named here too


def draft_head(target: Transformer, head: str) -> nn.Module:
    """The module that turns the MTP's g into logits: the target's lm_head, or a copy of it at `head` precision."""
    if head not in HEADS:
        raise SpecquantError(f"MTP head {head!r} is unknown; use one of {', '.join(HEADS)}")
    if head == "shared":
        return target.lm_head
    from specquant.quant.head import W4_HEAD_GROUP, head_module

    if not isinstance(target.lm_head, nn.Linear):
        raise SpecquantError(f"MTP head {head!r} is made from the target's dense lm_head, but this target's head is "
                             f"a {type(target.lm_head).__name__}; use head 'shared'")
    hidden = target.config.hidden_size
    if head == "w4" and hidden % W4_HEAD_GROUP:
        raise SpecquantError(f"a w4 MTP head groups {W4_HEAD_GROUP} inputs, which does not divide hidden_size "
                             f"{hidden}; use head w8 or bf16")
    dtype = target.model.embed_tokens.weight.dtype
    # .to: a decoding target may hold its head in bf16 (model/bf16_store.py), as the exact values of the fp32 one
    return head_module(target.lm_head.weight.to(dtype), head, dtype)


class MTPDrafter:
    """A Drafter (spec_decode/drafter.py) over an MTPModel and the target whose hidden states it reads."""

    def __init__(self, model: MTPModel, target: Transformer, head: str = "shared"):
        tc, mc = target.config, model.config
        if (mc.hidden_size, mc.vocab_size) != (tc.hidden_size, tc.vocab_size):
            raise SpecquantError(f"MTP layer has hidden size {mc.hidden_size} and vocabulary {mc.vocab_size}; the "
                                 f"target has {tc.hidden_size} and {tc.vocab_size}: use the target's own MTP layer")
        self.model, self.target = model.eval(), target
        self.head = draft_head(target, head)
        # the last layer's output, before the target's final norm: applied here (model/mtp.py: the MTP reads h
        # after it), so the target's forwards need no second output
        self.target_layers = (tc.num_hidden_layers - 1,)
        self.ctx = 0  # MTP cache positions < ctx are built from the target's hidden states
        self.pending: torch.Tensor | None = None  # [B, P, H]: post-norm h of positions ctx .. ctx+P-1, not yet run

    def check_request(self, prompt_len: int, max_new_tokens: int) -> None:
        pass  # the MTP cache is sized by setup to the engine's longest sequence

    def setup(self, batch: int, max_len: int) -> None:
        self.model.setup_cache(batch, max_len)
        self.ctx, self.pending = 0, None

    def _normed(self, target_hidden: torch.Tensor | None) -> torch.Tensor:
        if target_hidden is None:
            raise SpecquantError("the MTP drafter needs the target's hidden states; the target returned none")
        with torch.no_grad():
            return self.target.model.norm(target_hidden[:, :, -1])  # a new tensor: safe past the next forward

    def prefill(self, prompt_ids: torch.Tensor, target_hidden: torch.Tensor | None) -> None:
        self.model.rollback(0)
        self.ctx, self.pending = 0, self._normed(target_hidden)

    def _logits(self, g: torch.Tensor) -> torch.Tensor:
        return self.head(g[:, -1])[0]  # [vocab] of row 0 (drafts run batch 1)

    @torch.no_grad()
    def propose(self, tokens: torch.Tensor, k: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        n = tokens.shape[1]
        if k == 0:
            return Draft.empty(tokens.shape[0], tokens.device)
        p = 0 if self.pending is None else self.pending.shape[1]
        assert p > 0 and self.ctx + p == n - 1, (self.ctx, p, n)  # h known for exactly the positions < n-1
        embed = self.target.model.embed_tokens
        g = self.model(self.pending, embed(tokens[:, self.ctx + 1 : n]), self.ctx)  # positions ctx .. n-2
        self.ctx, self.pending = n - 1, None
        drafted, probs = [], []
        for i in range(k):
            logits = self._logits(g)
            if sampling.greedy:
                x = argmax(logits, keepdim=True)  # [1]
            else:
                q = logits_to_probs(logits, sampling)
                x = sample(q, generator).view(1)
                probs.append(q)
            drafted.append(x)
            if i < k - 1:  # chain: the MTP's own g at the next position, with the token it just drafted
                g = self.model(g[:, -1:], embed(x.view(1, 1)), n - 1 + i)
        return Draft(torch.stack(drafted, dim=1), torch.stack(probs)[None] if probs else None)

    def accept(self, length: int, target_hidden: torch.Tensor | None) -> None:
        new = self._normed(target_hidden)  # positions length - T .. length - 1
        start = length - new.shape[1]
        self.rollback(start)
        held = 0 if self.pending is None else self.pending.shape[1]
        assert self.ctx + held == start, (self.ctx, held, start)  # h is contiguous up to the new positions
        self.pending = new if not held else torch.cat([self.pending, new], 1)

    def rollback(self, length: int) -> None:
        if length < self.ctx:
            self.ctx, self.pending = length, None
        elif self.pending is not None:
            self.pending = self.pending[:, : length - self.ctx]
        self.model.rollback(self.ctx)  # chained entries past ctx are never kept


def _load(name_or_dir, runtime) -> MTPModel:
    from specquant.drafter_loader import load_mtp_drafter

    model = load_mtp_drafter(name_or_dir, runtime.dtype, runtime.device, runtime.draft_w4_activations)
    return for_decoding(model, model.layers)  # its layer steps as one native call each


def _build(model: MTPModel | None, target: Transformer, spec: SpecConfig, **engine_options) -> MTPDrafter:
    if model is None:  # `--draft mtp`: the target checkpoint's own mtp.* tensors
        if not target.extra_tensors:
            raise SpecquantError("--draft mtp drafts with the target checkpoint's mtp.* tensors (Qwen3.5's MTP "
                                 "layer), and this target has none; pass an MTP drafter directory (`specquant "
                                 "distill draft --kind mtp`) or another --draft")
        w = target.model.embed_tokens.weight
        model = mtp_from_tensors(target.config, target.extra_tensors, w.dtype, w.device)
        for_decoding(model, model.layers)
    return MTPDrafter(model, target, getattr(model, "head_precision", "shared"))


KIND = DrafterKind(
    name="mtp", title="MTP drafter",
    # before "lm" in the table: an MTP drafter's config.json names the target's model_type
    detect=is_mtp_config, load=_load, build=_build, forwards_per_step=lambda k: k, needs_checkpoint=False,
    model_class=MTPModel, cost="head")
