"""W4 of a Qwen3.5 hybrid (RTN, AWQ, GPTQ): the reference recipe's module list, AWQ's per-kind folds, calibration
through the model's own layer calls, and the compressed-tensors output against transformers."""

import json

import pytest
import torch
from _quant_models import hybrid_checkpoint
from safetensors.torch import load_file

from specquant.loader import load_model
from specquant.model.checkpoint import load_tokenizer
from specquant.model.layers import LAYER_KINDS
from specquant.quant import AWQConfig, GPTQConfig, QuantConfig, QuantLinear, quantize, save_quantized, set_backend
from specquant.quant.awq import AWQ_MAPPINGS, apply_scale
from specquant.quant.calib import layer_calls, run_sequential
from specquant.quant.pipeline import DENSE_BY_KIND
from specquant.spec_decode.engine import generate

METHODS = {
    "rtn": QuantConfig(method="rtn", group_size=32),
    "awq": QuantConfig(method=AWQConfig(grid=8), group_size=32, calib_samples=4, seq_len=32),
    "gptq": QuantConfig(method=GPTQConfig(), group_size=32, calib_samples=4, seq_len=32),
}
# what the reference recipe quantizes (../shared/REFERENCE.md §2), per layer kind
QUANTIZED = {
    "linear_attention": {"linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj"},
    "gated_attention": {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"},
}
MLP = {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    return hybrid_checkpoint(tmp_path_factory.mktemp("hybrid") / "dense")


@pytest.fixture(scope="module")
def quantized(dense_dir, tmp_path_factory):
    """{method: (checkpoint dir, our quantized model, report)}, calibrated on the bundled text with its tokenizer."""
    root = tmp_path_factory.mktemp("hybrid_w4")
    tokenizer = load_tokenizer(dense_dir)
    out = {}
    for name, cfg in METHODS.items():
        model = load_model(dense_dir)
        report = quantize(model, cfg, tokenizer)
        out[name] = (save_quantized(model, root / name, tokenizer_from=dense_dir), model, report)
    return out


def expected_quantized(model) -> set[str]:
    return {f"model.layers.{i}.{n}" for i, layer in enumerate(model.model.layers)
            for n in QUANTIZED[layer.layer_type] | MLP}


@pytest.mark.parametrize("method", METHODS)
def test_quantizes_exactly_the_reference_recipes_modules(quantized, method):
    path, model, report = quantized[method]
    got = {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert got == expected_quantized(model)
    assert report["quantized_linears"] == len(got)
    for layer in model.model.layers:
        if layer.layer_type == "linear_attention":
            for n in ("in_proj_a", "in_proj_b"):
                assert type(getattr(layer.linear_attn, n)) is not QuantLinear
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    dense_linears = {f"model.layers.{i}.linear_attn.{n}" for i in (0, 1, 2) for n in ("in_proj_a", "in_proj_b")}
    assert set(qc["ignore"]) == dense_linears | {"lm_head"}
    assert report["kept_dense"] == sorted(dense_linears)
    tensors = load_file(path / "model.safetensors")
    for i in (0, 1, 2):  # DeltaNet's dense tensors are stored as they were, in float
        for n in ("in_proj_a.weight", "in_proj_b.weight", "conv1d.weight", "A_log", "dt_bias", "norm.weight"):
            assert tensors[f"model.layers.{i}.linear_attn.{n}"].is_floating_point(), n
        assert f"model.layers.{i}.linear_attn.in_proj_qkv.weight_packed" in tensors
    assert tensors["model.embed_tokens.weight"].is_floating_point() and "lm_head.weight" in tensors


def test_ignore_patterns_do_not_quantize_what_the_recipe_keeps_dense(dense_dir):
    """--ignore with no pattern quantizes lm_head as well, never in_proj_a / in_proj_b."""
    model = load_model(dense_dir)
    quantize(model, QuantConfig(method="rtn", group_size=32, ignore=[]))
    got = {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert got == expected_quantized(model) | {"lm_head"}


def test_tables_are_keyed_by_every_layer_kind(dense_dir):
    """AWQ's mappings and the dense list are data per layer kind, and name modules each kind really has."""
    assert set(AWQ_MAPPINGS) == set(LAYER_KINDS) == set(DENSE_BY_KIND)
    model = load_model(dense_dir)
    seen = set()
    for layer in model.model.layers:
        names = dict(layer.named_modules())
        seen.add(layer.layer_type)
        for m in AWQ_MAPPINGS[layer.layer_type]:
            for n in (m.prev, *m.linears, *([m.scored_on] if m.scored_on else []), *m.dense_readers):
                assert n in names, (layer.layer_type, n)
        assert all(n in names for n in DENSE_BY_KIND[layer.layer_type])
    assert seen == {"linear_attention", "gated_attention"}


@torch.no_grad()
def test_awq_folds_are_exact_in_full_precision_on_every_hybrid_kind(tmp_path):
    """Every mapping of both kinds, folded with random scales in float64: zero-centred norms (1 + w), DeltaNet's dense
    in_proj_a / in_proj_b rescaled with in_proj_qkv / in_proj_z, v -> o under the output gate (4 heads, 4 kv heads,
    so that mapping applies)."""
    model = load_model(hybrid_checkpoint(tmp_path / "mha", num_key_value_heads=4)).double()
    tokens = torch.randint(0, 8192, (2, 12), generator=torch.Generator().manual_seed(0))
    calls = layer_calls(model, tokens[:1])
    g = torch.Generator().manual_seed(1)
    folded_kinds = set()
    for layer, (args, kwargs) in zip(model.model.layers, calls):
        x = torch.randn(2, 12, 64, generator=g, dtype=torch.float64)
        before = layer(x, *args, **kwargs)
        modules = dict(layer.named_modules())
        for m in AWQ_MAPPINGS[layer.layer_type]:
            prev, lins = modules[m.prev], [modules[n] for n in m.linears]
            width = prev.out_features if isinstance(prev, torch.nn.Linear) else prev.weight.shape[0]
            if lins[0].in_features != width:
                continue  # v -> o under GQA
            s = torch.rand(width, generator=g, dtype=torch.float64) + 0.5
            apply_scale(prev, lins, s, torch.ones(1, width, dtype=torch.float64),
                        tuple(modules[n] for n in m.dense_readers))
            folded_kinds.add((layer.layer_type, m.prev))
        # Qwen3.5's norms and the delta rule compute in fp32 whatever the model's dtype, so the fold is exact only
        # to fp32 rounding (observed ~1e-5); folding s into w instead of 1 + w moves the output by O(1)
        torch.testing.assert_close(layer(x, *args, **kwargs), before, rtol=0, atol=1e-4 * float(before.abs().max()))
    assert {("linear_attention", "input_layernorm"), ("gated_attention", "input_layernorm"),
            ("gated_attention", "self_attn.v_proj"), ("linear_attention", "mlp.up_proj")} <= folded_kinds


def test_awq_search_per_kind_never_worse_than_rtn(quantized):
    search = quantized["awq"][2]["search"]
    expect = {
        "linear_attention": {"input_layernorm->in_proj_qkv+in_proj_z", "post_attention_layernorm->gate_proj+up_proj",
                             "mlp.up_proj->down_proj"},
        # v -> o is skipped: 2 kv heads, 4 heads
        "gated_attention": {"input_layernorm->q_proj+k_proj+v_proj", "post_attention_layernorm->gate_proj+up_proj",
                            "mlp.up_proj->down_proj"},
    }
    model = quantized["awq"][1]
    for i, layer in enumerate(model.model.layers):
        assert set(search[f"model.layers.{i}"]) == expect[layer.layer_type]
        for key, s in search[f"model.layers.{i}"].items():
            assert s["awq_loss"] <= s["rtn_loss"], (i, key)


@pytest.mark.parametrize("kind", ["hybrid", "dense"])
def test_calibration_calls_each_layer_as_the_models_forward_does(dense_dir, kind):
    """run_sequential with nothing quantized pushes the stream through the layers with the model's own arguments:
    its output is exactly the model's last hidden state."""
    if kind == "hybrid":
        model = load_model(dense_dir)
    else:
        from _quant_models import gaussian_model

        model = gaussian_model()
    tokens = torch.randint(0, model.config.vocab_size, (5, 16), generator=torch.Generator().manual_seed(2))
    hidden = run_sequential(model, tokens, lambda *a: None, batch_size=2)
    with torch.no_grad():
        _, expect = model(tokens, hidden_layers=(model.config.num_hidden_layers - 1,))
    assert torch.equal(torch.cat(hidden), expect[:, :, 0])


@pytest.mark.parametrize("method", METHODS)
def test_transformers_loads_the_hybrid_checkpoint_with_our_logits_and_greedy_tokens(quantized, method):
    """transformers (Qwen3_5ForCausalLM + compressed-tensors) decompresses the checkpoint to dense Linears on CPU:
    with our dequant_cached backend both sides do the same dense math, so our fp32 logits agree with its float64
    ones to fp32 rounding (2e-4 here with torch's GEMMs, 5e-5 with our native linear; transformers' own fp32 forward
    is 2e-4 off) and greedy tokens are equal."""
    from transformers import AutoModelForCausalLM

    path, _, _ = quantized[method]
    ours = load_model(path)
    set_backend(ours, "dequant_cached")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64).eval()
    assert type(hf).__name__ == "Qwen3_5ForCausalLM"
    tokens = torch.randint(0, 8192, (2, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens).double(), rtol=0, atol=3e-4)
        prompt = tokens[:1, :8]
        expect = hf.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert generate(ours, prompt, 24, stop_on_eos=False).token_ids[0] == expect[0, 8:].tolist()


def test_quantize_cli_on_a_hybrid_says_what_it_kept_dense(dense_dir, tmp_path, capsys):
    from specquant.cli import main

    out = tmp_path / "q"
    assert main(["quantize", "--model", str(dense_dir), "--out", str(out), "--method", "gptq", "--group-size", "32",
                 "--calib-samples", "2", "--seq-len", "32", "--dtype", "bfloat16"]) == 0
    text = capsys.readouterr().out
    assert "kept dense by the layer kind's recipe: 6 Linears (in_proj_a, in_proj_b)" in text
    assert "25 Linears, gptq" in text
    model = load_model(out)
    assert {n for n, m in model.named_modules() if isinstance(m, QuantLinear)} == expected_quantized(model)
