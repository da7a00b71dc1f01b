"""Qwen3.5 layer kinds (model/norms, gated_delta, deltanet, gated_attention) against transformers' own modules.

Oracle: transformers' Qwen3_5ForCausalLM built from a small random Qwen3_5TextConfig (no download), run in fp32 on
CPU with its torch reference of the gated delta rule; weights are copied HF -> ours by name. Tolerances are fp32
rounding (a different summation order): 1e-5 on layer outputs, 1e-4 on logits.
"""

from __future__ import annotations

import pytest
import torch
from _qwen35_models import SHAPES, hf_config, hf_model, hf_qwen35

from specquant.errors import SpecquantError
from specquant.model import gated_delta as GD
from specquant.model.config import ModelConfig
from specquant.model.deltanet import GatedDeltaNet
from specquant.model.gated_attention import GatedAttention
from specquant.model.layers import layer_kinds
from specquant.model.modules import Linear
from specquant.model.norms import GatedRMSNorm, ZeroCentredRMSNorm
from specquant.model.rope import rope_tables

ATOL = 1e-5


def ours_config(hf) -> ModelConfig:
    """What the mixers read: the ModelConfig specquant builds from the same config.json."""
    return ModelConfig.from_hf(hf.to_dict())


def copy_into(ours: torch.nn.Module, theirs: torch.nn.Module):
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return ours.eval()


def mixer_pair(shape: str, kind: str, seed: int = 0):
    """(hf model, ours mixer, hf mixer, layer index) for the first layer of the given kind."""
    model = hf_model(shape, seed=seed)
    types_ = model.config.layer_types
    i = types_.index(kind)
    layer = model.model.layers[i]
    cfg = ours_config(model.config)
    if kind == "linear_attention":
        return model, copy_into(GatedDeltaNet(cfg), layer.linear_attn), layer.linear_attn, i
    return model, copy_into(GatedAttention(cfg), layer.self_attn), layer.self_attn, i


def rope(model, t: int, start: int = 0):
    cfg = model.config
    rot = ours_config(cfg).rotary_dim
    cos, sin = rope_tables(rot, cfg.rope_parameters["rope_theta"], None, cfg.max_position_embeddings, start + t)
    return cos[start:], sin[start:]


def causal_mask(t: int):
    return torch.full((t, t), float("-inf")).triu(1)[None, None]


def hf_attention(model, attn, x):
    t = x.shape[1]
    pos = model.model.rotary_emb(x, torch.arange(t)[None])
    return attn(x, position_embeddings=pos, attention_mask=causal_mask(t))[0]


# ---------------------------------------------------------------- norms and the rule


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_match_transformers(dtype):
    torch.manual_seed(0)
    x, gate = torch.randn(3, 5, 20).to(dtype), torch.randn(3, 5, 20).to(dtype)
    theirs, ours = hf_qwen35.Qwen3_5RMSNorm(20), ZeroCentredRMSNorm(20)
    theirs.weight.data.normal_(0, 0.5)
    copy_into(ours, theirs)
    tol = dict(atol=ATOL, rtol=ATOL) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)  # bf16: 1 ulp
    torch.testing.assert_close(ours(x), theirs(x), **tol)
    theirs_g, ours_g = hf_qwen35.Qwen3_5RMSNormGated(20), GatedRMSNorm(20)
    theirs_g.weight.data.normal_(1, 0.5)
    copy_into(ours_g, theirs_g)
    torch.testing.assert_close(ours_g(x, gate), theirs_g(x, gate), **tol)
    torch.testing.assert_close(ours_g.fp32(x, gate, dtype), theirs_g(x, gate), **tol)  # DeltaNet's fast form
    assert torch.equal(ZeroCentredRMSNorm(4).weight, torch.zeros(4)) and torch.equal(GatedRMSNorm(4).weight,
                                                                                      torch.ones(4))


def rule_inputs(b=2, t=37, hk=2, hv=4, k=12, v=20, seed=0):
    torch.manual_seed(seed)
    q, key = torch.randn(b, t, hk, k), torch.randn(b, t, hk, k)
    return (q, key, torch.randn(b, t, hv, v), -torch.rand(b, t, hv) * 2, torch.rand(b, t, hv),
            torch.randn(b, hv, k, v) * 0.3)


