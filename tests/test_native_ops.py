"""kernels/ops.py: every native op, on every variant this CPU runs, against its torch reference; and the model
with the native ops against the model on the references (SPECQUANT_NATIVE=off's path)."""

from __future__ import annotations

import pytest
import torch

from specquant.kernels import ops

VARIANTS = [v for v in ops.LIBRARY.supported_variants() if ops.LIBRARY.load(v)[0] is not None]
pytestmark = pytest.mark.skipif(not VARIANTS, reason="no native ops variant builds here (no C++ compiler?)")


def close(a, b, rtol=2e-6, atol=2e-6):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


@pytest.fixture(params=VARIANTS, ids=lambda v: v.name)
def variant(request):
    return request.param


def test_every_supported_variant_builds():
    """Each variant this CPU can run builds and loads (a silent fallback would hide a broken source)."""
    for v in ops.LIBRARY.supported_variants():
        lib, why = ops.LIBRARY.load(v)
        assert lib is not None, f"{v.name}: {why}"
    assert ops.LIBRARY.variants[-1].name == "portable" and not ops.LIBRARY.variants[-1].flags


@pytest.mark.parametrize("dim", [1, 7, 64, 1024, 2560])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("form", ["plain", "zero_centred", "residual", "gated"])
def test_rms_norm_matches_reference(variant, dim, rows, form):
    g = torch.Generator().manual_seed(dim * 31 + rows)
    x = torch.randn(1, rows, dim, generator=g) * 3
    w = torch.randn(dim, generator=g)
    kw = {"offset": 1.0} if form == "zero_centred" else {}
    if form == "residual":
        kw["residual"] = torch.randn(1, rows, dim, generator=g)
    if form == "gated":
        kw["gate"] = torch.randn(1, rows, dim, generator=g) * 4
    got = ops.rms_norm(x, w, 1e-6, variant=variant, **kw)
    want = ops.rms_norm_reference(x, w, 1e-6, **kw)
    if form == "residual":
        assert torch.equal(got[0], want[0])  # the sum is one fp32 add either way
        close(got[1], want[1])
    else:
        close(got, want)


