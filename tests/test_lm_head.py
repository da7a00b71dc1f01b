"""QuantConfig.lm_head: each precision against the dense head, the W8 kernel against the reference, and the
checkpoint round trip (the head's own config group, bf16 restored on load)."""

import pytest
import torch
from conftest import native_switch

from specquant.errors import SpecquantError
from specquant.kernels import ops
from specquant.loader import load_model
from specquant.quant.checkpoint import save_quantized
from specquant.quant.config import HEAD_PRECISIONS, QuantConfig
from specquant.quant.head import CastLinear, set_lm_head
from specquant.quant.linear import QuantLinear, auto_backend
from specquant.quant.pipeline import quantize

# ||head(x) - dense(x)|| / ||dense(x)|| on the bundled target's head, random-normal x (observed: w8 1.1e-2, w4
# 0.15): each bound is about 2x the observed error, so a wrong scale or layout (error ~1) fails. bf16: 0, since the
# bundled weights are bf16 values and fp32 activations meet them widened exactly (quant/head.py CastLinear).
REL_ERR = {"bf16": 0.0, "w8": 2.5e-2, "w4": 0.3}


@torch.no_grad()
def test_bf16_head_on_fp32_activations_is_one_product_on_every_path(monkeypatch):
    """A bf16 head on fp32 activations computes x against the exact widened weight: the native few-row call (half
    the bytes of the dense head) within float rounding of F.linear on weight.float(), which prefill-sized inputs and
    SPECQUANT_NATIVE=off take; a verify row equals the one-row step bit for bit."""
    from specquant.model.modules import NATIVE_ROWS

    g = torch.Generator().manual_seed(3)
    head = CastLinear((torch.randn(1000, 128, generator=g) / 11).to(torch.bfloat16))
    x = torch.randn(1, 5, 128, generator=g)
    reference = torch.nn.functional.linear(x, head.weight.float())
    got = head(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)
    if ops.LIBRARY.library() is not None:  # the native linear's rows are batch-invariant (F.linear's are not)
        assert torch.equal(torch.cat([head(x[:, i : i + 1]) for i in range(5)], 1), got)
    long = torch.randn(1, NATIVE_ROWS + 1, 128, generator=g)
    assert torch.equal(head(long), torch.nn.functional.linear(long, head.weight.float()))
    with native_switch(monkeypatch, "off"):
        assert torch.equal(head(x), reference)


@torch.no_grad()
def test_a_compiled_step_runs_the_bf16_head_as_the_native_operator():
    """Under torch.compile (and so in AOT packages) a bf16 head is one call of the native linear as a torch operator
    (specquant::linear_bf16w), no graph break and no fp32 copy of the matrix per step: the eager logits bit for bit."""
    if ops.LIBRARY.library() is None:
        pytest.skip(f"no native ops library here ({ops.LIBRARY.why()})")
    g = torch.Generator().manual_seed(4)
    head = CastLinear((torch.randn(300, 64, generator=g) / 8).to(torch.bfloat16))
    x = torch.randn(1, 3, 64, generator=g)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(head, fullgraph=True)(x), head(x))


def tiny(seed=0):
    torch.manual_seed(seed)
    return load_model("tiny-target")


@pytest.mark.parametrize("precision", ["bf16", "w8", "w4"])
@torch.no_grad()
def test_head_precisions_approximate_the_dense_head(precision):
    model = tiny()
    x = torch.randn(3, model.config.hidden_size)
    dense = model.lm_head(x)
    embed = model.model.embed_tokens.weight.clone()
    head = set_lm_head(model, precision)
    got = model.lm_head(x)
    assert got.dtype == dense.dtype and got.shape == dense.shape
    err = (got - dense).norm() / dense.norm()
    assert (0 < err if REL_ERR[precision] else err == 0) and err <= REL_ERR[precision], f"{precision}: {err:.2e}"
    assert torch.equal(model.model.embed_tokens.weight, embed) and not model.config.tie_word_embeddings
    if precision == "w8":
        assert isinstance(head, QuantLinear) and auto_backend(head, x) == "int8pack_cpu"


@torch.no_grad()
def test_int8pack_backend_matches_reference():
    model = tiny()
    head = set_lm_head(model, "w8")
    x = torch.randn(5, model.config.hidden_size)
    head.backend = "reference"
    ref = head(x)
    head.backend = "int8pack_cpu"
    assert (head(x) - ref).abs().max() <= 1e-5 * ref.abs().max()  # fp32 kernel: summation order only


@pytest.mark.parametrize("precision", HEAD_PRECISIONS)
@torch.no_grad()
def test_quantize_with_head_precision_round_trips_through_the_checkpoint(precision, tmp_path):
    model = tiny()
    cfg = QuantConfig(method="rtn", group_size=32, lm_head=precision, report_samples=0)
    quantize(model, cfg)
    qc = model.quantization  # what quantize() built with cfg (save_quantized writes it)
    tokens = torch.randint(0, model.config.vocab_size, (1, 12))
    want = model(tokens)
    save_quantized(model, tmp_path / "q", cfg=cfg)
    loaded = load_model(tmp_path / "q")
    head = loaded.lm_head
    if precision in ("w8", "w4"):
        assert list(qc["config_groups"])[0] == "lm_head" and isinstance(head, QuantLinear)
        assert head.bits == (8 if precision == "w8" else 4)
    elif precision == "bf16":
        assert "lm_head" in qc["ignore"] and isinstance(head, CastLinear) and head.weight.dtype == torch.bfloat16
    else:
        assert "lm_head" in qc["ignore"] and not isinstance(head, (QuantLinear, CastLinear))
    assert torch.allclose(loaded(tokens), want, rtol=0, atol=1e-4 * want.abs().max().item())


def test_bad_head_precision_is_refused():
    with pytest.raises(SpecquantError, match="lm_head='w2'"):
        QuantConfig(method="rtn", lm_head="w2").validate()
    model = tiny()
    set_lm_head(model, "w4")
    with pytest.raises(SpecquantError, match="already converted"):
        set_lm_head(model, "w8")
