"""Verification rules of speculative decoding (Leviathan et al. 2023; Chen et al. 2023).

Terms, used throughout specquant:
- draft tokens: the k tokens x_1..x_k the draft model proposes, x_i ~ draft_probs_i. A point-mass draft
  (draft_probs None: a model-free drafter, e.g. one copying text) put probability 1 on each x_i; the rules below
  then hold with draft_probs_i = one_hot(x_i).
- accepted tokens: the longest prefix the verifier keeps. In sampling mode x_i is kept with probability
  min(1, target_probs_i(x_i) / draft_probs_i(x_i)); in greedy mode iff x_i == argmax target_probs_i.
- recovered token: at the first rejected position j, a token drawn from normalize(max(0, target_probs_j -
  draft_probs_j)) (greedy: the target's argmax). Accepted + recovered tokens are distributed exactly as the target.
- bonus token: when all k are accepted, one more token drawn from target_probs_{k+1} for free.
Every verify step therefore emits accepted + 1 tokens.

`verify` is the one entry point the speculative loop calls. The rules below it take their randomness as
arguments (uniforms and exponential noise), so the vectorised sampler and the plain reference can be compared
exactly on the same numbers.
"""

from __future__ import annotations

import torch

from specquant.decode.sampling import SamplingConfig, argmax, logits_to_probs, next_token


def verify(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
           sampling: SamplingConfig, generator: torch.Generator | None) -> tuple[int, int]:
    """One verify step: (accepted count, recovered-or-bonus token).

    draft_tokens [k] (k may be 0); draft_probs [k, vocab] (sampling mode; None when greedy, or for point-mass
    drafts: each drafted token had probability 1); target_logits
    [k+1, vocab]: the target's logits at the last emitted token and at each draft token.
    """
    k = draft_tokens.shape[0]
    if k == 0:
        return 0, int(next_token(target_logits[-1], sampling, generator))
    if sampling.greedy:
        return greedy_verify(draft_tokens, target_logits)
    target_probs = logits_to_probs(target_logits, sampling)
    device = target_logits.device
    uniforms = torch.rand(k, generator=generator, device=device)
    noise = torch.empty(target_probs.shape[-1], device=device).exponential_(generator=generator)
    return rejection_sample(draft_tokens, draft_probs, target_probs, uniforms, noise)


def greedy_verify(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """draft_tokens [k], target_logits [k+1, vocab] -> (accepted count, recovered-or-bonus token)."""
    k = draft_tokens.shape[0]
    target_tokens = argmax(target_logits)  # [k+1]
    matches = (target_tokens[:k] == draft_tokens).int()
    accepted = matches.cumprod(0).sum()
    accepted, token = torch.stack([accepted, target_tokens[accepted]]).tolist()  # the step's one host sync
    return accepted, token


def rejection_sample(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                     uniforms: torch.Tensor, noise: torch.Tensor) -> tuple[int, int]:
    """Sampling-mode verification.

    draft_tokens [k]; draft_probs [k, vocab], or None for point-mass drafts (probability 1 on each draft token);
    target_probs [k+1, vocab]; uniforms [k] in [0, 1); noise [vocab] Exp(1) draws for the recovered/bonus token
    (exponential race: argmax probs / noise). Returns (accepted count, recovered-or-bonus token).
    """
    k = draft_tokens.shape[0]
    idx = torch.arange(k, device=draft_tokens.device)
    p = target_probs[idx, draft_tokens]  # [k] target prob of each draft token
    if draft_probs is None:
        keep = (uniforms <= p).int()  # q = 1: kept with probability p
    else:
        q = draft_probs[idx, draft_tokens]  # [k] draft prob of each draft token (> 0: the token was drawn from it)
        keep = (uniforms * q <= p).int()  # u < p/q without a division
    accepted = keep.cumprod(0).sum()  # stays on the device: the step reads it once, with the token, below
    target_row = target_probs[accepted]  # [vocab]; row k (bonus) when every draft token was kept
    if draft_probs is None:
        # max(0, p - one_hot(x)) is p with the rejected token x zeroed (p <= 1); the bonus row (index k, no x)
        # takes target_row below, so the placeholder 0 there is never used
        rejected = torch.cat([draft_tokens, draft_tokens.new_zeros(1)])[accepted]
        residual = target_row.scatter(0, rejected.view(1), 0.0)
    else:
        draft_row = torch.cat([draft_probs, draft_probs.new_zeros(1, draft_probs.shape[1])])[accepted]
        residual = (target_row - draft_row).clamp_min(0)
    total = residual.sum()
    # p == q up to rounding cannot reject in exact arithmetic; if it did, p itself is the right law
    dist = torch.where((accepted == k) | (total <= 0), target_row, residual / total.clamp_min(1e-30))
    accepted, token = torch.stack([accepted, argmax(dist / noise)]).tolist()  # the step's one host sync
    return accepted, token


def rejection_sample_reference(draft_tokens, draft_probs, target_probs, uniforms, noise) -> tuple[int, int]:
    """The same rule written as a plain loop over Python numbers; the test oracle for rejection_sample.
    draft_probs None: point-mass drafts."""
    k = len(draft_tokens)
    for i in range(k):
        x = int(draft_tokens[i])
        row = [1.0 if j == x else 0.0 for j in range(len(target_probs[i]))] if draft_probs is None \
            else [float(b) for b in draft_probs[i]]
        p_x, q_x = float(target_probs[i][x]), row[x]
        if not float(uniforms[i]) * q_x <= p_x:
            residual = [max(0.0, float(a) - b) for a, b in zip(target_probs[i], row)]
            total = sum(residual)
            dist = [r / total for r in residual] if total > 0 else [float(a) for a in target_probs[i]]
            return i, _race(dist, noise)
    return k, _race([float(a) for a in target_probs[k]], noise)


def _race(dist, noise) -> int:
    scores = [d / float(e) for d, e in zip(dist, noise)]
    return max(range(len(scores)), key=lambda j: scores[j])
