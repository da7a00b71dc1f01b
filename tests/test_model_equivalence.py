"""Our decoder against transformers (the reference), in float32 to 1e-4, through every cache path we use.

Paths: full prefill, prefill + one token at a time through the static cache, chunked prefill; RoPE scaling
variants; sliding-window attention on the ring cache against a hand-written masked-softmax reference; O(1) rollback;
bfloat16; and the config.json round trip in both directions.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import VOCAB, build_pair, ours_from_hf, randomize_, random_model, tiny_config
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.llama import modeling_llama

from specquant.errors import SpecquantError
from specquant.model.config import ModelConfig
from specquant.model.decoder import Transformer

# float32 end to end: differences come only from summation order (SDPA vs eager matmul), ~1e-6 at these sizes.
ATOL = 1e-4

CASES = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),  # bias on q/k/v/o and the MLP
    "qwen2": ("qwen2", {}),  # Qwen2 always has q/k/v bias, none on o_proj
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {}),  # per-head q/k RMSNorm
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True}),
    "qwen3-bias": ("qwen3", {"attention_bias": True}),
}


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@torch.no_grad()
def cached_logits(model: Transformer, ids: torch.Tensor, blocks: list[int], max_seq_len: int | None = None,
                  **cache_kw) -> torch.Tensor:
    """Feed ids [batch, T] through a fresh static cache in consecutive blocks -> logits [batch, T, vocab]."""
    assert sum(blocks) == ids.shape[1]
    model.setup_cache(ids.shape[0], max_seq_len or ids.shape[1], **cache_kw)
    out, pos = [], 0
    try:
        for n in blocks:
            out.append(model(ids[:, pos : pos + n], pos))
            pos += n
    finally:
        model.clear_cache()  # module-scoped models go back to cache-free for the next test
    return torch.cat(out, dim=1)


@pytest.fixture(scope="module", params=list(CASES))
def pair(request):
    model_type, overrides = CASES[request.param]
    hf, ours = build_pair(model_type, **overrides)
    if overrides.get("tie_word_embeddings"):
        assert ours.lm_head.weight is ours.model.embed_tokens.weight
    return hf, ours


@torch.no_grad()
def test_full_prefill_matches_transformers(pair):
    hf, ours = pair
    ids = tokens(2, 16)
    assert max_diff(ours(ids), hf(ids).logits) <= ATOL


@torch.no_grad()
def test_token_by_token_decode_matches_transformers(pair):
    hf, ours = pair
    ids = tokens(2, 16, seed=2)
    ref = hf(ids).logits  # [2, 16, vocab]
    got = cached_logits(ours, ids, [5] + [1] * 11, max_seq_len=32)  # cache larger than used: stale slots unread
    assert max_diff(got, ref) <= ATOL


@torch.no_grad()
def test_chunked_prefill_matches_transformers(pair):
    hf, ours = pair
    ids = tokens(2, 17, seed=3)
    assert max_diff(cached_logits(ours, ids, [6, 4, 7]), hf(ids).logits) <= ATOL


# --- RoPE scaling -------------------------------------------------------------------------------------------------

# llama3 with original context 256 and head_dim 16 puts frequencies in all three bands (wavelengths 6..2e4):
# kept (< 64), smoothed (64..256) and divided by the factor (> 256). yarn's ramp likewise spans several dims.
ROPE = {
    "linear": ("llama", {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    "llama3": ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 256, "rope_theta": 10000.0}),
    "yarn": ("qwen3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                       "rope_theta": 1000.0}),
}


@pytest.mark.parametrize("variant", list(ROPE))
@torch.no_grad()
def test_rope_scaling_matches_transformers(variant):
    model_type, params = ROPE[variant]
    hf, ours = build_pair(model_type, rope_parameters=params, max_position_embeddings=256)
    assert ours.config.rope_scaling["rope_type"] == variant  # read from rope_parameters, not dropped
    ids = tokens(1, 40, seed=4)
    ref = hf(ids).logits
    assert max_diff(ours(ids), ref) <= ATOL
    assert max_diff(cached_logits(ours, ids, [20] + [1] * 20), ref) <= ATOL
    # the scaling must matter, or this test could not tell a dropped rope_scaling from a correct one
    plain = ours_from_hf(hf, rope_scaling=None)
    assert max_diff(plain(ids), ref) > 1e-2


def test_dynamic_rope_is_refused():
    hf_cfg = tiny_config("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    cfg = ModelConfig.from_hf(hf_cfg.to_dict())
    with pytest.raises(SpecquantError, match="dynamic"):
        Transformer(cfg)


# --- sliding window -------------------------------------------------------------------------------------------------

WINDOW = 5


def windowed_reference_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """softmax(QK^T * scale + mask) V where query p sees keys in (p - W, p]; replaces HF's eager attention.

    query [batch, heads, T, d], key/value [batch, kv_heads, T, d]: a cache-free forward, so positions are 0..T-1.
    """
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    t = query.shape[2]
    qpos, kpos = torch.arange(t)[:, None], torch.arange(t)[None, :]
    allowed = (kpos <= qpos) & (kpos > qpos - WINDOW)  # [T, T]
    mask = torch.zeros(t, t).masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(query @ key.transpose(2, 3) * scaling + mask, dim=-1)
    return (weights @ value).transpose(1, 2).contiguous(), weights


@pytest.fixture(scope="module")
def windowed():
    """(HF llama with the hand-written windowed attention, our llama with sliding_window=W, same weights)."""
    hf, _ = build_pair("llama", seed=5)
    ours = ours_from_hf(hf, sliding_window=WINDOW)
    assert ours.model.layers[0].self_attn.window == WINDOW
    return hf, ours


@pytest.fixture
def window_reference(windowed, monkeypatch):
    hf, _ = windowed
    monkeypatch.setattr(modeling_llama, "eager_attention_forward", windowed_reference_attention)

    @torch.no_grad()
    def reference(ids):
        return hf(ids).logits

    return reference


@torch.no_grad()
def test_cache_free_window_matches_masked_reference(windowed, window_reference):
    hf, ours = windowed
    ids = tokens(2, 24, seed=6)
    ref = window_reference(ids)
    assert max_diff(ours(ids), ref) <= ATOL
    # the window must change the result past position W, or the reference would prove nothing
    assert max_diff(ours_from_hf(hf)(ids)[:, WINDOW:], ref[:, WINDOW:]) > 1e-2


@pytest.mark.parametrize("blocks", [[7] + [1] * 17, [9, 4, 11], [24]], ids=["token-by-token", "chunked", "one-call"])
@torch.no_grad()
def test_ring_cache_matches_masked_reference(windowed, window_reference, blocks):
    """Prompts longer than W and than max_block (the forward splits them); the ring wraps several times."""
    _, ours = windowed
    ids = tokens(2, 24, seed=7)
    max_block = 4
    ours.setup_cache(2, 24, max_block=max_block)
    capacity = ours.cache_capacity()
    ours.clear_cache()
    assert capacity == WINDOW + max_block - 1 < 24 / 2  # a ring, not a full cache in disguise
    got = cached_logits(ours, ids, blocks, max_block=max_block)
    assert max_diff(got, window_reference(ids)) <= ATOL
    assert max_diff(got, ours(ids)) <= ATOL  # and against our own cache-free windowed forward


# --- O(1) rollback --------------------------------------------------------------------------------------------------

@torch.no_grad()
def decode_positions(model: Transformer, ids: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """One forward per position start..end-1 on the live cache -> logits [batch, end-start, vocab]."""
    return torch.cat([model(ids[:, p : p + 1], p) for p in range(start, end)], dim=1)


@pytest.mark.parametrize("window,rollback_to", [(None, 10), (6, 13)], ids=["full-cache", "ring-cache"])
@torch.no_grad()
def test_rollback_equals_fresh_run(window, rollback_to):
    """Decode 20 positions, roll back by passing an earlier start_pos, continue with other tokens: identical to a
    fresh run of the new sequence. The ring allows rolling back max_block - 1 = 7 positions (20 -> 13)."""
    model = random_model("qwen3", seed=8, sliding_window=window)
    first, second = tokens(1, 20, seed=9), tokens(1, 26, seed=10)
    second[:, :rollback_to] = first[:, :rollback_to]
    max_block = 8

    model.setup_cache(1, 26, max_block=max_block)
    model(first[:, :5], 0)
    decode_positions(model, first, 5, 20)
    rolled = decode_positions(model, second, rollback_to, 26)  # no cache reset: stale slots must go unread

    model.setup_cache(1, 26, max_block=max_block)
    model(second[:, :5], 0)
    fresh = decode_positions(model, second, 5, 26)[:, rollback_to - 5 :]
    model.clear_cache()
    # same ops on the same cache contents in the same order: bit-identical, not merely close
    assert torch.equal(rolled, fresh)
    assert max_diff(rolled, model(second)[:, rollback_to:]) <= ATOL


# --- bfloat16 -------------------------------------------------------------------------------------------------------

def mean_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().mean().item()


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
@torch.no_grad()
def test_bfloat16_close_to_transformers_bfloat16(model_type):
    """bf16 rounds every op to 8 significand bits and the two implementations round in different places (SDPA vs
    eager matmul, where the casts sit), so they cannot agree bit for bit. Measured on these models (|logit| <= ~5):
    each lands a mean 0.007 and at most 0.03-0.045 from the fp32 logits, and they differ from each other by at most
    ~0.03-0.05. Tolerances: at most 0.1 apart (about 3 bf16 ulps at |logit| in [4, 8)), and our mean error against
    fp32, full and cached, within 1.25x transformers' own (measured ratio 0.93-1.0). A real bug (wrong RoPE table
    dtype, a dropped cast) moves logits by far more than this."""
    hf32, ours32 = build_pair(model_type, seed=11)
    hf16, ours16 = build_pair(model_type, seed=11, dtype=torch.bfloat16)
    ids = tokens(2, 16, seed=12)
    ref32 = hf32(ids).logits
    got16, hf_got16 = ours16(ids), hf16(ids).logits
    assert got16.dtype == hf_got16.dtype == torch.bfloat16
    assert max_diff(got16, hf_got16) <= 0.1
    hf_error = mean_abs(hf_got16, ref32)
    assert mean_abs(got16, ref32) <= 1.25 * hf_error
    assert mean_abs(cached_logits(ours16, ids, [5] + [1] * 11), ref32) <= 1.25 * hf_error
    assert max_diff(ours32(ids), ref32) <= ATOL


# --- config.json round trip -----------------------------------------------------------------------------------------

ROUND_TRIP = {
    "llama-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama-llama3": ("llama", {"rope_parameters": ROPE["llama3"][1]}),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3-yarn": ("qwen3", {"rope_parameters": ROPE["yarn"][1]}),
}


@pytest.mark.parametrize("case", list(ROUND_TRIP))
@torch.no_grad()
def test_config_round_trip_and_transformers_builds_it(case):
    model_type, overrides = ROUND_TRIP[case]
    cfg = ModelConfig.from_hf(tiny_config(model_type, **overrides).to_dict())
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    with_window = dataclasses.replace(cfg, sliding_window=7)
    assert ModelConfig.from_hf(with_window.to_hf()) == with_window

    ours = randomize_(Transformer(cfg), seed=13).eval()
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg.to_hf()), attn_implementation="eager").eval()
    hf.load_state_dict(ours.state_dict(), strict=True)
    ids = tokens(2, 12, seed=14)
    assert max_diff(ours(ids), hf(ids).logits) <= ATOL


def test_sdpa_reference_agrees_too():
    """transformers' default (SDPA) attention gives the same logits as its eager path we compare against."""
    hf, ours = build_pair("qwen3", seed=15, attn_implementation="sdpa")
    ids = tokens(2, 16, seed=16)
    with torch.no_grad():
        assert max_diff(ours(ids), hf(ids).logits) <= ATOL


