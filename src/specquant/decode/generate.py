"""Target-only decoding on the static KV cache: one prefill, then one token per forward.

Timing convention (shared with speculative decoding and the bench): the prefill forward yields the first new token
and is `prefill_s` (time to first token); every later token is decode time. `tokens_per_s` and `tpot_s` below are
the only definitions of those two numbers in specquant.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specquant.decode.compiled import Stepper
from specquant.decode.sampling import SamplingConfig, next_token
from specquant.errors import SpecquantError
from specquant.model.decoder import Transformer
from specquant.util.device import sync


@dataclass
class GenerationResult:
    token_ids: list[list[int]]  # new tokens per batch row (prompt excluded)
    stats: dict = field(default_factory=dict)  # JSON-ready numbers
    spec: object | None = None  # speculative requests: this request's spec_decode.metrics.SpecMetrics (an object)


def tokens_per_s(new_tokens: int, latency_s: float) -> float:
    """specquant's one definition of tokens/s: new tokens / wall seconds of the whole request, prefill included
    (what a caller waiting for the answer gets). Decode speed alone is reported as TPOT (`tpot_s`), never as a
    second kind of tokens/s."""
    return new_tokens / latency_s if latency_s > 0 else 0.0


def tpot_s(new_tokens: int, latency_s: float, ttft_s: float) -> float:
    """Time per output token after the first: (latency - time to first token) / (new_tokens - 1)."""
    return (latency_s - ttft_s) / (new_tokens - 1) if new_tokens > 1 else 0.0


def request_stats(new_tokens: int, prefill_s: float, decode_s: float) -> dict:
    """The timing stats of one generate call (plain or speculative)."""
    latency = prefill_s + decode_s
    return {"new_tokens": new_tokens, "prefill_s": prefill_s, "decode_s": decode_s,
            "tokens_per_s": tokens_per_s(new_tokens, latency), "tpot_s": tpot_s(new_tokens, latency, prefill_s)}


def check_context(model: Transformer, prompt_len: int, max_new_tokens: int, role: str = "target") -> int:
    """Validate lengths against the model's context; returns the cache length needed."""
    if prompt_len < 1:
        raise SpecquantError("the prompt is empty; give at least one token")
    if max_new_tokens < 1:
        raise SpecquantError(f"max_new_tokens {max_new_tokens} must be at least 1")
    limit = model.config.max_position_embeddings
    need = prompt_len + max_new_tokens
    if need > limit:
        raise SpecquantError(
            f"prompt of {prompt_len} tokens + max_new_tokens {max_new_tokens} = {need} exceeds the {role} model's "
            f"context of {limit} tokens; shorten the prompt or lower --max-new-tokens"
        )
    return need


@torch.no_grad()
def generate(model: Transformer | Stepper, prompt_ids: torch.Tensor, max_new_tokens: int,
             sampling: SamplingConfig | None = None, stop_on_eos: bool = True) -> GenerationResult:
    """prompt_ids [batch, prompt_len] (rows share one length) -> new tokens and timing stats.

    Pass a `Stepper(model, compile=True)` or `Stepper(model, aot="cached")` instead of the model for a compiled
    decode step.
    """
    step = model if isinstance(model, Stepper) else Stepper(model)
    model = step.model
    sampling = (sampling or SamplingConfig()).validate()
    device = prompt_ids.device
    batch, plen = prompt_ids.shape
    need = check_context(model, plen, max_new_tokens)
    step.setup(batch, need)
    gen = torch.Generator(device=device).manual_seed(sampling.seed)
    eos = torch.tensor(model.config.eos_ids or [-1], device=device)

    sync(device)
    t0 = time.perf_counter()
    logits = step(prompt_ids, 0, last_only=True)
    tok = next_token(logits[:, -1], sampling, gen)  # [batch]
    sync(device)
    t1 = time.perf_counter()
    out = [tok]
    done = torch.isin(tok, eos) if stop_on_eos else torch.zeros_like(tok, dtype=torch.bool)
    pos = plen
    while len(out) < max_new_tokens and not bool(done.all()):
        logits = step(tok[:, None], pos, last_only=True)
        tok = next_token(logits[:, -1], sampling, gen)
        out.append(tok)
        pos += 1
        if stop_on_eos:
            done |= torch.isin(tok, eos)
    sync(device)
    t2 = time.perf_counter()
    tokens = torch.stack(out, dim=1).tolist()
    if stop_on_eos:
        tokens = [_cut_after_eos(row, set(model.config.eos_ids)) for row in tokens]
    stats = {**request_stats(len(out), t1 - t0, t2 - t1), "target_forwards": len(out)}
    return GenerationResult(tokens, stats)


def _cut_after_eos(row: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(row):
        if t in eos:
            return row[: i + 1]
    return row
