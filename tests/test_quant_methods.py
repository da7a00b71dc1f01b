"""RTN / AWQ / GPTQ quality: per-layer SQNR thresholds and the AWQ < RTN, GPTQ < RTN orderings."""

import copy

import pytest
import torch
from _quant_models import gaussian_model, outlier_model, sample_text

from specquant.errors import SpecquantError
from specquant.quant import AWQConfig, GPTQConfig, QuantConfig, QuantLinear, quantize
from specquant.quant.awq import apply_scale
from specquant.quant.quality import compare, logprobs


def test_gptq_warns_when_calibration_has_fewer_tokens_than_input_features(caplog):
    model = gaussian_model(intermediate_size=512, hidden_size=256, head_dim=64)
    few = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1))  # 256 tokens < down_proj's 512
    with caplog.at_level("WARNING", logger="specquant.quant.pipeline"):
        quantize(copy.deepcopy(model), QuantConfig(method="gptq", group_size=128), calib_tokens=few)
    assert any("rank-deficient" in r.getMessage() and "down_proj" in r.getMessage() for r in caplog.records)
    caplog.clear()
    enough = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(1))  # 512 tokens
    with caplog.at_level("WARNING", logger="specquant.quant.pipeline"):
        quantize(copy.deepcopy(model), QuantConfig(method="gptq", group_size=128), calib_tokens=enough)
        quantize(copy.deepcopy(model), QuantConfig(method="rtn", group_size=128), calib_tokens=few)
    assert not any("rank-deficient" in r.getMessage() for r in caplog.records)


def test_quantize_runs_without_autograd(monkeypatch):
    from specquant.quant import rtn

    seen, original = [], rtn.quantize_layer

    def recording(*args, **kwargs):
        seen.append(torch.is_grad_enabled())
        return original(*args, **kwargs)

    monkeypatch.setattr(rtn, "quantize_layer", recording)
    model = gaussian_model(intermediate_size=512, hidden_size=256, head_dim=64)
    with torch.enable_grad():
        quantize(model, QuantConfig(method="rtn", group_size=128))
    assert seen and not any(seen)


def test_rtn_gaussian_per_layer_sqnr_and_bytes():
    model = gaussian_model(intermediate_size=512, hidden_size=256, head_dim=64)
    calib = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1))
    report = quantize(model, QuantConfig(method="rtn", group_size=128), calib_tokens=calib)
    assert report["quantized_linears"] == 14 and "lm_head" not in {r["name"] for r in report["layers"]}
    assert isinstance(model.lm_head, torch.nn.Linear)  # ignored by default
    for row in report["layers"]:
        # 4-bit g128 on N(0,1) weights: ≈18.6 dB weight SQNR (see test_quant_grid.test_gaussian_sqnr). The output
        # error x·ΔWᵀ sums many independent rounding errors, so the output SQNR is within ~1 dB of it.
        assert row["weight_sqnr_db"] >= 18.0, row
        assert row["output_sqnr_db"] >= 17.0, row
    # Linears shrink 32/4.x: bytes fall to the embedding + lm_head + ~1/7 of the Linears.
    assert report["bytes_after"] < 0.5 * report["bytes_before"]


@pytest.fixture(scope="module")
def outlier_setup():
    fp = outlier_model()
    calib = sample_text(fp, 16, 64, seed=10)
    heldout = sample_text(fp, 16, 128, seed=11)  # a different draw: held out from calibration
    reference = logprobs(fp, heldout)
    results, reports = {}, {}
    for name, cfg in {
        "rtn": QuantConfig(method="rtn", group_size=64),
        "awq": QuantConfig(method="awq", group_size=64),
        "gptq": QuantConfig(method="gptq", group_size=64),
        "gptq_act_order_asym": QuantConfig(method=GPTQConfig(act_order=True), group_size=64, symmetric=False),
    }.items():
        m = copy.deepcopy(fp)
        reports[name] = quantize(m, cfg, calib_tokens=calib)
        results[name] = compare(reference, m, heldout)
    return results, reports


def test_awq_and_gptq_beat_rtn_on_outlier_model(outlier_setup):
    """KL(fp ‖ quant) and perplexity on text sampled from the fp model (2048 held-out tokens), 4-bit g64.

    Measured: KL rtn 0.066, awq 0.026, gptq 0.037, gptq act-order asym 0.019 nats; ppl fp 19.21, rtn 20.27,
    awq 19.77, gptq 19.84, gptq-ao-asym 19.68. KL is exact given the tokens. The ppl gap is a paired mean over
    2048 tokens: AWQ−RTN −0.025 and GPTQ−RTN −0.021 nats with standard error 0.009, i.e. 2.4–2.8σ, so a
    reseeded run would break the ppl ordering with odds of roughly 1% per method; with the fixed seeds here
    the test is deterministic.
    """
    r = outlier_setup[0]
    for method in ("awq", "gptq", "gptq_act_order_asym"):
        assert r[method]["kl"] < 0.8 * r["rtn"]["kl"], (method, r)
        assert r[method]["ppl"] < r["rtn"]["ppl"], (method, r)
        assert r[method]["top1_agree"] > r["rtn"]["top1_agree"], (method, r)
    assert r["rtn"]["ppl"] > r["rtn"]["ppl_ref"]


