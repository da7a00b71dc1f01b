"""The decoding loop: prefill, then propose -> verify -> accept until max_new_tokens. The one loop of specquant:
target-only decoding runs it with the none drafter (drafters/none.py), whose steps propose nothing.

Terms (draft / accepted / recovered / bonus tokens) are defined in verify.py; the drafter's side of each step in
drafter.py. `decode_steps` is a generator of each step's committed tokens, so a caller can stream them and stop at
EOS by not asking for more. Timing and EOS stay outside: see engine.py and timing.py.

Batch: steps without drafts run any batch (rows share one length and advance together); steps with drafts run
batch 1 (per-row accepted counts would need per-row lengths).
"""

from __future__ import annotations

from typing import Iterator

import torch

from specquant.decode.compiled import Stepper
from specquant.decode.sampling import SamplingConfig, next_token
from specquant.spec_decode.adaptive import next_draft_len
from specquant.spec_decode.config import SpecConfig
from specquant.spec_decode.drafter import Drafter
from specquant.spec_decode.metrics import StepMetrics
from specquant.spec_decode.tree import layout as tree_layout, tree_verify
from specquant.spec_decode.verify import verify


def prefill(target: Stepper, drafter: Drafter, prompt_ids: torch.Tensor, sampling: SamplingConfig,
            generator: torch.Generator | None) -> torch.Tensor:
    """Target forward over prompt_ids [B, L] -> the first new token of each row [B] (on the device); the drafter
    takes the prompt (and the target's hidden states of it, from the same forward)."""
    logits, hidden = target.step(prompt_ids, 0, last_only=True, hidden_layers=drafter.target_layers)
    first = next_token(logits[:, -1], sampling, generator)  # [B]
    drafter.prefill(prompt_ids, hidden)
    return first


def decode_steps(target: Stepper, drafter: Drafter, seq: torch.Tensor, n: int, max_new: int, config: SpecConfig,
                 sampling: SamplingConfig,
                 generator: torch.Generator | None) -> Iterator[tuple[list[list[int]], StepMetrics]]:
    """After `prefill`: yields each step's (tokens per row, step metrics) until max_new more tokens.

    seq [B, capacity]: the committed sequence in seq[:, :n] (prompt + first token), extended in place.
    """
    limit = getattr(drafter, "max_draft_len", None)
    k, emitted = config.draft_len if limit is None else min(config.draft_len, limit), 0
    while emitted < max_new:
        k_step = min(k, max_new - emitted - 1)  # the step emits at most k_step + 1 tokens
        draft = None if not k_step else (
            drafter.propose_tree(seq[:, :n], config.tree_nodes, k_step, sampling, generator) if config.tree_nodes
            else drafter.propose(seq[:, :n], k_step, sampling, generator))
        proposed = 0 if draft is None else draft.tokens.shape[1]
        if proposed == 0:  # nothing to verify: one one-token forward and the target's own next token per row
            last = seq[:, n - 1 : n].contiguous()  # [B, 1]; a copy only when B > 1 (rows are seq's stride apart)
            logits, hidden = target.step(last, n - 1, last_only=True, hidden_layers=drafter.target_layers)
            token = next_token(logits[:, -1], sampling, generator)  # [B]
            seq[:, n] = token
            drafter.accept(n, hidden)  # positions < n are processed; the new token is not yet
            n, emitted = n + 1, emitted + 1
            yield token[:, None].tolist(), StepMetrics(0, 0)  # the step's one host sync
            continue
        # queued now, on the host by the time verify reads `accepted` (the step's one sync; no-op on CPU)
        draft_host = draft.tokens.to("cpu", non_blocking=True)
        block = torch.cat([seq[:, n - 1 : n], draft.tokens], dim=1)  # [1, proposed + 1]
        probs = None if draft.probs is None else draft.probs[0]
        if draft.parents is None:
            logits, hidden = target.step(block, n - 1, last_only=False, hidden_layers=drafter.target_layers)
            accepted, bonus = verify(draft.tokens[0], probs, logits[0], sampling, generator)
            target.rollback(n + accepted)
            kept, new = draft.tokens[0, :accepted], draft_host[0, :accepted].tolist() + [bonus]
            hidden = None if hidden is None else hidden[:, : accepted + 1]
        else:
            kept, new, hidden = verify_tree(target, drafter, block, n, probs, draft.parents, sampling, generator)
            accepted, bonus = len(new) - 1, new[-1]
        drafter.accept(n + accepted, hidden)
        seq[0, n : n + accepted] = kept  # device to device: no host round trip
        seq[0, n + accepted] = bonus
        n, emitted = n + len(new), emitted + len(new)
        k = next_draft_len(k, proposed, accepted, config)
        yield [new], StepMetrics(proposed, accepted)


def verify_tree(target: Stepper, drafter: Drafter, block: torch.Tensor, n: int, probs: torch.Tensor | None,
                parents: tuple[int, ...], sampling: SamplingConfig, generator: torch.Generator | None
                ) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
    """A draft tree's verify step (spec_decode/tree.py): the target scores block [1, N] (the root seq[n-1], then the
    draft tokens) as a tree in one forward, and its caches keep the accepted path. Returns (accepted tokens on the
    device [accepted], the step's new tokens, the target's hidden states along the path [1, accepted + 1, ...])."""
    tree = tree_layout(parents)
    logits, hidden = target.step_tree(block, n - 1, tree, hidden_layers=drafter.target_layers)
    path, bonus = tree_verify(block[0, 1:], tree, probs, logits[0], sampling, generator)
    target.commit_tree(n - 1, path)
    rows = torch.tensor(path, device=block.device)
    kept = block[0, rows[1:]]
    new = kept.tolist() + [bonus]
    return kept, new, None if hidden is None else hidden[:, rows]
