"""Quality of a quantized model against its unquantized twin on the same tokens: KL, perplexity, top-1 match."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


@torch.no_grad()
def logprobs(model, tokens: torch.Tensor, batch_size: int = 4) -> list[torch.Tensor]:
    """Per-batch float32 log-probabilities [b, T, vocab] for tokens [samples, T] (cache once, compare many)."""
    return [F.log_softmax(model(tokens[i : i + batch_size]).float(), dim=-1)
            for i in range(0, len(tokens), batch_size)]


@torch.no_grad()
def compare(reference, model, tokens: torch.Tensor, batch_size: int = 4, kept: torch.Tensor | None = None,
            per_sample: bool = False) -> dict:
    """KL(reference ‖ model) per position (nats, mean over samples·T), perplexity of both on next-token
    prediction, and the fraction of positions whose argmax agrees. `reference` is a model or logprobs(...) of
    one on the same tokens and batch_size. `nll_tokens` (a tensor, per predicted token, model minus reference)
    is there for paired significance tests. `kl_sem` is the standard error of `kl` with the samples (sequences)
    as the independent units: positions inside one sequence are correlated, so a per-position SEM would be too
    small. per_sample: also `kl_per_sample` [samples] (float64), for paired comparisons of models on these tokens.

    kept [N'] (a vocabulary-pruned model, specquant/quant/prune_vocab.py): model reads and predicts indices of kept
    (tokens are such indices; the reference reads kept[tokens]). Its distribution is zero off the kept ids, so
    KL(reference || model) over the full vocabulary is infinite; here the missing mass is split off and reported,
    not hidden: `kl` is KL(reference renormalised over the kept ids || model), `lost_mass` the mean reference
    probability on the cut ids (what the model cannot say at all), and top-1 / perplexity compare over the full
    vocabulary (a reference argmax on a cut id is a disagreement)."""
    if kept is not None:
        return _compare_pruned(reference, model, tokens, batch_size, kept)
    if isinstance(reference, list):
        ref_batches = reference
    else:  # one batch at a time, so memory does not grow with the number of samples
        ref_batches = (F.log_softmax(reference(tokens[i : i + batch_size]).float(), dim=-1)
                       for i in range(0, len(tokens), batch_size))
    model_batches = (F.log_softmax(model(tokens[i : i + batch_size]).float(), dim=-1)
                     for i in range(0, len(tokens), batch_size))
    return _score(tokens, batch_size, ref_batches, model_batches, per_sample)


@torch.no_grad()
def compare_rows(reference_rows, model_rows, tokens: torch.Tensor, batch_size: int = 4) -> dict:
    """compare() for logits that come from somewhere other than a model's forward on the tokens: reference_rows(i,
    j) and model_rows(i, j) return the logits [j - i, T, vocab] of tokens[i:j] (lean QAD applies each head to
    final hidden states it streamed through the layers). Same keys, same arithmetic."""
    starts = range(0, len(tokens), batch_size)
    ref_batches = (F.log_softmax(reference_rows(i, i + batch_size).float(), dim=-1) for i in starts)
    model_batches = (F.log_softmax(model_rows(i, i + batch_size).float(), dim=-1) for i in starts)
    return _score(tokens, batch_size, ref_batches, model_batches)


def _score(tokens: torch.Tensor, batch_size: int, ref_batches, model_batches, per_sample: bool = False) -> dict:
    """compare's arithmetic over batches of log-probabilities [b, T, vocab] of tokens[i : i + batch_size]."""
    kl_sum, agree, n_pos, kl_per_sample = 0.0, 0, 0, []
    nll_ref, nll_model = [], []
    for i, ref_logp, logp in zip(range(0, len(tokens), batch_size), ref_batches, model_batches):
        batch = tokens[i : i + batch_size]
        kl_rows = (ref_logp.exp() * (ref_logp - logp)).sum(-1)  # [b, T]
        kl_sum += float(kl_rows.sum())
        kl_per_sample.append(kl_rows.double().mean(-1))
        agree += int((ref_logp.argmax(-1) == logp.argmax(-1)).sum())
        n_pos += batch.numel()
        target = batch[:, 1:].unsqueeze(-1)
        nll_ref.append(-ref_logp[:, :-1].gather(-1, target).flatten())
        nll_model.append(-logp[:, :-1].gather(-1, target).flatten())
    extra = {"kl_per_sample": torch.cat(kl_per_sample)} if per_sample else {}
    return {**_summary(kl_sum, kl_per_sample, agree, n_pos, nll_ref, nll_model), **extra}


def _compare_pruned(reference, model, tokens: torch.Tensor, batch_size: int, kept: torch.Tensor) -> dict:
    """compare() for a vocabulary-pruned model; the same keys plus lost_mass."""
    kept = kept.to(tokens.device)
    kl_sum, lost_sum, agree, n_pos, kl_per_sample = 0.0, 0.0, 0, 0, []
    nll_ref, nll_model = [], []
    for i in range(0, len(tokens), batch_size):
        batch = tokens[i : i + batch_size]  # [b, T] indices of kept
        ref_logp = F.log_softmax(reference(kept[batch]).float(), dim=-1)  # [b, T, vocab]
        logp = F.log_softmax(model(batch).float(), dim=-1)  # [b, T, N']
        ref_kept = ref_logp[..., kept]  # [b, T, N']
        kept_mass = ref_kept.logsumexp(-1)  # [b, T] log of the reference's mass on the kept ids
        ref_renorm = ref_kept - kept_mass.unsqueeze(-1)
        kl_rows = (ref_renorm.exp() * (ref_renorm - logp)).sum(-1)  # [b, T]
        kl_sum += float(kl_rows.sum())
        lost_sum += float((1 - kept_mass.exp()).clamp_min(0).sum())
        kl_per_sample.append(kl_rows.double().mean(-1))
        agree += int((ref_logp.argmax(-1) == kept[logp.argmax(-1)]).sum())
        n_pos += batch.numel()
        target = batch[:, 1:].unsqueeze(-1)
        nll_ref.append(-ref_logp[:, :-1].gather(-1, kept[target]).flatten())
        nll_model.append(-logp[:, :-1].gather(-1, target).flatten())
    return _summary(kl_sum, kl_per_sample, agree, n_pos, nll_ref, nll_model, lost_mass=lost_sum / n_pos)


def _summary(kl_sum: float, kl_per_sample: list, agree: int, n_pos: int, nll_ref: list, nll_model: list,
             **extra) -> dict:
    """compare()'s result from the per-batch sums and rows (extra: the pruned model's lost_mass, after kl_sem)."""
    nll_ref, nll_model = torch.cat(nll_ref), torch.cat(nll_model)
    kl_per_sample = torch.cat(kl_per_sample)
    n = len(kl_per_sample)
    return {
        "kl": kl_sum / n_pos,
        "kl_sem": float(kl_per_sample.std() / math.sqrt(n)) if n > 1 else math.nan,
        **extra,
        "samples": n,
        "ppl": math.exp(float(nll_model.mean())),
        "ppl_ref": math.exp(float(nll_ref.mean())),
        "top1_agree": agree / n_pos,
        "nll_tokens": nll_model - nll_ref,
    }


def heldout_tokens(tokenizer, path, samples: int, seq_len: int) -> torch.Tensor:
    """Evaluation blocks from held-out text, cut the same way as calibration blocks."""
    from specquant.quant.calib import calibration_tokens

    return calibration_tokens(tokenizer, path, samples, seq_len)