@pytest.mark.parametrize("bias", [False, True])
def test_small_rows_linear_matches_f_linear(bias):
    # Linear's W·xᵀ path (fp32, 5..8 rows, big enough weight) is the same product as F.linear up to summation order
    from specquant.model.decoder import SMALL_MIN_WEIGHT, SMALL_ROWS, Linear

    torch.manual_seed(0)
    wide = Linear(256, SMALL_MIN_WEIGHT // 256, bias=bias)
    narrow = Linear(SMALL_MIN_WEIGHT // 256, 256, bias=bias)
    small = Linear(96, 160, bias=bias)  # too small: always F.linear
    for lin in (wide, narrow, small):
        for lead in [(1,), (2,), (1, 5), (2, 4), (6,), (8,), (9,), (1, 1), (40,)]:
            x = torch.randn(*lead, lin.in_features)
            got, want = lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias)
            assert got.shape == want.shape and got.is_contiguous()
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            rows = x.numel() // lin.in_features
            fast = SMALL_ROWS[0] <= rows <= SMALL_ROWS[1] and lin.weight.numel() >= SMALL_MIN_WEIGHT
            if not fast:
                assert torch.equal(got, want)  # outside the fast path it is F.linear itself
    xb = torch.randn(4, 256, dtype=torch.bfloat16)
    wide_b = wide.to(torch.bfloat16)
    assert torch.equal(wide_b(xb), torch.nn.functional.linear(xb, wide_b.weight, wide_b.bias))
