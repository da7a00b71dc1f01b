"""model/native_layer.py: a decoder layer's step as one native call equals the layer's modules bit for bit
(prefill blocks, decode steps, verify blocks, rollbacks, a batch), on dense fp32, bf16-stored and W4A8 weights, with
and without q/k norms and biases, for dense attention and Qwen3.5's gated attention and Gated DeltaNet layers, on
every ops variant this CPU runs; and it stands aside (the modules run, nothing written twice) wherever its conditions
do not hold."""

from __future__ import annotations

import pytest
import torch
from conftest import native_switch, need_kernel

from specquant.bench.shapes import build, hybrid, random_model
from specquant.kernels import ops, w4_bf16, w4a8
from specquant.loader import load_model
from specquant.model import native_layer
from specquant.model.bf16_store import store_bf16
from specquant.model.config import ModelConfig
from specquant.model.fuse import fuse_projections

pytestmark = pytest.mark.skipif(ops.LIBRARY.library() is None, reason="the native ops library is unavailable here")


def _cfg(**over) -> ModelConfig:
    base = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, vocab_size=300)
    return ModelConfig(**{**base, **over})


def _perturb_norms(model, seed: int = 3):
    """Norm weights away from one, so a wrong weight row or offset shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            for w in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight, attn.qk_norm_weight):
                if w is not None:
                    w.copy_(1 + 0.3 * torch.randn(w.shape, generator=gen))
    return model


def _dense(cfg: ModelConfig) -> torch.nn.Module:
    model = random_model(cfg).eval()
    fuse_projections(model)
    return _perturb_norms(model)


def _run(model, tokens: torch.Tensor, enabled: bool, window: int | None = -1) -> list[torch.Tensor]:
    """Prefill, decode steps, a verify block, a rollback into it and a second verify, then a drafter's pattern (one-
    token steps rolled back over several of them): every output."""
    native_layer.ENABLED = enabled
    try:
        with torch.inference_mode():
            model.setup_cache(tokens.shape[0], 96, max_block=16, window=window)
            outs = [model(tokens[:, :20], 0)]
            outs += [model(tokens[:, i : i + 1], i) for i in range(20, 24)]
            outs.append(model(tokens[:, 24:32], 24))
            model.rollback(27)
            outs.append(model(tokens[:, 27:33], 27))
            outs += [model(tokens[:, i : i + 1], i) for i in range(33, 36)]
            model.rollback(34)
            outs.append(model(tokens[:, 34:37], 34))
        return outs
    finally:
        native_layer.ENABLED = True


def _assert_same(model, batch: int = 1, planned: bool = True, window: int | None = -1):
    tokens = torch.randint(0, model.config.vocab_size, (batch, 40), generator=torch.Generator().manual_seed(1))
    for layer in model.model.layers:
        native_layer._PLANS.pop(layer, None)
    ref = _run(model, tokens, enabled=False, window=window)
    assert not any(native_layer.planned(layer) for layer in model.model.layers)
    got = _run(model, tokens, enabled=True, window=window)
    assert all(native_layer.planned(layer) for layer in model.model.layers) == planned
    for i, (a, b) in enumerate(zip(ref, got)):
        assert torch.equal(a, b), (i, float((a - b).abs().max()))


@pytest.mark.parametrize("over", [{}, dict(qk_norm=False, qkv_bias=True, o_bias=True), dict(num_key_value_heads=4),
                                  dict(head_dim=48, partial_rotary_factor=0.5)], ids=["qwen3", "qwen2-bias", "mha", "partial-rope"])
def test_dense_fp32_layer_equals_modules(over):
    _assert_same(_dense(_cfg(**over)))


@pytest.mark.parametrize("window", [8, 16])
def test_ring_cache_equals_modules(window):
    """A sliding-window ring (the draft window): the 20-token prefill runs in blocks of max_block 16, the positions
    wrap the ring, and the rollback lands inside the last block."""
    _assert_same(_dense(_cfg()), window=window)
    _assert_same(_dense(_cfg()), batch=2, window=window)


def test_batch_of_two_equals_modules():
    _assert_same(_dense(_cfg()), batch=2)


def test_bf16_stored_layer_equals_modules():
    model = random_model(_cfg(), torch.bfloat16).float().eval()
    fuse_projections(model)
    assert store_bf16(model) > 0
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype is torch.bfloat16
    _assert_same(_perturb_norms(model))


def test_w4a8_layer_equals_modules():
    need_kernel(w4a8.FAMILY)
    model = build(_cfg(), "w4a8", "bf16")
    _assert_same(_perturb_norms(model))


def test_w4a16_layer_equals_modules():
    """W4 with float activations: the layer rounds them to bf16 itself, as the w4_bf16 gemm's caller does."""
    need_kernel(w4_bf16.FAMILY)
    model = build(_cfg(), "w4", "bf16")
    assert model.model.layers[0].mlp.down_proj.activations != "int8"
    _assert_same(_perturb_norms(model))


