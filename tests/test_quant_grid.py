"""Grid math, bit packing and QuantConfig validation (no model needed)."""

import json

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

from specquant.errors import SpecquantError
from specquant.quant.config import AWQConfig, GPTQConfig, QuantConfig
from specquant.quant.grid import dequantize, fake_quant, qrange, quantize_weight, sqnr_db
from specquant.quant.pack import pack_codes, unpack_codes


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", [(16, 64), (24, 256), (5, 32)])
def test_pack_unpack_exact_and_matches_library(bits, shape):
    g = torch.Generator().manual_seed(bits * 100 + shape[0])
    qmin, qmax = qrange(bits)
    codes = torch.randint(qmin, qmax + 1, shape, generator=g, dtype=torch.int8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.int32 and packed.shape == (shape[0], shape[1] * bits // 32)
    assert torch.equal(unpack_codes(packed, bits, shape[1]), codes)
    # Bit-for-bit what compressed-tensors writes and reads.
    assert torch.equal(packed, pack_to_int32(codes, bits))
    assert torch.equal(unpack_from_int32(packed, bits, torch.Size(shape)), codes)


@pytest.mark.parametrize("bits", [4, 8])
def test_zero_point_layout_packs_along_dim0_with_ragged_tail(bits):
    g = torch.Generator().manual_seed(3)
    qmin, qmax = qrange(bits)
    zero = torch.randint(qmin, qmax + 1, (13, 6), generator=g, dtype=torch.int8)  # 13 rows: not a multiple of 8
    packed = pack_codes(zero, bits, dim=0)
    assert packed.shape == (-(-13 * bits // 32), 6)
    assert torch.equal(unpack_codes(packed, bits, 13, dim=0), zero)
    assert torch.equal(packed, pack_to_int32(zero, bits, packed_dim=0))


def test_low_nibble_first_offset_binary():
    codes = torch.tensor([[-8, -7, 0, 1, 2, 3, 6, 7]], dtype=torch.int8)  # +8 -> 0 1 8 9 10 11 14 15
    word = int(pack_codes(codes, 4)[0, 0]) & 0xFFFFFFFF
    assert word == 0xFEBA9810


# 4-bit symmetric g128 on N(0,1) weights: a group's absmax is ≈2.9σ (expected max |x| of 128 normals), the step
# is absmax/7 ≈ 0.41σ and uniform rounding noise step²/12 ≈ 0.014σ² -> SQNR ≈ 18.5 dB (measured 18.6). g32:
# absmax ≈2.5σ -> ≈20 dB (measured 20.3). 8-bit: step ≈ 2.9σ/127 -> ≈44 dB (measured 43.8). Asymmetric spends
# all 16 levels on [min, max] and measures +1.3..1.6 dB. 65k samples put the estimate's spread at a few
# hundredths of a dB (and the seed is fixed), so a failure means a broken quantizer, not bad luck.
@pytest.mark.parametrize("bits,group,min_db", [(4, 128, 18.0), (4, 32, 19.8), (8, 128, 42.0)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_gaussian_sqnr(bits, group, min_db, symmetric):
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    cfg = QuantConfig(method="rtn", bits=bits, group_size=group, symmetric=symmetric)
    codes, scale, zero = quantize_weight(w, cfg)
    qmin, qmax = qrange(bits)
    assert int(codes.min()) >= qmin and int(codes.max()) <= qmax
    assert scale.shape == (256, 256 // group) and (zero is None) == symmetric
    db = sqnr_db(w, dequantize(codes, scale, zero))
    assert db >= min_db + (0.0 if symmetric else 1.0), db


def test_symmetric_scale_is_absmax_over_qmax_and_fake_quant_is_idempotent():
    w = torch.randn(8, 64)
    cfg = QuantConfig(method="rtn", group_size=32)
    codes, scale, zero = quantize_weight(w, cfg)
    expected = w.reshape(8, 2, 32).abs().amax(-1) / 7
    torch.testing.assert_close(scale, expected)
    once = fake_quant(w, scale, zero, 4, 32)
    assert torch.equal(fake_quant(once, scale, zero, 4, 32), once)


def test_scale_stored_in_model_dtype_and_codes_use_rounded_scale():
    w = torch.randn(16, 128)
    codes, scale, _ = quantize_weight(w, QuantConfig(method="rtn"), scale_dtype=torch.bfloat16)
    assert scale.dtype == torch.bfloat16
    manual = torch.clamp(torch.round(w.reshape(16, 1, 128) / scale.float().unsqueeze(-1)), -8, 7)
    assert torch.equal(codes, manual.reshape(16, 128).to(torch.int8))


@pytest.mark.parametrize("kwargs,match", [
    (dict(bits=3), "bits=3"),
    (dict(method="hqq"), "unknown quantization method 'hqq'"),
    (dict(group_size=48), "group_size=48"),
    (dict(method="awq", calib="/nonexistent/calib.txt"), "does not exist"),
])
def test_config_validation(kwargs, match):
    with pytest.raises(SpecquantError, match=match):
        QuantConfig(**kwargs).validate()


def test_group_size_must_divide_in_features_names_layer():
    with pytest.raises(SpecquantError, match=r"model\.layers\.0\.mlp\.down_proj\.in_features=96"):
        QuantConfig(group_size=64).group_for("model.layers.0.mlp.down_proj", 96)
    assert QuantConfig(group_size=None).group_for("x", 96) == 96


def test_config_json_round_trip():
    cfg = QuantConfig(method=GPTQConfig(act_order=True), bits=8, group_size=64, symmetric=False, ignore=["lm_head"])
    assert QuantConfig.from_json(cfg.to_json()) == cfg
    assert QuantConfig.from_json(json.dumps(cfg.to_json())) == cfg
    assert QuantConfig(method="gptq") == QuantConfig(method=GPTQConfig())  # a name is its method's defaults
    # one overrides dict may carry settings for several methods: only the chosen method's section is read
    both = {"method": "awq", "awq": {"grid": 3}, "gptq": {"damp": 0.5}}
    assert QuantConfig.from_json(both).method == AWQConfig(grid=3)
    with pytest.raises(SpecquantError, match="unknown awq setting"):
        QuantConfig.from_json({"method": "awq", "awq": {"grdi": 3}})
    with pytest.raises(SpecquantError, match="unknown QuantConfig field"):
        QuantConfig.from_json({"method": "rtn", "nbits": 4})


@pytest.mark.parametrize("bits", [4, 8])
def test_big_endian_word_assembly_matches_the_little_endian_view(bits):
    from specquant.quant.pack import _pack_words

    codes = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (5, 64), dtype=torch.int8)
    u = (codes.to(torch.int16) + (1 << (bits - 1))).to(torch.uint8)
    if bits == 4:
        u = u[:, 0::2] | (u[:, 1::2] << 4)
    assert torch.equal(_pack_words(u, 5), pack_codes(codes, bits))
