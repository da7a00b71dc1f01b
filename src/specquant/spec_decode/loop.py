"""The speculative loop: prefill, then propose -> verify -> accept until max_new_tokens (batch size 1).

Terms (draft / accepted / recovered / bonus tokens) are defined in verify.py; the drafter's side of each step in
drafter.py. `decode_steps` is a generator of each step's emitted tokens, so a caller can stream them and stop at
EOS by not asking for more. Timing stays outside: see timing.py and engine.py.
"""

from __future__ import annotations

from typing import Iterator

import torch

from specquant.decode.compiled import Stepper
from specquant.decode.sampling import SamplingConfig, next_token
from specquant.spec_decode.adaptive import next_draft_len
from specquant.spec_decode.config import SpecConfig
from specquant.spec_decode.drafter import Draft, Drafter
from specquant.spec_decode.metrics import SpecMetrics
from specquant.spec_decode.verify import verify


def prefill(target: Stepper, drafter: Drafter, prompt_ids: torch.Tensor, sampling: SamplingConfig,
            generator: torch.Generator | None) -> int:
    """Target forward over prompt_ids [1, L] -> the first new token; the drafter takes the prompt (and the
    target's hidden states of it, from the same forward)."""
    logits, hidden = target.step(prompt_ids, 0, last_only=True, hidden_layers=drafter.target_layers)
    first = int(next_token(logits[0, -1], sampling, generator))
    drafter.prefill(prompt_ids, hidden)
    return first


def decode_steps(target: Stepper, drafter: Drafter, seq: torch.Tensor, n: int, max_new: int, config: SpecConfig,
                 sampling: SamplingConfig, generator: torch.Generator | None,
                 metrics: SpecMetrics) -> Iterator[list[int]]:
    """After `prefill`: yields each verify step's tokens (accepted drafts + one) until max_new more tokens.

    seq [1, capacity]: the committed sequence in seq[:, :n] (prompt + first token), extended in place.
    """
    k, emitted = config.draft_len, 0
    while emitted < max_new:
        k_step = min(k, max_new - emitted - 1)  # the step emits at most k_step + 1 tokens
        draft = drafter.propose(seq[:, :n], k_step, sampling, generator) if k_step else Draft.empty(1, seq.device)
        proposed = draft.tokens.shape[1]
        # queued now, on the host by the time verify reads `accepted` (the step's one sync; no-op on CPU)
        draft_host = draft.tokens.to("cpu", non_blocking=True)
        block = torch.cat([seq[:, n - 1 : n], draft.tokens], dim=1)  # [1, proposed + 1]
        logits, hidden = target.step(block, n - 1, last_only=False, hidden_layers=drafter.target_layers)
        probs = None if draft.probs is None else draft.probs[0]
        accepted, bonus = verify(draft.tokens[0], probs, logits[0], sampling, generator)
        target.rollback(n + accepted)
        drafter.accept(n + accepted, None if hidden is None else hidden[:, : accepted + 1])
        metrics.record_step(proposed, accepted)
        new = draft_host[0, :accepted].tolist() + [bonus]
        seq[0, n : n + accepted] = draft.tokens[0, :accepted]  # device to device: no host round trip
        seq[0, n + accepted] = bonus
        n, emitted = n + len(new), emitted + len(new)
        k = next_draft_len(k, proposed, accepted, config)
        yield new