def test_bundled_target_greedy_tokens_unchanged():
    """tiny-target as the engines load it: the same logits on every step, so the same greedy tokens."""
    _assert_same(load_model("tiny-target", fuse=True))


@pytest.mark.parametrize("variant", ops.LIBRARY.supported_variants(), ids=lambda v: v.name)
def test_every_ops_variant_equals_its_own_modules(variant, monkeypatch):
    """SPECQUANT_NATIVE names one ops variant: the layer call and the modules' calls both run it."""
    with native_switch(monkeypatch, f"{variant.name},portable"):
        if ops.LIBRARY.variant() is None or ops.LIBRARY.variant().name != variant.name:
            pytest.skip(f"ops variant {variant.name} does not build here: {ops.LIBRARY.why()}")
        _assert_same(_dense(_cfg()))
        _assert_same(_hybrid())


def _hybrid_cfg(**over) -> ModelConfig:
    """A small Qwen3.5 hybrid: DeltaNet, DeltaNet, DeltaNet, gated attention (partial RoPE, zero-centred norms),
    grouped value heads (4 value heads over 2 key heads)."""
    base = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                vocab_size=300, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                linear_value_head_dim=32, max_position_embeddings=256)
    return hybrid(4, **{**base, **over})


def _perturb_hybrid(model, seed: int = 5):
    """Every norm weight, the conv and the gates' parameters away from their defaults, so a wrong row, offset or
    weight shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "conv1d" in name or name.endswith(("A_log", "dt_bias")):
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return model


def _hybrid(mode: str = "fp32", **over):
    cfg = _hybrid_cfg(**over)
    if mode == "fp32":
        model = _perturb_hybrid(random_model(cfg).eval())
        fuse_projections(model)
        return model
    need_kernel(w4a8.FAMILY if mode == "w4a8" else w4_bf16.FAMILY)
    model = build(cfg, mode, "bf16")
    return _perturb_hybrid(model)


@pytest.mark.parametrize("mode", ["fp32", "w4a8", "w4"])
def test_hybrid_layers_equal_modules(mode):
    """Gated attention and Gated DeltaNet layers: prefill (longer than max_block: DeltaNet runs its modules there),
    decode steps, a verify, rollbacks into a verify and over one-token steps; a batch of two."""
    model = _hybrid(mode)
    _assert_same(model)
    _assert_same(model, batch=2)


def test_hybrid_on_a_ring_and_without_grouped_value_heads():
    _assert_same(_hybrid(linear_num_value_heads=2), window=8)


def test_bundled_hybrid_greedy_tokens_unchanged():
    """tiny-hybrid as the engines load it (bf16-stored dense weights)."""
    _assert_same(load_model("tiny-hybrid", fuse=True))


def test_deltanet_stands_aside_for_its_reference_form_and_a_static_cache():
    model = _hybrid()
    for layer in model.model.layers[:3]:
        layer.linear_attn.fast = False  # the reference form rounds as transformers does: not the native call's
    _assert_same(model, planned=False)
    assert not any(native_layer.planned(layer) for layer in model.model.layers[:3])
    assert native_layer.planned(model.model.layers[3])
    tokens = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        model.setup_cache(1, 96, static=True)
        for layer in model.model.layers:
            native_layer._PLANS.pop(layer, None)
        model(tokens[:, :8], 0)
        assert not any(native_layer.planned(layer) for layer in model.model.layers)


def test_stands_aside_where_it_cannot_run():
    """The static layout, gradients on, a module hook, a W4 layer on torch's reference backend: the modules run."""
    model = _dense(_cfg())
    tokens = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        model.setup_cache(1, 96, static=True)
        model(tokens[:, :8], 0)
        assert not any(native_layer.planned(layer) for layer in model.model.layers)
    model.setup_cache(1, 96)
    model(tokens[:, :8], 0)  # gradients on (training, QAD): autograd sees the modules' ops
    assert not any(native_layer.planned(layer) for layer in model.model.layers)
    calls = []
    handle = model.model.layers[1].mlp.down_proj.register_forward_hook(lambda *a: calls.append(1))
    try:
        _assert_same(model, planned=False)  # layer 0 runs natively, layer 1 (hooked) its modules
        assert calls and native_layer.planned(model.model.layers[0])
        assert not native_layer.planned(model.model.layers[1])
    finally:
        handle.remove()
    from specquant.quant.linear import set_backend

    w4 = build(_cfg(), "w4", "bf16")
    set_backend(w4, "reference")  # torch's dequantize-and-matmul: no native kernel to call
    _assert_same(w4, planned=False)


