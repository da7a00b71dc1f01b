"""Fused q/k/v and gate/up projections (model/fuse.py) compute the unfused model's logits."""

import copy

import pytest
import torch
from _quant_models import gaussian_model
from conftest import random_model

from specquant.errors import SpecquantError
from specquant.model.checkpoint import save_model
from specquant.loader import load_model
from specquant.model.fuse import fuse_projections
from specquant.quant import QuantConfig, quantize, save_quantized


def _steps(model, prompt, steps):
    """Prefill, then one 1-token step and one 4-token (verify-shaped) step through the KV cache."""
    model.setup_cache(1, 64)
    with torch.no_grad():
        out = [model(prompt, 0)]
        pos = prompt.shape[1]
        for ids in steps:
            out.append(model(ids, pos))
            pos += ids.shape[1]
    return out


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2", "llama"])
def test_dense_fused_matches_unfused(model_type):
    model = random_model(model_type, seed=1)
    fused = copy.deepcopy(model)
    assert fuse_projections(fused) == 2 * len(model.model.layers)
    layer = fused.model.layers[0]
    assert layer.self_attn.q_proj is None and layer.mlp.gate_proj is None
    g = torch.Generator().manual_seed(0)
    prompt, steps = torch.randint(0, 101, (1, 9), generator=g), [torch.randint(0, 101, (1, n), generator=g)
                                                                  for n in (1, 4, 1)]
    for a, b in zip(_steps(model, prompt, steps), _steps(fused, prompt, steps)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)  # dense GEMMs may sum in another order


@pytest.mark.parametrize("symmetric", [True, False])
def test_quantized_fused_matches_unfused(symmetric):
    model = gaussian_model(intermediate_size=256)
    calib = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    quantize(model, QuantConfig(method="rtn", group_size=32, symmetric=symmetric), calib_tokens=calib)
    fused = copy.deepcopy(model)
    assert fuse_projections(fused) == 2 * len(model.model.layers)
    g = torch.Generator().manual_seed(1)
    prompt, steps = torch.randint(0, 256, (1, 7), generator=g), [torch.randint(0, 256, (1, n), generator=g)
                                                                  for n in (1, 4)]
    for a, b in zip(_steps(model, prompt, steps), _steps(fused, prompt, steps)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_fused_model_cannot_be_saved_or_quantized(tmp_path):
    model = random_model("qwen3")
    fuse_projections(model)
    with pytest.raises(SpecquantError, match="fused projections"):
        save_model(model, tmp_path / "out")
    with pytest.raises(SpecquantError, match="fused projections"):
        quantize(model, QuantConfig(method="rtn"), calib_tokens=torch.zeros(1, 8, dtype=torch.long))
    quantized = gaussian_model()
    quantize(quantized, QuantConfig(method="rtn", group_size=32))
    fuse_projections(quantized)
    with pytest.raises(SpecquantError, match="fused projections"):
        save_quantized(quantized, tmp_path / "q")
    assert not (tmp_path / "out").exists() and not (tmp_path / "q").exists()


def test_load_model_fuse_flag_on_the_bundled_target():
    plain, fused = load_model("tiny-target"), load_model("tiny-target", fuse=True)
    assert fused.model.layers[0].self_attn.qkv_proj is not None
    ids = torch.tensor([[5, 17, 300, 42, 7]])
    with torch.no_grad():
        torch.testing.assert_close(fused(ids), plain(ids), rtol=1e-5, atol=1e-5)


def test_fused_model_on_the_shape_static_cache_matches_unfused():
    # the compiled-step cache layout (static=True) runs the fused q/k path too
    model = random_model("qwen3", seed=2)
    fused = copy.deepcopy(model)
    fuse_projections(fused)
    tokens = torch.randint(0, 101, (1, 30), generator=torch.Generator().manual_seed(3))
    outs = []
    for m, static in ((model, False), (fused, True)):
        m.setup_cache(1, 64, static=static)
        with torch.no_grad():
            logits = [m(tokens[:, :12], 0), m(tokens[:, 12:16], 12), m(tokens[:, 14:15], 14)]  # rollback by 2
            logits += [m(tokens[:, i : i + 1], i) for i in range(15, 30)]
        outs.append(torch.cat(logits, 1))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


def test_quantized_hybrid_fused_matches_unfused(tmp_path):
    """A W4 Qwen3.5 hybrid: gated attention fuses [query | gate, k, v] and every MLP gate/up; Gated DeltaNet keeps
    its projections (its forward reads them one by one) and its recurrent cache steps as before."""
    from _quant_models import hybrid_checkpoint

    model = load_model(hybrid_checkpoint(tmp_path / "hybrid"))
    quantize(model, QuantConfig(method="rtn", group_size=32))
    fused = copy.deepcopy(model)
    kinds = [layer.layer_type for layer in model.model.layers]
    assert fuse_projections(fused) == len(kinds) + kinds.count("gated_attention")
    for layer in fused.model.layers:
        assert layer.mlp.gate_proj is None
        if layer.layer_type == "linear_attention":
            assert layer.linear_attn.in_proj_qkv is not None
        else:
            assert layer.self_attn.q_proj is None
    g = torch.Generator().manual_seed(1)
    prompt, steps = torch.randint(0, 8192, (1, 7), generator=g), [torch.randint(0, 8192, (1, n), generator=g)
                                                                   for n in (1, 4, 1)]
    for a, b in zip(_steps(model, prompt, steps), _steps(fused, prompt, steps)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