def test_awq_search_never_worse_than_rtn_locally(outlier_setup):
    search = outlier_setup[1]["awq"]["search"]
    assert set(search) == {"model.layers.0", "model.layers.1"}
    groups = [g for layer in search.values() for g in layer.items()]
    assert {k for k, _ in groups} == {"input_layernorm->q_proj+k_proj+v_proj", "self_attn.v_proj->o_proj",
                                      "post_attention_layernorm->gate_proj+up_proj", "mlp.up_proj->down_proj"}
    # α = 0 is plain RTN, so each group's chosen loss is ≤ its RTN loss.
    for key, s in groups:
        assert s["awq_loss"] <= s["rtn_loss"], key
    assert any(s["awq_loss"] < 0.7 * s["rtn_loss"] for _, s in groups)  # the outlier channels are protected


def test_gptq_output_error_beats_rtn_per_layer(outlier_setup):
    rtn = {r["name"]: r for r in outlier_setup[1]["rtn"]["layers"]}
    for row in outlier_setup[1]["gptq"]["layers"]:
        assert row["output_sqnr_db"] > rtn[row["name"]]["output_sqnr_db"], row["name"]


def test_awq_scale_folding_is_exact_in_full_precision():
    model = outlier_model(kv_heads=4).double()
    layer = model.model.layers[0]
    x = torch.randn(2, 8, 256, dtype=torch.float64)
    cos, sin = model.rope_cos[:8].double(), model.rope_sin[:8].double()
    before = layer(x, cos, sin, 0)
    attn, mlp = layer.self_attn, layer.mlp
    g = torch.Generator().manual_seed(0)
    for prev, lins in [(layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj]), (attn.v_proj, [attn.o_proj]),
                       (layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj]), (mlp.up_proj, [mlp.down_proj])]:
        s = torch.rand(lins[0].in_features, generator=g, dtype=torch.float64) + 0.5
        apply_scale(prev, lins, s, torch.ones(1, lins[0].in_features, dtype=torch.float64))
    torch.testing.assert_close(layer(x, cos, sin, 0), before, rtol=1e-10, atol=1e-10)


def test_awq_skips_v_to_o_under_gqa():
    model = outlier_model(kv_heads=2)
    calib = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(0))
    report = quantize(model, QuantConfig(method=AWQConfig(grid=4, clip=False), group_size=64),
                      calib_tokens=calib)
    assert not any(k.endswith("o_proj") for layer in report["search"].values() for k in layer)
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 14


def test_group_size_error_names_layer_and_changes_nothing():
    model = gaussian_model(intermediate_size=96)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(SpecquantError, match=r"model\.layers\.0\.mlp\.down_proj\.in_features=96"):
        quantize(model, QuantConfig(method="rtn", group_size=64))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_calibrating_methods_need_tokens():
    with pytest.raises(SpecquantError, match="needs a tokenizer"):
        quantize(gaussian_model(), QuantConfig(method="gptq", group_size=32))


@pytest.mark.parametrize("method", ["awq", "gptq", "rtn"])
def test_calibration_stream_through_stand_ins_equals_quantlinear_reference(method, monkeypatch):
    """The calibration stream goes through plain Linears holding the dequantized weight (pipeline._stand_in,
    dequantized once per layer) instead of QuantLinear (which dequantizes on every batch): the quantized model and
    the report must be bit-identical to streaming through QuantLinear's reference backend, the plain path. Few
    rows per batch on purpose: there auto would pick an int4 kernel, whose bf16 activations differ."""
    import specquant.quant.pipeline as pipeline

    fp = outlier_model(kv_heads=2)
    calib = sample_text(fp, 4, 16, seed=3)
    cfg = QuantConfig(method=method, group_size=64, symmetric=method != "gptq", report_samples=2)
    fast = copy.deepcopy(fp)
    fast_report = quantize(fast, cfg, calib_tokens=calib, scale_dtype=torch.bfloat16)

    def reference_stand_in(linear, res, deq):  # what the stream went through before: QuantLinear, reference backend
        ql = QuantLinear.from_codes(res.codes, res.scale, res.zero, cfg.bits, linear.bias)
        ql.backend = "reference"
        return ql

    monkeypatch.setattr(pipeline, "_stand_in", reference_stand_in)
    slow = copy.deepcopy(fp)
    slow_report = quantize(slow, cfg, calib_tokens=calib, scale_dtype=torch.bfloat16)
    assert fast_report["layers"] == slow_report["layers"]
    fast_sd, slow_sd = fast.state_dict(), slow.state_dict()
    assert fast_sd.keys() == slow_sd.keys()
    for key in fast_sd:
        assert torch.equal(fast_sd[key], slow_sd[key]), key


def test_rtn_report_changes_nothing_but_the_report():
    """RTN's output-error report (report_samples > 0) runs calibration forwards only to measure: the quantized
    tensors are bit-identical without it (the default, which reads no text)."""
    fp = gaussian_model()
    calib = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    plain, measured = copy.deepcopy(fp), copy.deepcopy(fp)
    quiet = quantize(plain, QuantConfig(method="rtn", group_size=64), scale_dtype=torch.bfloat16)
    loud = quantize(measured, QuantConfig(method="rtn", group_size=64, report_samples=2), calib_tokens=calib,
                    scale_dtype=torch.bfloat16)
    assert all("output_sqnr_db" not in r for r in quiet["layers"])
    assert all(r["output_sqnr_db"] > 10 for r in loud["layers"])
    assert [r["weight_sqnr_db"] for r in quiet["layers"]] == [r["weight_sqnr_db"] for r in loud["layers"]]
    for (key, a), b in zip(plain.state_dict().items(), measured.state_dict().values()):
        assert torch.equal(a, b), key