def test_plan_follows_moved_weights():
    """A weight replaced after a step (a new tensor, not an in-place change) is read by the next step."""
    model = _dense(_cfg())
    tokens = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        _run(model, tokens, enabled=True)
        layer = model.model.layers[0]
        old = native_layer._PLANS[layer]
        layer.mlp.down_proj.weight = torch.nn.Parameter(layer.mlp.down_proj.weight * 2, requires_grad=False)
        layer.input_layernorm.weight.data = layer.input_layernorm.weight.data * 0.5
    _assert_same(model)
    assert native_layer._PLANS[layer] is not old


def test_off_switch_leaves_the_modules(monkeypatch):
    with native_switch(monkeypatch, "off"):
        _assert_same(_dense(_cfg()), planned=False)


def test_a_deep_copy_runs_on_its_own_weights():
    """A model copied after native steps (the bench copies targets) runs natively on its own tensors."""
    import copy

    model = _dense(_cfg())
    tokens = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(1))
    first = _run(model, tokens, enabled=True)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # the original's weights gone: the copy must not read them
    assert all(torch.equal(a, b) for a, b in zip(first, _run(twin, tokens, enabled=True)))
    assert all(native_layer.planned(layer) for layer in twin.model.layers)


def test_a_hook_on_the_layer_itself_runs_its_modules():
    """Calibration hooks a whole layer (quant/calib.py): that layer's module call runs, hooks and all."""
    model = _dense(_cfg())
    seen = []
    handle = model.model.layers[0].register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape))
    try:
        _assert_same(model, planned=False)
        assert seen and not native_layer.planned(model.model.layers[0])
        assert native_layer.planned(model.model.layers[1])
    finally:
        handle.remove()


def test_plan_follows_a_swapped_module():
    """A projection module replaced by another over the same weight tensor (a re-fuse, a swapped head) is read anew."""
    from specquant.model.modules import Linear

    model = _dense(_cfg())
    tokens = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(1))
    _run(model, tokens, enabled=True)
    layer = model.model.layers[1]
    old = native_layer._PLANS[layer]
    down = layer.mlp.down_proj
    twin = Linear(down.in_features, down.out_features, bias=False).requires_grad_(False)
    twin.weight = down.weight  # the same tensor, a new module
    layer.mlp.down_proj = twin
    _assert_same(model)
    assert native_layer._PLANS[layer] is not old


def test_a_layer_that_cannot_run_natively_is_judged_once(monkeypatch):
    """A layer the native step cannot take (here a bf16 norm weight) runs its modules, and its plan is not tried again
    on every step: once per key."""
    model = _dense(_cfg())
    layer = model.model.layers[0]
    layer.input_layernorm.weight.data = layer.input_layernorm.weight.data.to(torch.bfloat16)
    built = []
    build = native_layer._build_attention
    monkeypatch.setattr(native_layer, "_build_attention", lambda *a: built.append(a) or build(*a))
    _assert_same(model, planned=False)  # layer 0 on its modules, the same outputs
    assert not native_layer.planned(layer) and native_layer.planned(model.model.layers[1])
    assert len(built) == 2  # one judgement per layer over the run's eight forwards


def test_mtp_drafter_layer_runs_natively_and_equals_its_modules():
    """The MTP drafter (`--draft mtp` on tiny-hybrid) is laid out for decoding (fused, bf16-stored) and its layer's
    cached steps run as one native call, with the drafts its modules would make: prefill of several positions, then
    chained one-token steps, a rollback and more."""
    from specquant.loader import load_model
    from specquant.spec_decode.drafters import KINDS

    target = load_model("tiny-hybrid", fuse=True)
    mtp = KINDS["mtp"].build(None, target, None).model
    block = mtp.layers[0]
    assert block.self_attn.qkv_proj is not None and block.mlp.gate_up_proj is not None
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(1, 12, target.config.hidden_size, generator=gen)
    embeds = torch.randn(1, 12, target.config.hidden_size, generator=gen)

    def run(enabled: bool):
        native_layer.ENABLED = enabled
        native_layer._PLANS.pop(block, None)
        try:
            with torch.inference_mode():
                mtp.setup_cache(1, 64)
                outs = [mtp(hidden[:, :6], embeds[:, :6], 0)]
                outs += [mtp(hidden[:, i : i + 1], embeds[:, i : i + 1], i) for i in range(6, 9)]
                mtp.rollback(7)
                outs.append(mtp(hidden[:, 7:12], embeds[:, 7:12], 7))
            return outs, native_layer.planned(block)
        finally:
            native_layer.ENABLED = True

    ref, ref_planned = run(False)
    got, got_planned = run(True)
    assert not ref_planned and got_planned
    for a, b in zip(ref, got):
        assert torch.equal(a, b)


