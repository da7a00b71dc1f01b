"""The w4a8 family, W4A8 on CPU: symmetric int4 weights against int8-quantized activations (GGUF's Q4_0 x Q8_0),
for decode and verify steps. QuantLinear's `native_w4a8` backend; its variants are listed in VARIANTS (the layout
and numerics comment is in w4a8_avx512_vnni.cpp), built and loaded by kernels/build.py.

What it computes (the kernel's numerics comment has the detail): each activation row is cut into blocks of 32 and
rounded to int8 with one fp32 scale per block (`quantize_activations`), the weight codes stay exact, the dot of
every block is exact integer arithmetic, and the blocks are scaled and summed in fp32 in k order. So it is *not*
W4A16: activations lose precision (at most half a step of max|x|/127 per element, against bf16's relative 2^-9),
which is why QuantLinear runs it only for layers set to int8 activations (linear.set_w4_activations: the engines'
default `auto` sets them where this kernel runs, `--w4-activations float` keeps W4A16); the kl gate and
benchmarks/w4a8.py measure the cost in KL and top-1 agreement against the W4A16 model, benchmarks/shapes.py the
speed it buys (docs/BENCH.md).

`reference_gemm` is the plain torch version of the same arithmetic, bit for bit (blockwise integer dots, fp32
fused multiply-adds in k order), which tests/test_native_w4a8.py compares every variant with; `quantize_activations` must match the kernel's
quantization bit for bit.
"""

from __future__ import annotations

import ctypes

import torch

from specquant.kernels.build import AVX2_CPU, AVX2_FLAGS, AVX512_CPU, AVX512_FLAGS, Variant
from specquant.kernels.family import GEMM_ARGS, TILE, Family, Layout, pack_scales, run_gemm

BLOCK = 32  # activations: one scale per 32 inputs (Q8_0's block)
VARIANTS = (  # best first
    Variant("avx512_vnni", "w4a8_avx512_vnni.cpp", (*AVX512_FLAGS, "-mavx512vnni"), (*AVX512_CPU, "avx512_vnni")),
    Variant("avx_vnni", "w4a8_avx_vnni.cpp", (*AVX2_FLAGS, "-mavxvnni"), (*AVX2_CPU, "avx_vnni")),
    Variant("avx2", "w4a8_avx2.cpp", AVX2_FLAGS, AVX2_CPU),
    Variant("portable", "w4a8_portable.cpp", (), ()),  # any CPU g++ targets (NEON: not yet)
)
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
FUNCTIONS = {"specquant_w4a8_gemm": GEMM_ARGS, "specquant_q8_quantize": [_PTR, _I64, _I64, _PTR, _PTR, _PTR]}


