"""model/bf16_store.py: a decoding model's fp32 dense weights that hold bf16 values, stored as bf16, give the same
outputs bit for bit on every path the decoder takes (native few-row steps, F.linear prefill, compiled steps)."""

import pytest
import torch
from conftest import native_switch

from specquant.kernels import ops
from specquant.loader import load_model
from specquant.model.bf16_store import store_bf16
from specquant.model.fuse import fuse_projections
from specquant.model.modules import Linear
from specquant.spec_decode.engine import generate

needs_ops = pytest.mark.skipif(ops.LIBRARY.library() is None, reason="no native ops library: nothing is stored")


def _linears(model):
    return [m for m in model.modules() if type(m) is Linear]


@needs_ops
@torch.no_grad()
@pytest.mark.parametrize("name", ["tiny-target", "tiny-hybrid"])
def test_a_decoding_model_of_bf16_values_runs_bf16_weights_with_the_same_outputs(name):
    """load_model(fuse=True) stores every dense Linear (the tied head too) as bf16 and keeps the fp32 embedding;
    prefill logits (F.linear on the widened weight), cached decode and 4-row verify steps (the native linear) and
    greedy tokens equal those of the same fused model kept fp32."""
    stored = load_model(name, fuse=True)
    plain = load_model(name)
    fuse_projections(plain)
    assert _linears(stored) and all(m.weight.dtype == torch.bfloat16 for m in _linears(stored))
    assert stored.model.embed_tokens.weight.dtype == torch.float32 and stored.lm_head.weight.dtype == torch.bfloat16
    prompt = torch.randint(0, stored.config.vocab_size, (1, 70), generator=torch.Generator().manual_seed(2))
    assert torch.equal(stored(prompt, 0), plain(prompt, 0))
    for model in (stored, plain):
        model.setup_cache(1, 128)
    steps = [prompt[:, :66], prompt[:, 66:67], prompt[:, 67:]]
    start = 0
    for t in steps:
        assert torch.equal(stored(t, start), plain(t, start))
        start += t.shape[1]
    assert generate(stored, prompt, 16, stop_on_eos=False).token_ids == generate(plain, prompt, 16,
                                                                                     stop_on_eos=False).token_ids


@needs_ops
def test_weights_bf16_cannot_hold_stay_fp32_and_a_compiled_bf16_linear_is_the_eager_one():
    g = torch.Generator().manual_seed(0)
    layer = Linear(64, 40, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(40, 64, generator=g).to(torch.bfloat16).float())
        layer.bias.copy_(torch.randn(40, generator=g))
    odd = Linear(64, 8, bias=False)
    model = torch.nn.Sequential(layer, odd)
    assert store_bf16(model) == 1 and layer.weight.dtype == torch.bfloat16 and odd.weight.dtype == torch.float32
    x = torch.randn(1, 3, 64, generator=g)
    torch._dynamo.reset()
    with torch.no_grad():  # as decoding runs; the bias is added after the operator's sum, as the native call adds it
        eager = layer(x)
        assert torch.equal(eager, ops.linear(x, layer.weight.float(), layer.bias))
        assert torch.equal(torch.compile(layer, fullgraph=True)(x), eager)


def test_without_the_native_library_nothing_is_stored(monkeypatch):
    """SPECQUANT_NATIVE=off: the widened copy each call would cost more than the bytes saved, so weights stay fp32."""
    with native_switch(monkeypatch, "off"):
        model = load_model("tiny-target", fuse=True)
        assert store_bf16(model) == 0 and all(m.weight.dtype == torch.float32 for m in _linears(model))