@pytest.mark.parametrize("heads", [(2, 4), (3, 3)])
def test_rule_forms_match_transformers(heads):
    q, k, v, g, beta, s0 = rule_inputs(hk=heads[0], hv=heads[1])
    ref, ref_state = hf_qwen35.torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0,
                                                                output_final_state=True, use_qk_l2norm_in_kernel=True)
    qn, kn, scale = GD.l2_normalize(q), GD.l2_normalize(k), q.shape[-1] ** -0.5
    out, state, delta = GD.recurrent_rule(qn, kn, v, g, beta, s0, scale)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(state, ref_state, atol=ATOL, rtol=ATOL)
    for chunk in (1, 5, 16, 64):  # 37 tokens: no chunk length divides it (but 1)
        out_c, state_c, delta_c = GD.chunk_rule(qn, kn, v, g, beta, s0, scale, chunk)
        torch.testing.assert_close(out_c, out, atol=ATOL, rtol=ATOL)
        torch.testing.assert_close(state_c, state, atol=ATOL, rtol=ATOL)
        torch.testing.assert_close(delta_c, delta, atol=ATOL, rtol=ATOL)
    ref_chunk, _ = hf_qwen35.torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16, initial_state=s0,
                                                          output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(GD.chunk_rule(qn, kn, v, g, beta, s0, scale, 16)[0], ref_chunk, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("heads", [(2, 4), (3, 3)])
@pytest.mark.parametrize("t", [1, 5])
def test_step_rule_matches_the_recurrent_reference(heads, t):
    """The decode step's form (fewer passes over the state) against recurrent_rule, the plain reference, from a
    non-zero state; gated_delta_rule takes it for one token unless fast=False."""
    q, k, v, g, beta, s0 = rule_inputs(t=t, hk=heads[0], hv=heads[1])
    qn, kn = GD.l2_normalize(q), GD.l2_normalize(k)
    ref = GD.recurrent_rule(qn, kn, v, g, beta, s0, 0.3)
    got = GD.step_rule(qn, kn, v, g, beta, s0, 0.3)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=ATOL)
    s_before = s0.clone()
    one = [x[:, :1] for x in (qn, kn, v, g, beta)]
    for fast, form in ((True, GD.step_rule), (False, GD.recurrent_rule)):
        assert all(torch.equal(a, b) for a, b in zip(GD.gated_delta_rule(*one, s0, 0.3, fast=fast),
                                                     form(*one, s0, 0.3)))
    assert torch.equal(s0, s_before)  # the state passed in is not modified (a cache keeps it as its anchor)


def test_state_after_every_position_equals_the_recurrence():
    q, k, v, g, beta, s0 = rule_inputs(t=17)
    qn, kn = GD.l2_normalize(q), GD.l2_normalize(k)
    _, _, delta = GD.chunk_rule(qn, kn, v, g, beta, s0, 1.0, 8)
    assert GD.state_after(s0, kn, delta, g, 0) is s0
    for j in range(1, 18):
        _, expect, _ = GD.recurrent_rule(qn[:, :j], kn[:, :j], v[:, :j], g[:, :j], beta[:, :j], s0, 1.0)
        torch.testing.assert_close(GD.state_after(s0, kn, delta, g, j), expect, atol=ATOL, rtol=ATOL)