def supports(bits: int, group_size: int, symmetric: bool, in_features: int, out_features: int) -> bool:
    return (bits == 4 and symmetric and out_features % TILE == 0 and group_size % BLOCK == 0
            and in_features % group_size == 0)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """codes int8 [N, K] in [-8, 7] -> uint8 [N/16, K/8, 64]: byte 4j + t of a (tile, k8) chunk holds
    u[o_j, 8·k8 + t] | u[o_j, 8·k8 + 4 + t] << 4 with u = c + 8 (the layout comment in w4a8_avx512_vnni.cpp)."""
    n, k = codes.shape
    u = (codes.to(torch.int16) + 8).to(torch.uint8).view(n // TILE, TILE, k // 8, 2, 4)  # [tile, j, k8, half, t]
    b = u[..., 0, :] | (u[..., 1, :] << 4)  # [tile, j, k8, t]
    return b.permute(0, 2, 1, 3).reshape(n // TILE, k // 8, 64).contiguous()


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_codes: uint8 [N/16, K/8, 64] -> codes int8 [N, K]."""
    tiles, k8 = packed.shape[0], packed.shape[1]
    b = packed.reshape(tiles, k8, TILE, 4).permute(0, 2, 1, 3)  # [tile, j, k8, t]
    u = torch.stack([b & 15, b >> 4], dim=3)  # [tile, j, k8, half, t]
    return (u.to(torch.int16) - 8).to(torch.int8).reshape(tiles * TILE, k8 * 8)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x fp32 [M, K] -> (q int8 [M, K], d fp32 [M, K/32]) with x ≈ d·q per block of 32: d = max|x| / 127,
    q = round-half-even(x · (1/d)) (0 where d = 0). The kernel's arithmetic, written in torch."""
    m, k = x.shape
    xb = x.float().reshape(m, k // BLOCK, BLOCK)
    d = xb.abs().amax(-1) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xb * inv.unsqueeze(-1)).to(torch.int8)
    return q.reshape(m, k), d


def reference_gemm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The kernel's result, computed plainly and bit for bit: x [M, K], codes int8 [N, K], scale [N, K/group] ->
    fp32 [M, N]. Per (row, output, block of 32) the integer dot (exact in float64), times (weight scale · activation
    scale) rounded to fp32, accumulated over the blocks in k order by one fp32 fused multiply-add each (fma32)."""
    q, d = quantize_activations(x)
    m, k = q.shape
    n, blocks = codes.shape[0], k // BLOCK
    dots = torch.einsum("mbk,nbk->mnb", q.double().reshape(m, blocks, BLOCK),
                        codes.double().reshape(n, blocks, BLOCK))
    sw = scale.float().repeat_interleave(k // scale.shape[1] // BLOCK, dim=1)  # [N, blocks]
    factor = sw.unsqueeze(0) * d.unsqueeze(1)  # [M, N, blocks]: the fp32 products the kernel forms
    acc = torch.zeros(m, n, dtype=torch.float32)
    for b in range(blocks):
        acc = fma32(dots[..., b], factor[..., b].double(), acc)
    return acc


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 fused multiply-add, round(a·b + c) once to fp32, for float64 a, b whose product is exact in float64 (here
    an integer below 2^15 times an fp32 value) and fp32 c. torch has no fp32 fma, so: the float64 sum s plus its exact
    error e (TwoSum), rounded to fp32; a double rounding can go wrong only where s falls exactly halfway between two
    fp32 values while e != 0, and there e says which way the exact sum lies."""
    p, c64 = a * b, c.double()
    s = p + c64
    bp = s - c64  # TwoSum: e = (p - bp) + (c - (s - bp)) exactly
    e = (p - bp) + (c64 - (s - bp))
    r = s.float()
    other = torch.nextafter(r, torch.where(s > r.double(), torch.full_like(r, float("inf")),
                                           torch.full_like(r, float("-inf"))))
    halfway = (s != r.double()) & ((r.double() + other.double()) / 2 == s) & (e != 0)
    toward_other = torch.sign(e) == torch.sign(other.double() - s)
    return torch.where(halfway & toward_other, other, r)


def gemm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group: int,
         variant: Variant | None = None) -> torch.Tensor:
    """x [..., K] (any float dtype; used as fp32) -> fp32 [..., N] with the packed weight and pack_scales' scales
    (leading dims passed through, as family.run_gemm), on the chosen variant (or the one named)."""
    xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
    return run_gemm(FAMILY.lib_for(variant).specquant_w4a8_gemm, xf, packed, scales, group)


@torch.library.custom_op("specquant::w4a8_gemm", mutates_args=())
def gemm_op(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """`gemm` as a torch operator for torch.compile (as w4_bf16.gemm_op)."""
    return gemm(x, packed, scales, group)


@gemm_op.register_fake
def _(x, packed, scales, group):
    return x.new_empty(*x.shape[:-1], packed.shape[0] * TILE, dtype=torch.float32)


def kernel_quantize(x: torch.Tensor, variant: Variant | None = None) -> tuple[torch.Tensor, torch.Tensor,
                                                                              torch.Tensor]:
    """A variant's own activation quantization (q, d, integer block sums), for the tests."""
    xf = x.float().contiguous()
    m, k = xf.shape
    q = torch.empty(m, k, dtype=torch.int8)
    d = torch.empty(m, k // BLOCK, dtype=torch.float32)
    qsum = torch.empty(m, k // BLOCK, dtype=torch.int32)
    if FAMILY.lib_for(variant).specquant_q8_quantize(xf.data_ptr(), m, k, q.data_ptr(), d.data_ptr(),
                                                     qsum.data_ptr()):
        raise ValueError(f"native W4A8 quantization rejected K={k} (needs a multiple of {BLOCK})")
    return q, d, qsum


FAMILY = Family("w4a8", VARIANTS, FUNCTIONS, Layout(pack_codes, unpack_codes, pack_scales), supports, gemm, gemm_op)
