"""The native AVX-512 BF16 W4 kernel (specquant.quant.native) against the dequantize-then-matmul reference.

The kernel rounds activations to bf16 and is otherwise fp32 arithmetic on exact int4 weights, so the reference here
is `bf16(x).float() @ dequant(W).T` in fp32. What is left is fp32 summation order plus the 136·sum(x) offset the
kernel adds and removes per group (see kernels/w4_bf16.cpp): a few fp32 ulps of sum|x·w| per group, observed
<= 3e-6 of max |y|; REL_TOL leaves 3x headroom. Kernel tests skip on CPUs without AVX-512 BF16 or without g++.
"""

import pytest
import torch

from specquant.quant import native
from specquant.quant.config import QuantConfig
from specquant.quant.grid import dequantize, quantize_weight
from specquant.quant.linear import QuantLinear, auto_backend

REL_TOL = 1e-5
needs_kernel = pytest.mark.skipif(native.library() is None, reason=f"native kernel unavailable: {native.build()[1]}")


def weights(out, inp, group, seed=0, scale_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * inp**-0.5
    codes, scale, zero = quantize_weight(w, QuantConfig(method="rtn", bits=4, group_size=group),
                                         scale_dtype=scale_dtype)
    return codes, scale, g


def reference(x, codes, scale):
    return x.to(torch.bfloat16).float() @ dequantize(codes, scale.float(), None).t()


def test_pack_layout_puts_each_code_where_the_kernel_reads_it():
    codes, scale, _ = weights(32, 64, 32)
    packed, scales = native.pack(codes, scale)
    assert packed.shape == (2, 8, 64) and scales.shape == (2, 2, 16)
    u = codes.to(torch.int16) + 8
    for t, k8, lane, half, i, second in [(0, 0, 0, 0, 0, 0), (1, 7, 3, 1, 3, 1), (0, 3, 2, 1, 1, 0)]:
        byte = int(packed[t, k8, 16 * lane + 8 * half + 2 * i + second])
        o, k = 16 * t + 4 * lane + i, 8 * k8 + 2 * half + second  # low nibble: k, high nibble: k + 4
        assert byte & 15 == u[o, k] and byte >> 4 == u[o, k + 4]
    assert torch.equal(scales[1, 1], scale[16:32, 1].float())


@needs_kernel
@pytest.mark.parametrize("out,inp,group", [(16, 64, 32), (128, 384, 32), (1024, 384, 128), (48, 1024, 64),
                                           (64, 256, 256), (32, 96, 96)])
def test_kernel_matches_reference(out, inp, group):
    codes, scale, g = weights(out, inp, group)
    packed, scales = native.pack(codes, scale)
    for rows in (1, 2, 3, 7, 8, 9, 16, 20):
        x = torch.randn(rows, inp, generator=g) * 3
        ref = reference(x, codes, scale)
        got = native.gemm(x, packed, scales, group)
        err = (got - ref).abs().max() / ref.abs().max()
        assert err <= REL_TOL, f"{out}x{inp} g{group} rows={rows}: rel err {err:.2e}"


@needs_kernel
def test_rows_are_batch_invariant():
    """Each row sums in the same order whatever M is: a verify step's row i equals the one-row step bit for bit."""
    codes, scale, g = weights(64, 256, 32)
    packed, scales = native.pack(codes, scale)
    x = torch.randn(13, 256, generator=g)
    batch = native.gemm(x, packed, scales, 32)
    for i in range(13):
        assert torch.equal(native.gemm(x[i : i + 1], packed, scales, 32), batch[i : i + 1])


@needs_kernel
def test_kernel_handles_bf16_scales_and_activations():
    codes, scale, g = weights(32, 128, 32, scale_dtype=torch.bfloat16)
    packed, scales = native.pack(codes, scale)
    x = torch.randn(4, 128, generator=g).to(torch.bfloat16)
    ref = reference(x, codes, scale)
    assert (native.gemm(x, packed, scales, 32) - ref).abs().max() <= REL_TOL * ref.abs().max()


@needs_kernel
def test_quant_linear_uses_it_by_default_for_few_rows():
    codes, scale, g = weights(64, 256, 32)
    m = QuantLinear.from_codes(codes, scale, None, 4, torch.randn(64, generator=g))
    x = torch.randn(2, 3, 256, generator=g)
    assert auto_backend(m, x) == "native_w4_bf16"
    y = m(x)
    ref = reference(x.reshape(6, 256), codes, scale).reshape(2, 3, 64) + m.bias
    assert y.shape == (2, 3, 64) and (y - ref).abs().max() <= REL_TOL * ref.abs().max()


def test_unpack_inverts_pack():
    codes = torch.randint(-8, 8, (48, 96), generator=torch.Generator().manual_seed(3), dtype=torch.int8)
    assert torch.equal(native.unpack_codes(native.pack_codes(codes)), codes)


@needs_kernel
def test_one_copy_of_the_codes_in_memory_and_checkpoint_tensors_unchanged():
    """The native kernel permutes weight_packed in place (no second packed copy); codes(), state_dict(), .to()
    and load_state_dict() still see the compressed-tensors layout, bit for bit."""
    codes, scale, g = weights(64, 256, 32)
    m = QuantLinear.from_codes(codes, scale, None, 4)
    saved = {k: v.clone() for k, v in m.state_dict().items()}
    ptr = m.weight_packed.data_ptr()
    x = torch.randn(3, 256, generator=g)
    y = m(x)
    assert m.native_layout and m.weight_packed.data_ptr() == ptr
    assert not torch.equal(m.weight_packed, saved["weight_packed"])  # permuted in place ...
    assert [k for k in m._cache if k[0] != "backend"] == [("native", "w4_bf16")]  # the kernel's view + scales
    assert torch.equal(m.codes(), codes)  # ... yet every reader sees the same codes
    state = m.state_dict()
    assert state.keys() == saved.keys() and all(torch.equal(state[k], saved[k]) for k in saved)
    assert torch.equal(m(x), y) and m.native_layout  # saving left the kernel's layout in place
    ref = reference(x, codes, scale)
    assert (y - ref).abs().max() <= REL_TOL * ref.abs().max()
    moved = m.to(torch.float32)  # _apply: back to the checkpoint layout
    assert not moved.native_layout and torch.equal(moved.weight_packed, saved["weight_packed"])
    moved.backend = "auto"
    moved(x)
    assert moved.native_layout
    moved.load_state_dict(saved)  # overwrites the buffer with checkpoint bytes
    assert not moved.native_layout and torch.equal(moved.codes(), codes) and torch.equal(moved(x), y)


def test_unsupported_layers_are_declined():
    assert not native.supports(8, 32, True, 256, 64)  # 8 bits
    assert not native.supports(4, 32, False, 256, 64)  # zero points
    assert not native.supports(4, 32, True, 256, 40)  # out not a multiple of 16
    assert native.supports(4, 32, True, 256, 64)


def test_disabled_or_missing_compiler_falls_back_with_a_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECQUANT_NATIVE", "0")
    assert native.build() == (None, "disabled by SPECQUANT_NATIVE=0")
    monkeypatch.setenv("SPECQUANT_NATIVE", "1")
    monkeypatch.setenv("SPECQUANT_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    monkeypatch.setattr(native, "_cpu_problem", lambda needed: None)
    path, why = native.build()
    assert path is None and "build failed" in why
    monkeypatch.delenv("CXX")
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    assert native.build() == (None, "no C++ compiler (g++/c++) on PATH; install g++ or set CXX")
