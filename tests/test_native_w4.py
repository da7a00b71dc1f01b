"""The w4_bf16 kernel family (kernels/w4_bf16.py), every variant this CPU runs, against the
dequantize-then-matmul reference.

The kernel rounds activations to bf16 and is otherwise fp32 arithmetic on exact int4 weights, so the reference here
is `bf16(x).float() @ dequant(W).T` in fp32. What is left is fp32 summation order plus the 136·sum(x) offset the
kernel adds and removes per group (see kernels/w4_bf16_avx512.cpp): a few fp32 ulps of sum|x·w| per group, observed
<= 3e-6 of max |y|; REL_TOL leaves 3x headroom. A variant's tests skip, with the reason, where it does not build
(its CPU extension missing, no g++, SPECQUANT_NATIVE=off).
"""

import pytest
import torch
from conftest import kernel_variants, need_kernel

from specquant.kernels import Family, build, w4_bf16
from specquant.quant.config import QuantConfig
from specquant.quant.grid import dequantize, quantize_weight
from specquant.quant.linear import QuantLinear, auto_backend

REL_TOL = 1e-5
FAMILY = w4_bf16.FAMILY
VARIANTS = kernel_variants(FAMILY)


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
    packed, scales = w4_bf16.pack(codes, scale)
    assert packed.shape == (2, 8, 64) and scales.shape == (2, 2, 16)
    u = codes.to(torch.int16) + 8
    for t, k8, lane, half, i, second in [(0, 0, 0, 0, 0, 0), (1, 7, 3, 1, 3, 1), (0, 3, 2, 1, 1, 0)]:
        byte = int(packed[t, k8, 16 * lane + 8 * half + 2 * i + second])
        o, k = 16 * t + 4 * lane + i, 8 * k8 + 2 * half + second  # low nibble: k, high nibble: k + 4
        assert byte & 15 == u[o, k] and byte >> 4 == u[o, k + 4]
    assert torch.equal(scales[1, 1], scale[16:32, 1].float())


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("out,inp,group", [(16, 64, 32), (128, 384, 32), (1024, 384, 128), (48, 1024, 64),
                                           (64, 256, 256), (32, 96, 96)])
