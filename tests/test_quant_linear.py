"""Every QuantLinear backend against `reference` (dequantize, then a plain matmul)."""

import pytest
import torch

from specquant.errors import SpecquantError
from specquant.quant.config import QuantConfig
from specquant.quant.grid import quantize_weight
from specquant.quant.linear import BACKENDS, LARGE_ROWS, QuantLinear, auto_backend, set_backend

ROWS = [1, 2, 4, 9, 16]
# Max |backend − reference| allowed, relative to max |reference output|. fp32: the int4 kernel accumulates in a
# different order (observed ≤ 3e-7 relative); bf16: both sides round the output to bf16 (2^-8 relative) and
# the kernel's bf16 zero term −zp·scale adds one more rounding, so a few bf16 ulps (observed ≤ 7e-3).
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# int4pack_cpu_bf16 rounds fp32 activations to bf16 before the kernel: bf16-level error whatever the input dtype;
# native_w4a8 rounds them to int8 per block of 32 (observed <= 7e-3; its exact contract: tests/test_native_w4a8.py).
BACKEND_REL_TOL = {"int4pack_cpu_bf16": 2e-2, "native_w4_bf16": 2e-2, "native_w4a8": 2e-2}


def make(symmetric: bool, dtype, group=32, out=64, inp=256, bias=False, bits=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * inp**-0.5
    cfg = QuantConfig(method="rtn", bits=bits, group_size=group, symmetric=symmetric)
    codes, scale, zero = quantize_weight(w, cfg, scale_dtype=dtype)
    b = torch.randn(out, generator=g) if bias else None
    return QuantLinear.from_codes(codes, scale, zero, bits, b), g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
def test_backend_matches_reference(backend, symmetric, dtype):
    for group in (32, 128):
        m, g = make(symmetric, dtype, group=group, bias=True)
        for rows in ROWS:
            x = torch.randn(rows, 256, generator=g).to(dtype)
            m.backend = "reference"
            ref = m(x)
            m.backend = backend
            m.invalidate()
            if not BACKENDS[backend].supports(m, x):
                pytest.skip(f"{backend} does not support this layer/input")
            got = m(x)
            assert got.shape == ref.shape and got.dtype == dtype
            if backend == "dequant_cached":
                assert torch.equal(got, ref)  # same dequantized weight, same matmul
            else:
                err = (got.float() - ref.float()).abs().max() / ref.float().abs().max()
                tol = BACKEND_REL_TOL.get(backend, REL_TOL[dtype])
                assert err <= tol, f"{backend} rows={rows} group={group}: rel err {err:.2e}"


def test_reference_equals_dense_linear_on_dequantized_weight():
    m, g = make(False, torch.float32, bias=True)
    x = torch.randn(3, 5, 256, generator=g)
    dense = torch.nn.functional.linear(x, m.dequantized_weight(), m.bias)
    m.backend = "reference"
    assert torch.equal(m(x), dense)
    for name in [n for n in BACKENDS if BACKENDS[n].supports(m, x)]:  # leading dims are preserved by every backend
        m.backend = name
        assert m(x).shape == (3, 5, 64)


def test_eight_bit_layer_round_trips_and_runs():
    m, g = make(True, torch.float32, bits=8, group=128)
    assert m.weight_packed.shape == (64, 256 // 4)
    x = torch.randn(4, 256, generator=g)
    m.backend = "reference"
    ref = m(x)
    m.backend = "dequant_cached"
    cached = m(x)
    torch.testing.assert_close(cached, ref)  # the dense math (as a dense Linear runs it: model.modules.dense_linear)
    m.backend = "auto"
    assert torch.equal(m(x), cached)  # 8 bits: auto picks dequant_cached


def test_auto_policy_follows_measurement(native_kernels):
    from specquant.kernels import w4_bf16

    few = "native_w4_bf16" if w4_bf16.FAMILY.library() is not None else "int4pack_cpu_bf16"
    assert (few == "int4pack_cpu_bf16") == (native_kernels == "fallback" or w4_bf16.FAMILY.library() is None)
    m, _ = make(True, torch.bfloat16)
    assert auto_backend(m, torch.zeros(1, 256, dtype=torch.bfloat16)) == few
    assert auto_backend(m, torch.zeros(1, 256, dtype=torch.float32)) == few
    asym, _ = make(False, torch.bfloat16)  # zero points: only the torch int4 kernel takes them
    assert auto_backend(asym, torch.zeros(1, 256, dtype=torch.bfloat16)) == "int4pack_cpu_bf16"
    odd, _ = make(True, torch.bfloat16, out=40)  # out % 16 != 0: the int4 kernel cannot take it
    assert auto_backend(odd, torch.zeros(1, 256, dtype=torch.bfloat16)) == "dequant_cached"
    eight, _ = make(True, torch.float32, bits=8, group=128)
    assert auto_backend(eight, torch.zeros(1, 256)) == "dequant_cached"
    # prompt-sized inputs: dequantize per call + one dense GEMM (the kernel's cost grows with rows)
    assert auto_backend(m, torch.zeros(1, LARGE_ROWS - 1, 256)) == few
    assert auto_backend(m, torch.zeros(1, LARGE_ROWS, 256)) == "reference"


def test_auto_switches_backend_by_row_count_per_call():
    m, g = make(True, torch.float32)
    small, large = torch.randn(2, 256, generator=g), torch.randn(LARGE_ROWS, 256, generator=g)
    m.backend = "reference"
    want_small, want_large = m(small), m(large)
    m.backend = "auto"
    assert torch.equal(m(large), want_large)
    err = (m(small) - want_small).abs().max() / want_small.abs().max()
    assert 0 < err <= BACKEND_REL_TOL["int4pack_cpu_bf16"]  # a kernel ran (bf16 activations), not the reference
    assert torch.equal(m(large), want_large)


def test_bf16_kernel_path_is_the_bf16_computation():
    # fp32 activations through int4pack_cpu_bf16 == bf16 activations through int4pack_cpu, cast back to fp32
    m, g = make(True, torch.float32)
    x = torch.randn(5, 256, generator=g)
    m.backend = "int4pack_cpu_bf16"
    got = m(x)
    assert got.dtype == torch.float32
    m.to(torch.bfloat16)
    m.backend = "int4pack_cpu"
    assert torch.equal(got, m(x.bfloat16()).float())


def test_cache_is_dropped_when_dtype_changes():
    m, g = make(True, torch.float32)
    x = torch.randn(2, 256, generator=g)
    m.backend = "dequant_cached"
    y32 = m(x)
    m.to(torch.bfloat16)
    y16 = m(x.bfloat16())
    assert y16.dtype == torch.bfloat16
    torch.testing.assert_close(y16.float(), y32, rtol=2e-2, atol=2e-2)


def test_bad_backend_names_raise():
    m, _ = make(True, torch.float32)
    with pytest.raises(SpecquantError, match="unknown QuantLinear backend 'fast'"):
        set_backend(torch.nn.Sequential(m), "fast")
    odd, _ = make(True, torch.float32, out=40)
    odd.backend = "int4pack_cpu"
    with pytest.raises(SpecquantError, match="cannot run this layer"):
        odd(torch.zeros(1, 256))


@pytest.mark.parametrize("backend", ["int4pack_cpu_bf16", "int4pack_cpu", "int8pack_cpu", "dequant_cached"])
def test_torch_export_sees_the_fallback_backends_inputs_as_named_buffers(backend):
    """What an AOTInductor package binds by name (decode/aot.py): on the torch backends too, the exported graph
    reads only the layer's buffers (the derived ones are non-persistent buffers, never saved) and no lifted constant;
    the int4 kernel is one opaque operator, so inductor adds no group-size constant of its own."""
    m, g = make(True, torch.bfloat16, bits=8 if backend == "int8pack_cpu" else 4,
                group=256 if backend == "int8pack_cpu" else 32)
    m.backend = backend
    x = torch.randn(3, 256, generator=g).to(torch.bfloat16)
    eager = m(x)
    ep = torch.export.export(m, (x,), strict=False)
    assert not ep.graph_signature.lifted_tensor_constants
    derived = set(ep.graph_signature.inputs_to_buffers.values()) - set(m.state_dict())
    assert derived and derived <= set(m._buffers) and not derived & set(m.state_dict())
    if backend.startswith("int4pack"):
        assert "specquant.int4pack_mm" in str(ep.graph)
    assert torch.equal(ep.module()(x), eager)
    m.invalidate()  # the derived buffers go with the rest of the backend state
    assert not derived & set(m._buffers)