def test_rms_norm_rows_are_independent(variant):
    """A row's result does not depend on the rows beside it (batch invariance of the decode / verify steps)."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(9, 1024, generator=g), torch.randn(1024, generator=g)
    alone = torch.cat([ops.rms_norm(x[i : i + 1], w, 1e-6, variant=variant) for i in range(9)])
    assert torch.equal(ops.rms_norm(x, w, 1e-6, variant=variant), alone)


@pytest.mark.parametrize("shape", [(1, 1, 2 * 3072), (1, 5, 2 * 96), (2, 3, 2 * 7)])
def test_swiglu_matches_reference(variant, shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(5)) * 6  # both tails of silu
    x.view(-1)[:4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    close(ops.swiglu(x, variant=variant), ops.swiglu_reference(x))


@pytest.mark.parametrize("rows,k,n", [(1, 1024, 3072), (4, 384, 130), (8, 96, 7), (3, 1000, 33), (1, 16, 1),
                                       (16, 2048, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_f_linear(variant, rows, k, n, with_bias):
    g = torch.Generator().manual_seed(rows * 7 + k + n)
    x, w = torch.randn(1, rows, k, generator=g), torch.randn(n, k, generator=g) / k ** 0.5
    b = torch.randn(n, generator=g) if with_bias else None
    close(ops.linear(x, w, b, variant=variant), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)


# rows x k: both of ops.cpp's layouts (weight row by weight row while x is small: 4 rows, 7 x 1000; 4-row weight
# tiles beyond: 9 x 1040), each row against the one-row call, which is always the first layout
@pytest.mark.parametrize("rows,k", [(9, 1040), (4, 3000), (7, 1000), (6, 1500), (24, 520)])
def test_linear_rows_are_batch_and_thread_invariant(variant, rows, k):
    """A verify step's row equals the one-row step's bit for bit, at any thread count."""
    g = torch.Generator().manual_seed(11)
    x, w = torch.randn(rows, k, generator=g), torch.randn(515, k, generator=g)
    batch = ops.linear(x, w, variant=variant)
    assert torch.equal(torch.cat([ops.linear(x[i : i + 1], w, variant=variant) for i in range(rows)]), batch)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        assert torch.equal(ops.linear(x, w, variant=variant), batch)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("rows,k,n", [(1, 1024, 3072), (4, 384, 130), (9, 1040, 33), (3, 1000, 7)])
def test_bf16_weight_linear_is_the_fp32_linear_on_the_widened_weight(variant, rows, k, n):
    """A bf16 weight (an lm_head stored bf16) is widened exactly in registers: bit for bit the fp32 linear on
    weight.float() in both of ops.cpp's layouts, so within rounding of F.linear on it, and a verify row equals the
    one-row call."""
    g = torch.Generator().manual_seed(rows + k + n)
    x, w = torch.randn(1, rows, k, generator=g), (torch.randn(n, k, generator=g) / k ** 0.5).to(torch.bfloat16)
    y = ops.linear(x, w, variant=variant)
    assert y.dtype == torch.float32 and torch.equal(y, ops.linear(x, w.float(), variant=variant))
    close(y, torch.nn.functional.linear(x, w.float()), rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.cat([ops.linear(x[:, i : i + 1], w, variant=variant) for i in range(rows)], 1), y)


def test_linear_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="linear: x"):
        ops.linear(torch.randn(2, 8), torch.randn(4, 9))


@pytest.mark.parametrize("heads,kv_heads,d", [(16, 8, 128), (4, 4, 64), (8, 2, 80), (6, 3, 24)])
@pytest.mark.parametrize("t,q_pos,window", [(1, 0, None), (1, 127, None), (4, 60, None), (16, 200, None),
                                            (8, 50, 16), (1, 300, 64)])
def test_attention_matches_reference(variant, heads, kv_heads, d, t, q_pos, window):
    g = torch.Generator().manual_seed(heads + 7 * t + q_pos)
    k_pos = 0 if window is None else max(0, q_pos - window + 1)
    k_len = q_pos + t - k_pos
    cap = k_len + 5  # a cache buffer longer than the keys used
    keys = torch.randn(2, kv_heads, cap, d, generator=g)
    values = torch.randn(2, kv_heads, cap, d, generator=g)
    qk = torch.randn(2, t, heads + kv_heads, d, generator=g) * 2
    q = qk[:, :, :heads].transpose(1, 2)  # strided, as the fused projection's view
    got = ops.attention(q, keys, values, q_pos, k_pos, window, variant=variant)
    close(got, ops.attention_reference(q, keys, values, q_pos, k_pos, window), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t,q_pos,window", [(16, 0, None), (16, 40, None), (5, 30, 8), (16, 30, 8), (16, 9, 12),
                                            (3, 100, 2)])
def test_block_attention_matches_reference(variant, t, q_pos, window):
    """A block drafter's queries (block=True): each sees its window of earlier keys and the whole block, which the
    window does not cut (windows shorter than the block included)."""
    g = torch.Generator().manual_seed(t + q_pos)
    k_pos = 0 if window is None else max(0, q_pos - window + 1)
    keys, values = torch.randn(1, 2, q_pos + t - k_pos, 32, generator=g), torch.randn(1, 2, q_pos + t - k_pos, 32,
                                                                                       generator=g)
    q = torch.randn(1, 4, t, 32, generator=g) * 2
    got = ops.attention(q, keys, values, q_pos, k_pos, window, variant=variant, block=True)
    ref = ops.attention_reference(q, keys, values, q_pos, k_pos, window, block=True)
    close(got, ref, rtol=1e-5, atol=1e-5)
    if t > 1:  # not the causal result: later block keys are seen
        assert not torch.allclose(got, ops.attention(q, keys, values, q_pos, k_pos, window, variant=variant))


def test_attention_thread_count_does_not_change_results(variant):
    g = torch.Generator().manual_seed(11)
    keys, values = torch.randn(1, 8, 130, 128, generator=g), torch.randn(1, 8, 130, 128, generator=g)
    q = torch.randn(1, 16, 3, 128, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.attention(q, keys, values, 127, 0, None, variant=variant)
        torch.set_num_threads(2)
        two = ops.attention(q, keys, values, 127, 0, None, variant=variant)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_attention_rejects_a_query_that_sees_no_key(variant):
    q, kv = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 4, 16)
    with pytest.raises(ValueError, match="status [12]"):
        ops.attention(q, kv, kv, 2, 3, None, variant=variant)  # query at 2 before the first key at 3


def test_usable_rules():
    x = torch.randn(2, 8)
    assert ops.usable(x, None)
    assert not ops.usable(x.bfloat16())
    assert not ops.usable(x.t())  # last dim strided
    w = torch.randn(8, requires_grad=True)
    assert not ops.usable(x, w)
    with torch.no_grad():
        assert ops.usable(x, w)


def _steps(model, ids, monkeypatch, native: bool):
    """Logits of a prefill, decode steps and verify steps with rollbacks (every kind of cached step), and how many
    times each native op ran."""
    calls = {}
    if native:
        for name in ("rms_norm", "swiglu", "attention", "norm_rope", "delta_step", "delta_replay", "delta_gates",
                     "delta_conv", "sigmoid_mul", "linear", "decoder_layer", "deltanet_layer"):
            def counted(*a, _f=getattr(ops, name), _n=name, **k):
                calls[_n] = calls.get(_n, 0) + 1
                return _f(*a, **k)
            monkeypatch.setattr(ops, name, counted)
    else:
        monkeypatch.setattr(ops, "usable", lambda *tensors: False)
    out = []
    with torch.inference_mode():
        model.setup_cache(1, 96, max_block=8)
        out.append(model(ids[:, :40], 0))
        pos = 40
        for t in (1, 1, 3, 4, 6, 1, 2):
            out.append(model(ids[:, pos : pos + t], pos))
            pos += t - (t > 2)  # reject the last of a longer block: the next step starts before its end
            model.rollback(pos)
    monkeypatch.undo()
    return out, calls


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_modules", "qwen3_window", "hybrid", "hybrid_modules"])
def test_model_steps_with_native_ops_match_the_reference_ops(kind, monkeypatch):
    """qwen3, qwen3_window (a ring cache), hybrid: each layer's step is one native call (model/native_layer.py;
    the hybrid's 40-token prefill is longer than its DeltaNet caches' max_block, so those layers run their modules
    there); *_modules: the modules make the native calls one by one (native_layer.ENABLED off)."""
    from specquant.model import native_layer
    from specquant.model.config import ModelConfig
    from specquant.model.decoder import Transformer
    from specquant.model.fuse import fuse_projections

    if kind.startswith("hybrid"):
        from _qwen35_models import hf_config

        cfg = ModelConfig.from_hf(hf_config("gva", linear_value_head_dim=32).to_dict())  # V % 16: delta_step
    else:
        cfg = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, qk_norm=True,
                          sliding_window=16 if kind == "qwen3_window" else None)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3 if "norm" in name else 0.1)
    fuse_projections(model)
    ids = torch.randint(0, cfg.vocab_size, (1, 80), generator=torch.Generator().manual_seed(1))
    ref, none = _steps(model, ids, monkeypatch, native=False)
    monkeypatch.setattr(native_layer, "ENABLED", not kind.endswith("_modules"))
    got, calls = _steps(model, ids, monkeypatch, native=True)
    expected = {"rms_norm", "swiglu", "attention", "norm_rope", "linear"}
    if kind == "hybrid_modules":
        expected |= {"delta_step", "delta_replay", "delta_gates", "delta_conv", "sigmoid_mul"}
    if kind in ("qwen3", "qwen3_window"):
        expected = {"decoder_layer", "rms_norm", "linear"}  # the layers, then the final norm and the head
    if kind == "hybrid":  # the layers; DeltaNet's prefill on its modules (its rule native too); rollbacks; norm, head
        expected = {"decoder_layer", "deltanet_layer", "rms_norm", "linear", "swiglu", "delta_gates", "delta_conv",
                    "delta_step", "delta_replay"}
    assert not none and set(calls) == expected, calls  # the native paths did run
    for a, b in zip(got, ref):
        close(a, b, rtol=1e-4, atol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("heads,d,rot,w_rows", [(24, 128, 128, 24), (6, 24, 6, 1), (3, 20, 10, 1), (4, 32, 0, 1),
                                               (5, 16, 16, 0)])
@pytest.mark.parametrize("t", [1, 3])
def test_norm_rope_matches_reference(variant, heads, d, rot, w_rows, t):
    from specquant.model.rope import rope_tables

    g = torch.Generator().manual_seed(heads * d + t)
    y = torch.randn(2, t, heads * d + 40, generator=g) * 2  # a fused projection's output: heads, then other columns
    x = y[..., : heads * d].view(2, t, heads, d)
    cos, sin = rope_tables(rot, 10000.0, None, 64, 64) if rot else (torch.zeros(64, 0), torch.zeros(64, 0))
    cos, sin = cos[30 : 30 + t], sin[30 : 30 + t]
    kw = dict(normalize=w_rows > 0, eps=1e-6)
    if w_rows:
        kw["weight"] = torch.randn(w_rows, d, generator=g).squeeze(0)
        kw["offset"] = 1.0 if w_rows == 1 else 0.0
    close(ops.norm_rope(x, cos, sin, variant=variant, **kw), ops.norm_rope_reference(x, cos, sin, **kw))


@pytest.mark.parametrize("hk,h,kd,vd,t", [(16, 32, 128, 128, 1), (2, 4, 12, 32, 1), (3, 3, 10, 16, 3), (2, 4, 24, 48, 5)])
def test_delta_step_matches_step_rule(variant, hk, h, kd, vd, t):
    from specquant.model.gated_delta import l2_normalize, recurrent_rule, step_rule

    g = torch.Generator().manual_seed(h * kd + t)
    q, k = (l2_normalize(torch.randn(2, t, hk, kd, generator=g)) for _ in range(2))
    v = torch.randn(2, t, h, vd, generator=g)
    gate, beta = -torch.rand(2, t, h, generator=g) * 3, torch.rand(2, t, h, generator=g)
    state = torch.randn(2, h, kd, vd, generator=g)
    keep = state.clone()
    got = ops.delta_step(q, k, v, gate, beta, state, kd ** -0.5, variant=variant)
    want = (step_rule if t == 1 else recurrent_rule)(q, k, v, gate, beta, state, kd ** -0.5)
    assert torch.equal(state, keep)  # the state before is kept (the cache's anchor)
    for a, b in zip(got, want):
        close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hk,h,kd,vd,t", [(2, 4, 12, 32, 7), (3, 3, 10, 16, 5), (16, 32, 128, 128, 16)])
def test_delta_steps_over_a_block_equal_one_token_steps_and_replay_rebuilds_their_states(variant, hk, h, kd, vd, t):
    """A block through delta_step gives each token's output and state exactly as one-token calls do, and
    delta_replay of the first j recorded tokens gives the state after them bit for bit (a verify's rollback then
    continues on a token-by-token decode's state); both match the torch forms to rounding."""
    from specquant.model.gated_delta import l2_normalize, state_after

    g = torch.Generator().manual_seed(h * kd + t)
    q, k = (l2_normalize(torch.randn(2, t, hk, kd, generator=g)) for _ in range(2))
    v = torch.randn(2, t, h, vd, generator=g)
    gate, beta = -torch.rand(2, t, h, generator=g) * 3, torch.rand(2, t, h, generator=g)
    state0 = torch.randn(2, h, kd, vd, generator=g)
    out, final, delta = ops.delta_step(q, k, v, gate, beta, state0, kd ** -0.5, variant=variant)
    lean = ops.delta_step(q, k, v, gate, beta, state0, kd ** -0.5, variant=variant, keep_delta=False)  # a prefill's
    assert torch.equal(lean[0], out) and torch.equal(lean[1], final) and lean[2] is None
    states, state = [state0], state0
    for i in range(t):
        o, state, d = ops.delta_step(*(x[:, i : i + 1] for x in (q, k, v, gate, beta)), state, kd ** -0.5,
                                     variant=variant)
        assert torch.equal(o, out[:, i : i + 1]) and torch.equal(d, delta[:, i : i + 1])
        states.append(state)
    assert torch.equal(final, states[-1])
    for j in range(t + 1):
        got = ops.delta_replay(state0, k[:, :j], delta[:, :j], gate[:, :j], variant=variant)
        assert torch.equal(got, states[j]), j
        close(got, ops.delta_replay_reference(state0, k[:, :j], delta[:, :j], gate[:, :j]), rtol=1e-5, atol=1e-5)
        close(got, state_after(state0, k, delta, gate, j), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads", [3, 8, 32])
def test_delta_gates_match_torch_and_do_not_depend_on_the_rows(variant, heads):
    """g and beta as torch computes them (to rounding: libm against torch's vectorized exp), and each row's the
    same alone as in a block (torch's own are not below 32 heads: a vectorized body and a scalar tail)."""
    g = torch.Generator().manual_seed(heads)
    a, b = (torch.randn(1, 21, heads, generator=g) * 4 for _ in range(2))
    a[0, 0, 0] = 30.0  # softplus's linear branch
    a_log, dt_bias = torch.rand(heads, generator=g) * 3, torch.randn(heads, generator=g)
    got = ops.delta_gates(a, b, a_log, dt_bias, variant=variant)
    for x, y in zip(got, ops.delta_gates_reference(a, b, a_log, dt_bias)):
        close(x, y, rtol=1e-6, atol=1e-6)
    rows = [ops.delta_gates(a[:, i : i + 1], b[:, i : i + 1], a_log, dt_bias, variant=variant) for i in range(21)]
    for n, x in enumerate(got):
        assert torch.equal(x, torch.cat([r[n] for r in rows], 1))
    with pytest.raises(ValueError, match="delta_gates"):
        ops.delta_gates(a, b[..., :-1], a_log, dt_bias, variant=variant)


@pytest.mark.parametrize("hk,kd,vc,kernel,t", [(16, 128, 2048, 4, 1), (2, 64, 256, 4, 5), (3, 10, 36, 3, 2),
                                                (1, 16, 1, 8, 4)])
def test_delta_conv_matches_reference_and_its_rows_are_independent(variant, hk, kd, vc, kernel, t):
    """The conv (C % 16 channels included), SiLU and q / k norms against the torch ops; a row alone equals it in a
    block; a tree's windows read the rows they name."""
    g = torch.Generator().manual_seed(hk * 7 + t)
    c = 2 * hk * kd + vc
    hist = torch.randn(2, kernel - 1 + t, c, generator=g) * 2
    w = torch.randn(c, 1, kernel, generator=g) * 0.5
    got = ops.delta_conv(hist, w, hk, kd, t, variant=variant)
    for x, y in zip(got, ops.delta_conv_reference(hist, w, hk, kd, t)):
        close(x, y, rtol=1e-5, atol=1e-5)
    for i in range(t):  # output i alone, from its own kernel rows
        alone = ops.delta_conv(hist[:, i : i + kernel], w, hk, kd, 1, variant=variant)
        for x, y in zip(got, alone):
            assert torch.equal(x[:, i : i + 1], y)
    windows = torch.stack([torch.randperm(kernel - 1 + t, generator=g)[:kernel] for _ in range(3)])
    tree = ops.delta_conv(hist, w, hk, kd, 3, windows, variant=variant)
    for x, y in zip(tree, ops.delta_conv_reference(hist, w, hk, kd, 3, windows)):
        close(x, y, rtol=1e-5, atol=1e-5)
    for bad in (dict(t=t + 1), dict(windows=windows + kernel + t)):
        with pytest.raises(ValueError, match="delta_conv"):
            ops.delta_conv(hist, w, hk, kd, **{"t": 3, **bad}, variant=variant)


@pytest.mark.parametrize("heads,d,rows", [(8, 256, 1), (4, 64, 5), (3, 20, 2)])
def test_sigmoid_mul_matches_torch_on_a_projection_s_gate_halves(variant, heads, d, rows):
    g = torch.Generator().manual_seed(heads * d)
    qg = torch.randn(2, rows, heads, 2 * d, generator=g) * 4  # [query | gate] per head, as GatedAttention's q_proj
    gate = qg[..., d:]
    a = torch.randn(2, rows, heads, d, generator=g)
    want = ops.sigmoid_mul_reference(a, gate)
    got = ops.sigmoid_mul(a.clone(), gate, variant=variant)
    close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(ops.sigmoid_mul(a[:, :1].clone(), gate[:, :1], variant=variant), got[:, :1])
    with pytest.raises(ValueError, match="sigmoid_mul"):
        ops.sigmoid_mul(a, gate[..., :-1], variant=variant)


def _random_model(kind: str, w4: bool):
    from specquant.model.config import ModelConfig
    from specquant.model.decoder import Transformer
    from specquant.model.fuse import fuse_projections
    from specquant.quant.config import QuantConfig
    from specquant.quant.pipeline import quantize

    if kind == "hybrid":  # 4 value heads: fewer than torch's vectorized gates need to be row-invariant
        from _qwen35_models import hf_config

        cfg = ModelConfig.from_hf(hf_config("gva", linear_value_head_dim=32, linear_key_head_dim=16,
                                            hidden_size=64, intermediate_size=128).to_dict())
    else:
        cfg = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, qk_norm=True)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3 if "norm" in name else 0.1)
    if w4:  # the native W4 kernel rounds activations to bf16: a last-bit difference upstream can flip a rounding
        quantize(model, QuantConfig(method="rtn", bits=4, group_size=32), scale_dtype=torch.bfloat16)
    fuse_projections(model)
    return model