def test_kernel_matches_reference(out, inp, group, variant):
    need_kernel(FAMILY, variant)
    codes, scale, g = weights(out, inp, group)
    packed, scales = w4_bf16.pack(codes, scale)
    for rows in (1, 2, 3, 7, 8, 9, 16, 20):
        x = torch.randn(rows, inp, generator=g) * 3
        ref = reference(x, codes, scale)
        got = w4_bf16.gemm(x, packed, scales, group, variant)
        err = (got - ref).abs().max() / ref.abs().max()
        assert err <= REL_TOL, f"{out}x{inp} g{group} rows={rows}: rel err {err:.2e}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_rows_are_batch_and_thread_invariant(variant):
    """Each row sums in the same order whatever M or the thread count: a verify step's row i equals the one-row
    step bit for bit."""
    need_kernel(FAMILY, variant)
    codes, scale, g = weights(256, 256, 32)
    packed, scales = w4_bf16.pack(codes, scale)
    x = torch.randn(13, 256, generator=g)
    batch = w4_bf16.gemm(x, packed, scales, 32, variant)
    for i in range(13):
        assert torch.equal(w4_bf16.gemm(x[i : i + 1], packed, scales, 32, variant), batch[i : i + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        assert torch.equal(w4_bf16.gemm(x, packed, scales, 32, variant), batch)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("variant", VARIANTS)
def test_kernel_handles_bf16_scales_and_activations(variant):
    need_kernel(FAMILY, variant)
    codes, scale, g = weights(32, 128, 32, scale_dtype=torch.bfloat16)
    packed, scales = w4_bf16.pack(codes, scale)
    x = torch.randn(4, 128, generator=g).to(torch.bfloat16)
    ref = reference(x, codes, scale)
    assert (w4_bf16.gemm(x, packed, scales, 32, variant) - ref).abs().max() <= REL_TOL * ref.abs().max()


def test_quant_linear_uses_it_by_default_for_few_rows():
    need_kernel(FAMILY)
    codes, scale, g = weights(64, 256, 32)
    m = QuantLinear.from_codes(codes, scale, None, 4, torch.randn(64, generator=g))
    x = torch.randn(2, 3, 256, generator=g)
    assert auto_backend(m, x) == "native_w4_bf16"
    y = m(x)
    ref = reference(x.reshape(6, 256), codes, scale).reshape(2, 3, 64) + m.bias
    assert y.shape == (2, 3, 64) and (y - ref).abs().max() <= REL_TOL * ref.abs().max()


def test_unpack_inverts_pack():
    codes = torch.randint(-8, 8, (48, 96), generator=torch.Generator().manual_seed(3), dtype=torch.int8)
    assert torch.equal(w4_bf16.unpack_codes(w4_bf16.pack_codes(codes)), codes)


def test_one_copy_of_the_codes_in_memory_and_checkpoint_tensors_unchanged():
    """The native kernel permutes weight_packed in place (no second packed copy); codes(), state_dict(), .to()
    and load_state_dict() still see the compressed-tensors layout, bit for bit."""
    need_kernel(FAMILY)
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
    assert not w4_bf16.supports(8, 32, True, 256, 64)  # 8 bits
    assert not w4_bf16.supports(4, 32, False, 256, 64)  # zero points
    assert not w4_bf16.supports(4, 32, True, 256, 40)  # out not a multiple of 16
    assert w4_bf16.supports(4, 32, True, 256, 64)


def test_disabled_or_missing_compiler_falls_back_with_a_reason(monkeypatch, tmp_path):
    best = FAMILY.variants[0]
    for off in ("off", "0"):
        monkeypatch.setenv("SPECQUANT_NATIVE", off)
        assert build.build("w4_bf16", best) == (None, f"disabled by SPECQUANT_NATIVE={off}")
    monkeypatch.setenv("SPECQUANT_NATIVE", "on")
    monkeypatch.setenv("SPECQUANT_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    monkeypatch.setattr(build, "cpu_problem", lambda needed: None)
    path, why = build.build("w4_bf16", best)
    assert path is None and "build failed" in why
    assert not list((tmp_path / "kernels").iterdir())  # no temporary file left behind
    monkeypatch.delenv("CXX")
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    assert build.build("w4_bf16", best) == (None, "no C++ compiler (g++/c++) on PATH; install g++ or set CXX")


def test_an_unknown_switch_value_is_one_line(monkeypatch):
    from specquant.errors import SpecquantError
    from specquant.kernels import reset

    for value in ("maybe", "avx2,avx9"):
        monkeypatch.setenv("SPECQUANT_NATIVE", value)
        reset()
        with pytest.raises(SpecquantError, match=rf"SPECQUANT_NATIVE='{value}' is not understood; use off .*"
                                                 r"list of variants to keep \(.*avx2, .*avx512_bf16, .*portable.*\)"):
            FAMILY.choose()
    reset()


def test_the_switch_keeps_the_named_variants(monkeypatch):
    """SPECQUANT_NATIVE=avx2,portable is what an AVX2-only CPU gets, on any CPU that runs AVX2: every family takes its
    best kept variant the CPU runs, and a family with none of the names says so."""
    from specquant.kernels import FAMILIES, reset

    for keep in (("avx2", "portable"), ("portable",), ("avx512_vnni",)):
        monkeypatch.setenv("SPECQUANT_NATIVE", ",".join(keep))
        reset()
        for f in FAMILIES.values():
            runs = [v for v in f.supported_variants() if v.name in keep]
            if not runs:
                assert f.library() is None and f.why().startswith(f"disabled by SPECQUANT_NATIVE={','.join(keep)}")
            elif f.library() is not None:  # it may still fail to build (no g++): then it says why
                assert f.variant() is runs[0]
    reset()


def test_auto_takes_the_first_variant_that_loads_and_says_why_when_none_does(monkeypatch):
    """`auto` walks the variants in their listed (best-first) order: one that fails is passed over for the next;
    with none, every variant's reason is kept."""
    monkeypatch.delenv("SPECQUANT_NATIVE", raising=False)
    first, second = (build.Variant("a", "x.cpp", (), ()), build.Variant("b", "x.cpp", (), ()))
    fam = Family("t", (first, second), {}, FAMILY.layout, w4_bf16.supports, w4_bf16.gemm, w4_bf16.gemm_op)
    results = {"a": (None, "CPU lacks avx9"), "b": ("lib-b", "loaded")}
    monkeypatch.setattr(fam, "load", lambda v: results[v.name])
    assert fam.variant() is second and fam.library() == "lib-b" and fam.why() == "variant b"
    fam.reset()
    results["b"] = (None, "g++ failed: boom")
    assert fam.library() is None and fam.why() == "a: CPU lacks avx9; b: g++ failed: boom"


def test_the_switch_disables_every_family(native_kernels):
    from specquant.kernels import FAMILIES

    if native_kernels == "fallback":
        assert all(f.library() is None and f.why() == "disabled by SPECQUANT_NATIVE=off" for f in FAMILIES.values())
    elif not build.disabled():  # each family has its best variant this CPU runs (of those kept), or says why not
        keep = build.restriction({v.name for f in FAMILIES.values() for v in f.variants})
        for f in FAMILIES.values():
            runs = [v for v in f.supported_variants() if keep is None or v.name in keep]
            assert f.variant() in runs[:1] or f.library() is None


def test_no_instruction_set_outside_the_variants():
    """The shared header and the base flags carry no ISA: each variant brings its own (a portable one, none)."""
    common = (build.KERNEL_DIR / "common.h").read_text()
    assert "immintrin" not in common and "_mm" not in common
    assert not [f for f in build.BASE_FLAGS if f.startswith("-m")]


def test_the_fma_variants_give_the_same_bits():
    """The AVX2 and portable variants sum with fused multiply-adds in the same order (kernels/w4_bf16_entry.h): the same
    bits from both. (The AVX-512 BF16 variant sums pairs in vdpbf16ps: equal to them only to fp32 rounding.)"""
    fma = [v for v in FAMILY.variants if v.name in ("avx2", "portable") and FAMILY.load(v)[0] is not None]
    if len(fma) < 2:
        pytest.skip(f"the AVX2 and portable variants do not both load here ({FAMILY.why()})")
    codes, scale, g = weights(48, 256, 32, scale_dtype=torch.bfloat16)
    packed, scales = w4_bf16.pack(codes, scale)
    x = torch.randn(10, 256, generator=g)
    assert torch.equal(w4_bf16.gemm(x, packed, scales, 32, fma[0]), w4_bf16.gemm(x, packed, scales, 32, fma[1]))
