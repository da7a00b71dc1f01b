"""QuantConfig.lm_head: each precision against the dense head, the W8 kernel against the reference, and the
checkpoint round trip (the head's own config group, bf16 restored on load)."""

import pytest
import torch

from specquant.errors import SpecquantError
from specquant.loader import load_model
from specquant.quant.checkpoint import save_quantized
from specquant.quant.config import HEAD_PRECISIONS, QuantConfig
from specquant.quant.head import CastLinear, set_lm_head
from specquant.quant.linear import QuantLinear, auto_backend
from specquant.quant.pipeline import quantize

# ||head(x) - dense(x)|| / ||dense(x)|| on the bundled target's head, random-normal x (observed: bf16 3.0e-3,
# w8 1.1e-2, w4 0.15): each bound is about 2x the observed error, so a wrong scale or layout (error ~1) fails.
REL_ERR = {"bf16": 6e-3, "w8": 2.5e-2, "w4": 0.3}


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
    assert 0 < err <= REL_ERR[precision], f"{precision}: rel err {err:.2e}"
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