def _block_drafter(mode: str):
    """A random block drafter (bench.shapes.block_drafter: laid out as the block kind loads one) on a random target."""
    from specquant.bench.shapes import block_drafter

    cfg = _cfg(num_hidden_layers=6)
    draft = block_drafter(cfg, mode, layers=2, block_size=8, seed=4)
    return draft.attach_target(random_model(cfg).eval())


def _run_block(draft, enabled: bool, window: int | None) -> list[torch.Tensor]:
    """A drafter's pattern: the prompt's context, proposals with none, a few and too many (appended first) pending
    context rows, rollbacks between them; a ring wraps. Every proposal's logits, then the context K/V."""
    width = len(draft.config.target_layer_ids) * draft.config.hidden_size
    gen = torch.Generator().manual_seed(8)
    feats = torch.randn(1, 240, width, generator=gen)
    tokens = torch.randint(4, draft.config.vocab_size, (240,), generator=gen)
    native_layer.ENABLED = enabled
    for layer in draft.layers:
        native_layer._PLANS.pop(layer, None)
    outs = []
    try:
        with torch.inference_mode():
            draft.setup_cache(256, window=window)
            draft.append_context(feats[:, :30])
            outs.append(draft.propose(tokens[30]))
            outs.append(draft.propose(tokens[33], 3, feats[:, 30:33]))
            draft.rollback(31)
            outs.append(draft.propose(tokens[35], 5, feats[:, 31:35]))
            outs.append(draft.propose(tokens[36], 7, feats[:, 35:36]))
            outs.append(draft.propose(tokens[150], 2, feats[:, 36:150]))  # too many rows for one call
            for n in range(150, 230, 9):
                outs.append(draft.propose(tokens[n + 9], 4, feats[:, n : n + 9]))
                draft.rollback(n + 7)
                outs.append(draft.propose(tokens[n + 9], 4, feats[:, n + 7 : n + 9]))
        n, first = draft.context_len, 0 if window is None else draft.context_len - window + 1
        for layer in draft.layers:
            outs += [t.clone() for t in layer.self_attn.context_cache.read(first, n)]
        return outs
    finally:
        native_layer.ENABLED = True


@pytest.mark.parametrize("mode", ["fp32", "bf16", "w4a8", "w4"])
@pytest.mark.parametrize("window", [None, 12])
def test_block_drafter_layers_equal_modules(mode, window):
    """A block drafter's layer as one call (native_layer.block_step: the pending context rows' K/V and the block in
    the same call, block-wide attention) equals its modules bit for bit, on a full cache and a ring that wraps."""
    if mode == "w4a8":
        need_kernel(w4a8.FAMILY)
    if mode == "w4":
        need_kernel(w4_bf16.FAMILY)
    draft = _block_drafter(mode)
    ref = _run_block(draft, False, window)
    assert not any(native_layer.planned(layer) for layer in draft.layers)
    got = _run_block(draft, True, window)
    assert all(native_layer.planned(layer) for layer in draft.layers)
    assert len(ref) == len(got)
    for i, (a, b) in enumerate(zip(ref, got)):
        assert torch.equal(a, b), (i, float((a - b).abs().max()))


def test_bundled_block_drafter_runs_natively_with_the_same_drafts():
    """tiny-hybrid-block-draft as its kind loads it (fused, bf16-stored): one call per layer, the same logits."""
    from specquant.spec_decode.drafters import KINDS
    from specquant.spec_decode.runtime import RuntimeConfig

    target = load_model("tiny-hybrid", fuse=True)
    draft = KINDS["block"].load("tiny-hybrid-block-draft", RuntimeConfig()).attach_target(target)
    assert draft.layers[0].self_attn.qkv_proj is not None
    assert draft.layers[0].self_attn.qkv_proj.weight.dtype is torch.bfloat16
    ref, got = _run_block(draft, False, None), _run_block(draft, True, None)
    assert all(native_layer.planned(layer) for layer in draft.layers)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
