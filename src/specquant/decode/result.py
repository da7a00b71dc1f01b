"""What one generation returns and how it is timed; the decoding itself is spec_decode (SpecEngine, and
`spec_decode.engine.generate` for target-only decoding: the same loop with a drafter that proposes nothing).

Timing convention (shared by every engine and the bench): the prefill forward yields the first new token and is
`prefill_s` (time to first token); every later token is decode time. `tokens_per_s` and `tpot_s` below are the
only definitions of those two numbers in specquant.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specquant.errors import SpecquantError
from specquant.model.decoder import Transformer


@dataclass
class GenerationResult:
    token_ids: list[list[int]]  # new tokens per batch row (prompt excluded)
    stats: dict = field(default_factory=dict)  # JSON-ready numbers
    spec: object | None = None  # speculative engines: this request's spec_decode.metrics.SpecMetrics (an object)


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