def _fake_fla(calls: list):
    """A stand-in for flash-linear-attention's ops module (fla's call signature and layouts, our plain rule inside,
    requiring as many key heads as value heads as older fla versions do)."""
    import types

    def rule(name):
        def fn(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
            assert q.shape[2] == k.shape[2] == v.shape[2] and q.is_contiguous()
            calls.append(name)
            out, state, _ = GD.recurrent_rule(q, k, v, g, beta, initial_state, scale)
            return out, state if output_final_state else None
        return fn

    return types.SimpleNamespace(chunk_gated_delta_rule=rule("chunk"),
                                 fused_recurrent_gated_delta_rule=rule("recurrent"))


def test_flash_linear_attention_is_optional(monkeypatch):
    """fla is an optional CUDA extra: not installed, the plain forms run everywhere; installed, only forwards that
    need no per-token delta on CUDA take it, with grouped key heads repeated to the value heads."""
    import sys

    q, k, v, g, beta, s0 = rule_inputs(t=9)
    qn, kn = GD.l2_normalize(q), GD.l2_normalize(k)
    plain = GD.chunk_rule(qn, kn, v, g, beta, s0, 0.5)
    GD._fla_ops.cache_clear()
    monkeypatch.setitem(sys.modules, "fla", None)  # import fla -> ImportError, as when it is not installed
    try:
        assert GD._fla_ops() is None and not GD.fla_available(torch.device("cuda"))
        out, state, delta = GD.gated_delta_rule(qn, kn, v, g, beta, s0, 0.5, need_delta=False)
        assert torch.equal(out, plain[0]) and torch.equal(state, plain[1]) and delta is not None
    finally:
        GD._fla_ops.cache_clear()
    calls = []
    fake = _fake_fla(calls)
    monkeypatch.setattr(GD, "_fla_ops", lambda: (fake.chunk_gated_delta_rule, fake.fused_recurrent_gated_delta_rule))
    assert not GD.fla_available(torch.device("cpu"))  # GPU-only kernels: CPU never takes them
    GD.gated_delta_rule(qn, kn, v, g, beta, s0, 0.5, need_delta=False)
    assert calls == []
    monkeypatch.setattr(GD, "fla_available", lambda device: True)
    out, state, delta = GD.gated_delta_rule(qn, kn, v, g, beta, s0, 0.5, need_delta=False)
    assert calls == ["chunk"] and delta is None
    torch.testing.assert_close(out, plain[0], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(state, plain[1], atol=ATOL, rtol=ATOL)
    GD.gated_delta_rule(qn[:, :1], kn[:, :1], v[:, :1], g[:, :1], beta[:, :1], s0, 0.5, need_delta=False)
    assert calls == ["chunk", "recurrent"]
    GD.gated_delta_rule(qn, kn, v, g, beta, s0, 0.5, need_delta=True)  # a verify needs the deltas: plain form
    assert calls == ["chunk", "recurrent"]


# ---------------------------------------------------------------- mixers, full sequence


@pytest.mark.parametrize("shape", list(SHAPES))
def test_deltanet_full_sequence_matches_transformers(shape):
    _, ours, theirs, _ = mixer_pair(shape, "linear_attention")
    x = torch.randn(2, 29, 40)
    with torch.no_grad():
        expect = theirs(x)
        torch.testing.assert_close(ours(x, None, None, 0), expect, atol=ATOL, rtol=ATOL)
        for chunk in (4, 7, 64):
            ours.chunk_size = chunk
            torch.testing.assert_close(ours(x, None, None, 0), expect, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_gated_attention_full_sequence_matches_transformers(shape):
    model, ours, theirs, _ = mixer_pair(shape, "full_attention")
    x = torch.randn(2, 23, 40)
    cos, sin = rope(model, 23)
    with torch.no_grad():
        expect = hf_attention(model, theirs, x)
        torch.testing.assert_close(ours(x, cos, sin, 0), expect, atol=ATOL, rtol=ATOL)
        ours.qkv_proj = Linear.concat([ours.q_proj, ours.k_proj, ours.v_proj])  # model.fuse's layout
        ours.q_proj = ours.k_proj = ours.v_proj = None
        torch.testing.assert_close(ours(x, cos, sin, 0), expect, atol=ATOL, rtol=ATOL)


# ---------------------------------------------------------------- cached decoding and rollback


def feed(mixer, x, blocks, model=None):
    """Run x [b, T, hidden] through a cached mixer in blocks of the given sizes; returns the concatenated output."""
    outs, pos = [], 0
    for n in blocks:
        cos, sin = rope(model, n, pos) if model is not None else (None, None)
        outs.append(mixer(x[:, pos : pos + n], cos, sin, pos))
        pos += n
    assert pos == x.shape[1]
    return torch.cat(outs, 1)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_deltanet_cached_decoding_equals_full_sequence(shape, static):
    _, ours, _, _ = mixer_pair(shape, "linear_attention")
    x = torch.randn(2, 30, 40)
    with torch.no_grad():
        full = ours(x, None, None, 0)
        ours.cache = ours.make_cache(2, 64, torch.float32, "cpu", None, static, max_block=8)
        for blocks in ([10] + [1] * 20, [6] + [4] * 6, [5, 8, 8, 1, 8]):
            ours.cache.reset()
            torch.testing.assert_close(feed(ours, x, blocks), full, atol=ATOL, rtol=ATOL)
            assert ours.cache.length == 30


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("k", [0, 1, 3, 7, 15])  # k+1 = 1: the decode step (no factors, the kept state)
def test_deltanet_rollback_equals_a_run_that_saw_only_j_tokens(k, static):
    """Verify a block of k+1 tokens after a prompt, roll back to every accepted j, continue: outputs and states
    equal (fp32 rounding) a run that only ever saw the prompt and the first j block tokens."""
    _, ours, _, _ = mixer_pair("gva", "linear_attention")
    prompt, block, cont = 9, k + 1, 5
    x = torch.randn(2, prompt + block, 40)
    tail = torch.randn(2, cont, 40)
    with torch.no_grad():
        ours.cache = ours.make_cache(2, 64, torch.float32, "cpu", None, static, max_block=16)
        for j in range(block + 1):
            ours.cache.reset()
            ours(x[:, :prompt], None, None, 0)
            ours(x[:, prompt:], None, None, prompt)
            ours.cache.rollback(prompt + j)
            assert ours.cache.length == prompt + j
            state_j, conv_j = ours.cache.state.clone(), ours.cache.conv.clone()
            got = ours(tail, None, None, prompt + j)
            ours.cache.reset()  # the reference: never saw the rejected tokens
            ours(x[:, : prompt + j], None, None, 0)
            torch.testing.assert_close(state_j, ours.cache.state, atol=ATOL, rtol=ATOL)
            torch.testing.assert_close(conv_j, ours.cache.conv, atol=ATOL, rtol=ATOL)  # GEMMs of other row counts
            torch.testing.assert_close(got, ours(tail, None, None, prompt + j), atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("static", [False, True])
def test_deltanet_fast_path_matches_the_reference(dtype, static):
    """fast (fp32 from the conv to the gated norm, the tap conv, step_rule) against fast=False (transformers'
    casts, F.conv1d, recurrent_rule): a prefill, decode steps, verify blocks with rollbacks; outputs, states and
    conv states. fp32: float rounding; bf16: a few bf16 ulps of the output's scale (the reference rounds the conv
    and the rule's output to bf16 where the fast path keeps fp32)."""
    model, fast, _, _ = mixer_pair("gva", "linear_attention")
    plain = copy_into(GatedDeltaNet(ours_config(model.config)), fast)
    fast, plain = fast.to(dtype), plain.to(dtype)
    plain.fast = False
    x = torch.randn(2, 40, 40).to(dtype)
    schedule = [(0, 9), (9, 1), (10, 1), (11, 4, 12), (12, 1), (13, 8, 16), (16, 16, 21), (21, 1)]  # (start, T, back)

    def close(a, b):
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, atol=ATOL, rtol=ATOL)
        else:
            assert (a.float() - b.float()).abs().max() <= 2e-2 * b.float().abs().max()

    with torch.no_grad():
        for m in (fast, plain):
            m.cache = m.make_cache(2, 64, dtype, "cpu", None, static, max_block=16)
        for start, t, *back in schedule:
            outs = [m(x[:, start : start + t], None, None, start) for m in (fast, plain)]
            close(*outs)
            if back:
                fast.cache.rollback(back[0])
                plain.cache.rollback(back[0])
            close(fast.cache.state, plain.cache.state)
            close(fast.cache.conv, plain.cache.conv)
        fast.cache = plain.cache = None  # cache-free forwards (prefill, training) too
        close(fast(x, None, None, 0), plain(x, None, None, 0))


def test_deltanet_rollback_twice_into_one_block_and_implicit_rollback():
    _, ours, _, _ = mixer_pair("mha", "linear_attention")
    x, tail, other = torch.randn(1, 14, 40), torch.randn(1, 3, 40), torch.randn(1, 4, 40)
    with torch.no_grad():
        ours.cache = ours.make_cache(1, 64, torch.float32, "cpu")
        ours(x[:, :6], None, None, 0)
        ours(x[:, 6:], None, None, 6)
        ours.cache.rollback(12)
        ours.cache.rollback(8)  # a second rollback, further back into the same block
        got = ours(tail, None, None, 8)
        # a forward at start_pos < length rolls back first (inside the last forward), as a K/V cache rewrites
        again = ours(other, None, None, 9)
        ours.cache.reset()
        ours(x[:, :8], None, None, 0)
        torch.testing.assert_close(got, ours(tail, None, None, 8), atol=ATOL, rtol=ATOL)
        ours.cache.reset()
        ours(torch.cat([x[:, :8], tail[:, :1]], 1), None, None, 0)
        torch.testing.assert_close(again, ours(other, None, None, 9), atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("static", [False, True])
def test_deltanet_rollback_limits(static):
    _, ours, _, _ = mixer_pair("gva", "linear_attention")
    x = torch.randn(1, 30, 40)
    with torch.no_grad():
        ours.cache = ours.make_cache(1, 64, torch.float32, "cpu", None, static, max_block=8)
        ours(x[:, :5], None, None, 0)
        after5 = ours.cache.state.clone(), ours.cache.conv.clone()
        ours(x[:, 5:20], None, None, 5)  # longer than max_block: no factors kept, only its start
        if not static:  # the prefill's pre-conv inputs are not kept alive by views
            assert ours.cache.conv.untyped_storage().nbytes() == ours.cache.conv.numel() * 4
        with pytest.raises(ValueError, match="cannot roll back to length 7"):
            ours.cache.rollback(7)
        ours.cache.rollback(5)  # its start: the kept previous state and conv inputs
        assert torch.equal(ours.cache.state, after5[0]) and torch.equal(ours.cache.conv, after5[1])
        ours(x[:, 5:20], None, None, 5)
        ours(x[:, 20:24], None, None, 20)
        with pytest.raises(ValueError, match="holds positions 20..24"):
            ours.cache.rollback(19)  # before the last forward
        ours.cache.rollback(0)  # always: a fresh sequence
        assert ours.cache.length == 0 and not ours.cache.state.any() and not ours.cache.conv.any()
        with pytest.raises(AssertionError, match="gap"):
            ours(x[:, :2], None, None, 3)


def test_deltanet_cache_layout_and_fits():
    _, ours, _, _ = mixer_pair("gva", "linear_attention")
    cache = ours.make_cache(2, 64, torch.bfloat16, "cpu", None, True, max_block=16)
    lay = cache.layout()
    assert lay["kind"] == "deltanet" and lay["state"] == [2, 4, 12, 20] and lay["conv"] == [2, 3, 2 * 24 + 80]
    assert lay["record"]["keys"] == [2, 16, 2, 12] and lay["conv_dtype"] == "bfloat16"
    assert cache.fits(2, 128, torch.bfloat16, torch.device("cpu"), 32, True)  # capacity / window: no matter
    assert not cache.fits(1, 64, torch.bfloat16, torch.device("cpu"), None, True)
    assert not cache.fits(2, 64, torch.float32, torch.device("cpu"), None, True)
    assert not cache.fits(2, 64, torch.bfloat16, torch.device("cpu"), None, False)
    assert not cache.fits(2, 64, torch.bfloat16, torch.device("cpu"), None, True, max_block=32)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_gated_attention_cached_decoding_and_rollback(shape):
    model, ours, _, _ = mixer_pair(shape, "full_attention")
    x = torch.randn(2, 21, 40)
    with torch.no_grad():
        full = ours(x, *rope(model, 21), 0)
        ours.cache = ours.make_cache(2, 32, torch.float32, "cpu", None, False)
        for blocks in ([9] + [1] * 12, [5] + [4] * 4):
            ours.cache.reset()
            torch.testing.assert_close(feed(ours, x, blocks, model), full, atol=ATOL, rtol=ATOL)
        ours.cache.reset()
        feed(ours, x[:, :13], [9, 4], model)
        ours.cache.rollback(10)  # accept 1 of 4: continue from 10
        torch.testing.assert_close(ours(x[:, 10:], *rope(model, 11, 10), 10), full[:, 10:], atol=ATOL, rtol=ATOL)


# ---------------------------------------------------------------- config checks


def test_config_from_hf_and_errors():
    hf = hf_config("gva").to_dict()
    cfg = ModelConfig.from_hf(hf)
    assert cfg.layer_types == tuple(SHAPES["gva"]["layer_types"]) and cfg.linear_num_value_heads == 4
    assert cfg.partial_rotary_factor == 0.25 and cfg.rotary_dim == 6 and cfg.attn_output_gate
    assert layer_kinds(cfg) == ("linear_attention",) * 3 + ("gated_attention",)
    default = dict(hf, layer_types=None, num_hidden_layers=8)
    assert ModelConfig.from_hf(default).layer_types == (("linear_attention",) * 3 + ("full_attention",)) * 2
    for bad, match in [(dict(layer_types=["linear_attention"] * 3 + ["sliding_attention"]),
                        r"unsupported layer_types \['sliding_attention'\]"),
                       (dict(layer_types=["linear_attention"] * 3), "lists 3 layers but num_hidden_layers is 4"),
                       (dict(linear_num_key_heads=3), "not a multiple of linear_num_key_heads=3"),
                       (dict(num_key_value_heads=3), "not a multiple of num_key_value_heads=3"),
                       (dict(rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.3}), "7 rotary dims"),
                       (dict(attn_output_gate=False), "always gates")]:
        with pytest.raises(SpecquantError, match=match) as e:
            layer_kinds(ModelConfig.from_hf(dict(hf, **bad)))  # the kinds' names are checked by the table
        assert "\n" not in str(e.value)


def test_deltanet_bf16_close_to_transformers_bf16():
    """bf16 follows transformers' casts (the same ops in the same dtypes): equal up to bf16 rounding."""
    _, ours, theirs, _ = mixer_pair("gva", "linear_attention")
    ours, theirs = ours.to(torch.bfloat16), theirs.to(torch.bfloat16)
    x = torch.randn(2, 19, 40).to(torch.bfloat16)
    with torch.no_grad():
        expect = theirs(x).float()
        got = ours(x, None, None, 0).float()
    assert (got - expect).abs().max() <= 2e-2 * expect.abs().max()