@pytest.mark.parametrize("w4", [False, True], ids=["fp32", "w4"])
@pytest.mark.parametrize("kind", ["qwen3", "hybrid"])
def test_verify_rows_and_rollbacks_equal_one_token_decode_bit_for_bit(kind, w4):
    """What keeps speculation's greedy tokens exactly the target's: a verify block's rows (any width up to a
    cache's max_block) equal one-token decode steps bit for bit, and so does decoding on after a rollback into the
    block (native linear, attention, delta rule, replayed state and gates all compute a row alike in any block).
    Off the native path (SPECQUANT_NATIVE=off, torch.compile) only rounding-level agreement is promised."""
    if ops.LIBRARY.library() is None:
        pytest.skip("the native ops library is not loaded here (SPECQUANT_NATIVE)")
    model = _random_model(kind, w4)
    ids = torch.randint(0, 97, (1, 100), generator=torch.Generator().manual_seed(3))
    def prefilled():
        model.setup_cache(1, 128)
        model(ids[:, :40], 0)

    with torch.inference_mode():
        prefilled()
        steps = torch.cat([model(ids[:, p : p + 1], p) for p in range(40, 100)], 1)
        for width in (4, 21, 60):
            prefilled()
            assert torch.equal(model(ids[:, 40 : 40 + width], 40), steps[:, :width]), width
        prefilled()
        junk = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(4))
        model(torch.cat([ids[:, 40:47], junk], 1), 40)  # a verify whose last 9 rows are rejected
        model.rollback(47)
        after = torch.cat([model(ids[:, p : p + 1], p) for p in range(47, 100)], 1)
        assert torch.equal(after, steps[:, 7:])
    model.clear_cache()


def test_dense_linear_falls_back_where_the_native_linear_cannot_take_the_input():
    """A weight whose rows are contiguous but not the whole tensor (a column slice) and an empty input go to
    F.linear instead of the native call's error."""
    import torch.nn.functional as F

    from specquant.model.modules import dense_linear

    sliced, whole = torch.randn(8, 32)[:, :16], torch.randn(8, 16)
    with torch.no_grad():
        for x, w in ((torch.randn(1, 3, 16), sliced), (torch.randn(1, 0, 16), whole)):
            assert ops.usable(x, w) == (ops.LIBRARY.library() is not None)  # the native path would have been taken
            close(dense_linear(x, w), F.linear(x, w))
