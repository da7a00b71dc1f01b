"""The w4a8 kernel family (kernels/w4a8.py), every variant this CPU runs: int8 activations against exact int4
weights.

Three references, from the tightest: every variant's activation quantization equals the torch one bit for bit; its
GEMM equals `w4a8.reference_gemm` (the same blockwise arithmetic: exact integer dots, fp32 fused multiply-adds in k
order) bit for bit, so the variants equal each other; and it stays within the int8 rounding of activations of the dequantize-then-matmul W4A16 result. Rows are
batch- and thread-invariant bit for bit, which is what lets speculative decoding stay exact on it. A variant's tests
skip, with the reason, where it does not build (its CPU extension missing, no g++, SPECQUANT_NATIVE=off).
"""

import pytest
import torch
from conftest import kernel_variants, native_switch, need_kernel

from _quant_models import HAS_TINY_TARGET
from specquant.spec_decode.engine import generate
from specquant.errors import SpecquantError
from specquant.loader import load_model
from specquant.model.checkpoint import load_tokenizer
from specquant.model.fuse import fuse_projections
from specquant.quant import quantize
from specquant.kernels import w4_bf16, w4a8
from specquant.quant.config import QuantConfig
from specquant.quant.grid import dequantize, quantize_weight
from specquant.quant.linear import QuantLinear, auto_backend, set_w4_activations
from specquant.spec_decode.config import SpecConfig
from specquant.spec_decode.engine import SpecEngine

KERNEL_TOL = 1e-6  # QuantLinear (bias added in another order) vs reference_gemm + bias
FAMILY = w4a8.FAMILY
VARIANTS = kernel_variants(FAMILY)


def weights(out, inp, group, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * inp**-0.5
    codes, scale, _ = quantize_weight(w, QuantConfig(method="rtn", bits=4, group_size=group),
                                      scale_dtype=torch.float32)
    return codes, scale, g


def test_pack_layout_puts_each_code_where_the_kernel_reads_it():
    codes, _, _ = weights(32, 64, 32)
    packed = w4a8.pack_codes(codes)
    assert packed.shape == (2, 8, 64)
    u = codes.to(torch.int16) + 8
    for tile, k8, j, t in [(0, 0, 0, 0), (1, 7, 15, 3), (0, 3, 9, 2)]:
        byte = int(packed[tile, k8, 4 * j + t])
        o, k = 16 * tile + j, 8 * k8 + t  # low nibble: k, high nibble: k + 4
        assert byte & 15 == u[o, k] and byte >> 4 == u[o, k + 4]
    assert torch.equal(w4a8.unpack_codes(packed), codes)


def test_activation_quantization_rounds_half_to_even_and_keeps_zero_blocks():
    x = torch.zeros(1, 64)
    x[0, :32] = torch.tensor([127.0, 0.5, 1.5, -2.5, -127.0] + [0.0] * 27)  # d = 1: ties go to the even integer
    q, d = w4a8.quantize_activations(x)
    assert d.tolist() == [[1.0, 0.0]] and q[0, :5].tolist() == [127, 0, 2, -2, -127]
    assert not q[0, 32:].any()  # an all-zero block: d = 0, q = 0, no division by zero


@pytest.mark.parametrize("variant", VARIANTS)
def test_kernel_quantizes_activations_exactly_like_the_reference(variant):
    need_kernel(FAMILY, variant)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 256, generator=g) * torch.logspace(-3, 3, 256)  # blocks of very different ranges
    x[2, 64:96] = 0.0
    q, d = w4a8.quantize_activations(x)
    kq, kd, ksum = w4a8.kernel_quantize(x, variant)
    assert torch.equal(q, kq) and torch.equal(d, kd)
    assert torch.equal(ksum, q.reshape(5, -1, 32).int().sum(-1))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("out,inp,group", [(16, 64, 32), (128, 384, 32), (1024, 384, 128), (48, 1024, 64),
                                           (64, 256, 256), (32, 96, 96)])
def test_kernel_matches_reference(out, inp, group, variant):
    need_kernel(FAMILY, variant)
    codes, scale, g = weights(out, inp, group)
    packed, scales = w4a8.pack_codes(codes), w4a8.pack_scales(scale)
    w16 = dequantize(codes, scale, None)
    for rows in (1, 2, 3, 7, 8, 9, 16, 20):
        x = torch.randn(rows, inp, generator=g) * 3
        got = w4a8.gemm(x, packed, scales, group, variant)
        ref = w4a8.reference_gemm(x, codes, scale)
        assert torch.equal(got, ref), f"{out}x{inp} g{group} rows={rows}: not reference_gemm's bits"
        # against W4A16: each activation moves by at most d/2 = max|x_block| / 254
        w16_err = (got - x @ w16.t()).abs()
        bound = (x.reshape(rows, -1, 32).abs().amax(-1) / 254).repeat_interleave(32, 1) @ w16.abs().t()
        assert (w16_err <= bound * 1.001 + 1e-6).all()


@pytest.mark.parametrize("variant", VARIANTS)
def test_rows_are_batch_and_thread_invariant(variant):
    """Each output sums in one order whatever M or the thread count: a verify step's row i equals the one-row
    decode step bit for bit, the property that keeps speculative decoding exact on this kernel."""
    need_kernel(FAMILY, variant)
    codes, scale, g = weights(256, 512, 32)
    packed, scales = w4a8.pack_codes(codes), w4a8.pack_scales(scale)
    x = torch.randn(13, 512, generator=g)
    batch = w4a8.gemm(x, packed, scales, 32, variant)
    for i in range(13):
        assert torch.equal(w4a8.gemm(x[i : i + 1], packed, scales, 32, variant), batch[i : i + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        assert torch.equal(w4a8.gemm(x, packed, scales, 32, variant), batch)
    finally:
        torch.set_num_threads(threads)


def test_quant_linear_runs_int8_activations_only_when_asked_and_at_every_row_count():
    need_kernel(FAMILY)
    codes, scale, g = weights(64, 256, 32)
    m = QuantLinear.from_codes(codes, scale, None, 4, torch.randn(64, generator=g))
    x = torch.randn(2, 3, 256, generator=g)
    assert auto_backend(m, x) != "native_w4a8"  # float activations by default
    model = torch.nn.Sequential(m)
    assert set_w4_activations(model, "int8") == 1
    assert auto_backend(m, x) == "native_w4a8" and auto_backend(m, torch.randn(300, 256)) == "native_w4a8"
    y = m(x)
    ref = w4a8.reference_gemm(x.reshape(6, 256), codes, scale).reshape(2, 3, 64) + m.bias
    assert (y - ref).abs().max() <= KERNEL_TOL * ref.abs().max()
    assert m.native_layout == "w4a8" and torch.equal(m.codes(), codes)
    set_w4_activations(model, "float")  # back: the layout follows the kernel, the codes never change
    m(x)
    assert m.native_layout in (None, "w4_bf16") and torch.equal(m.codes(), codes)
    assert torch.equal(m.state_dict()["weight_packed"], QuantLinear.from_codes(codes, scale, None, 4).weight_packed)


def test_fused_projections_keep_int8_activations():
    need_kernel(FAMILY)
    codes, scale, _ = weights(32, 64, 32)
    parts = [QuantLinear.from_codes(codes, scale, None, 4) for _ in range(2)]
    set_w4_activations(torch.nn.ModuleList(parts), "int8")
    assert QuantLinear.concat(parts).activations == "int8"


def test_unknown_mode_and_unavailable_kernel_are_one_line_errors(monkeypatch):
    with pytest.raises(SpecquantError, match="use one of auto, float, int8"):
        set_w4_activations(torch.nn.Sequential(), "int4")
    with native_switch(monkeypatch, "0"):
        with pytest.raises(SpecquantError, match=r"unavailable here \(disabled by SPECQUANT_NATIVE=0\); use float "
                                                 r"activations"):
            set_w4_activations(torch.nn.Sequential(), "int8")


def test_unsupported_layers_are_declined():
    assert not w4a8.supports(8, 32, True, 256, 64)  # 8 bits
    assert not w4a8.supports(4, 32, False, 256, 64)  # zero points
    assert not w4a8.supports(4, 32, True, 256, 40)  # out not a multiple of 16
    assert not w4a8.supports(4, 16, True, 256, 64)  # groups finer than the activation block
    assert w4a8.supports(4, 128, True, 256, 64)


@pytest.mark.skipif(not HAS_TINY_TARGET, reason="bundled tiny-target missing")
def test_speculative_decoding_on_a_w4a8_target_equals_its_greedy_decoding():
    """Decode steps (1 row), verify steps (k+1 rows) and the prefill all run the W4A8 kernel, whose rows are
    batch-invariant, so the speculative output is exactly the W4A8 target's own greedy output."""
    need_kernel(FAMILY)
    target = load_model("tiny-target")
    quantize(target, QuantConfig(method="rtn", bits=4, group_size=32))
    assert set_w4_activations(target, "int8") == 8 * 7  # q, k, v, o, gate, up, down per layer; the head dense
    fuse_projections(target)
    engine = SpecEngine(target, load_model("tiny-draft", fuse=True), SpecConfig(draft_len=4))
    prompt = torch.tensor([load_tokenizer("tiny-target").encode("The meaning of the word")])
    ref = generate(target, prompt, 48, stop_on_eos=False).token_ids[0]
    out = engine.generate(prompt, 48, stop_on_eos=False)
    assert out.token_ids[0] == ref
    assert out.stats["num_accepted_tokens"] > 0


@pytest.mark.parametrize("activations", ["float", "int8"])
def test_torch_compile_keeps_the_native_kernels_in_one_graph(activations):
    """Under torch.compile the kernels run as torch operators (specquant::w4_bf16_gemm / w4a8_gemm): fullgraph
    compiles (a ctypes call would break the graph) and gives the eager result bit for bit."""
    need_kernel(FAMILY if activations == "int8" else w4_bf16.FAMILY)
    codes, scale, g = weights(64, 256, 32)
    m = QuantLinear.from_codes(codes, scale, None, 4, torch.randn(64, generator=g))
    set_w4_activations(torch.nn.Sequential(m), activations)
    x = torch.randn(3, 256, generator=g)
    eager = m(x)
    assert torch.equal(torch.compile(m, fullgraph=True)(x), eager)


def test_checkpoints_load_with_int8_activations_for_generate_and_the_gates(tmp_path):
    """load_model(w4_activations="int8") (generate/bench/gate --w4-activations int8) reaches every 4-bit layer,
    fused ones included, and the lm-eval backend passes it through its model_args."""
    need_kernel(FAMILY)
    from _qad_models import write_pair
    from specquant.gate.backend import SpecquantLM

    _, student = write_pair(tmp_path)
    model = load_model(student, fuse=True, w4_activations="int8")
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert layers and all(m.activations == "int8" for m in layers)
    assert all(m.activations == "float" for m in load_model(student).modules() if isinstance(m, QuantLinear))
    lm = SpecquantLM(target=str(student), w4_activations="int8", device="cpu")
    assert all(m.activations == "int8" for m in lm.engine.target.modules() if isinstance(m, QuantLinear))
    # the engines' default (RuntimeConfig's auto) is the same W4A8 arithmetic where the kernel runs
    from specquant.spec_decode.build import build_engine

    served = build_engine(student, "none").target
    assert all(m.activations == "int8" for m in served.modules() if isinstance(m, QuantLinear))


def test_targets_and_drafters_default_to_int8_where_the_kernel_runs(native_kernels):
    """"auto" (the default of targets and drafters in generate, bench, serve and the gates) is int8 on a CPU with
    the kernel and float without it or on another device; float and int8 stay as asked."""
    from specquant.bench.config import BenchConfig
    from specquant.quant.linear import resolve_w4_activations

    runtime = BenchConfig().runtime
    assert runtime.w4_activations == runtime.draft_w4_activations == "auto"
    assert resolve_w4_activations("auto") == ("int8" if FAMILY.library() is not None else "float")
    assert resolve_w4_activations("auto", "meta") == resolve_w4_activations("auto", torch.device("cuda")) == "float"
    assert resolve_w4_activations("float") == "float" and resolve_w4_activations("int8", "cuda") == "int8"
    assert set_w4_activations(torch.nn.Sequential(), "auto") == 0  # no layers; without the kernel, no error


@pytest.mark.parametrize("kernel", ["w4a8", "w4_bf16"])
def test_bf16_scales_stream_as_bf16_and_give_the_fp32_result_bit_for_bit(kernel):
    """Checkpoint scales in bf16 stay bf16 in the kernels' layout (half the scale bytes a step streams); both
    kernels widen them exactly, so the result equals the one from the same scales stored as fp32."""
    mod = {"w4a8": w4a8, "w4_bf16": w4_bf16}[kernel]
    need_kernel(mod.FAMILY)
    codes, scale, g = weights(64, 256, 32)
    scale = scale.to(torch.bfloat16)
    as_bf16 = w4a8.pack_scales(scale.float())  # bf16 values widened to fp32 (a bf16 checkpoint in an fp32 model)
    assert as_bf16.dtype == torch.bfloat16 and torch.equal(w4a8.pack_scales(scale), as_bf16)
    as_fp32 = as_bf16.float()
    fp32_scale = scale.float() * (1 + 2**-12)  # values bf16 cannot hold: stay fp32
    assert w4a8.pack_scales(fp32_scale).dtype == torch.float32
    packed = mod.pack_codes(codes)
    x = torch.randn(5, 256, generator=g)
    assert torch.equal(mod.gemm(x, packed, as_bf16, 32), mod.gemm(x, packed, as_fp32, 32))


def test_torch_export_sees_the_kernel_inputs_as_named_buffers():
    """What an AOTInductor package binds by name: the exported graph reads the codes (weight_packed, in the
    kernel's layout) and the packed scales (the non-persistent buffer native_scales), and no lifted constant that a
    package could not bind to the model's own tensors. (Packaging itself was checked by hand: bit-identical.)"""
    need_kernel(FAMILY)
    codes, scale, g = weights(64, 256, 32)
    m = QuantLinear.from_codes(codes, scale.to(torch.bfloat16), None, 4)
    set_w4_activations(torch.nn.Sequential(m), "int8")
    x = torch.randn(3, 256, generator=g)
    eager = m(x)
    ep = torch.export.export(m, (x,))
    assert not ep.graph_signature.lifted_tensor_constants
    assert {"weight_packed", "native_scales"} <= set(ep.graph_signature.inputs_to_buffers.values())
    assert "native_scales" not in m.state_dict()  # never saved
    assert torch.equal(ep.module()(x), eager)


def test_fma32_rounds_once_where_float64_then_fp32_would_round_twice():
    """reference_gemm's fp32 fused multiply-add: a·b + c whose float64 sum lands exactly halfway between two fp32
    values although the exact sum does not (31903 · 8616052 = 2^38 + 12, scaled to 2^-24 + 12·2^-62)."""
    a = torch.tensor([31903.0, -31903.0], dtype=torch.float64)
    b = torch.tensor([8616052 * 2.0**-62] * 2, dtype=torch.float64)
    c = torch.tensor([1.0, 1.0 + 2.0**-22], dtype=torch.float32)
    want = torch.tensor([1.0 + 2.0**-23, 1.0 + 2.0**-23], dtype=torch.float32)  # the exact sums, rounded once
    assert not torch.equal((a * b + c.double()).float(), want)  # float64 first, then fp32: both wrong
    assert torch.equal(w4a8.fma32(a, b, c), want)


def test_every_variant_gives_the_same_bits():
    """The w4a8 variants this CPU runs (AVX-512 VNNI, AVX-VNNI, AVX2, portable C) agree bit for bit, on fp32 and bf16 scales."""
    loaded = [v for v in FAMILY.variants if FAMILY.load(v)[0] is not None]
    if len(loaded) < 2:
        pytest.skip(f"fewer than two w4a8 variants load here ({FAMILY.why()})")
    codes, scale, g = weights(80, 512, 64)
    packed = w4a8.pack_codes(codes)
    for scales in (w4a8.pack_scales(scale), w4a8.pack_scales(scale.to(torch.bfloat16))):
        x = torch.randn(11, 512, generator=g)
        first = w4a8.gemm(x, packed, scales, 64, loaded[0])
        for v in loaded[1:]:
            assert torch.equal(w4a8.gemm(x, packed, scales, 64, v), first), v.name
