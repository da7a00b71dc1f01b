"""The w4_bf16 family: symmetric int4 weights against float activations rounded to bf16, fp32 sums (W4A16's
arithmetic up to the bf16 rounding of activations, as the int4pack_cpu_bf16 backend). QuantLinear's
`native_w4_bf16` backend; the layout comment is in w4_bf16_avx512.cpp.
"""

from __future__ import annotations

import torch

from specquant.kernels.build import AVX2_CPU, AVX2_FLAGS, AVX512_CPU, AVX512_FLAGS, Variant
from specquant.kernels.family import GEMM_ARGS, TILE, Family, Layout, pack_scales, run_gemm

VARIANTS = (  # best first
    Variant("avx512_bf16", "w4_bf16_avx512.cpp", (*AVX512_FLAGS, "-mavx512bf16"), (*AVX512_CPU, "avx512_bf16")),
    Variant("avx2", "w4_bf16_avx2.cpp", AVX2_FLAGS, AVX2_CPU),
    Variant("portable", "w4_bf16_portable.cpp", (), ()),  # any CPU g++ targets (NEON: not yet)
)
FUNCTIONS = {"specquant_w4_bf16_gemm": GEMM_ARGS}


def supports(bits: int, group_size: int, symmetric: bool, in_features: int, out_features: int) -> bool:
    return (bits == 4 and symmetric and out_features % TILE == 0 and group_size % 8 == 0
            and in_features % group_size == 0)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """codes int8 [N, K] in [-8, 7] -> uint8 [N/16, K/8, 64] (w4_bf16_avx512.cpp's layout comment)."""
    n, k = codes.shape
    u = (codes.to(torch.int16) + 8).to(torch.uint8).view(n // TILE, 4, 4, k // 8, 8)  # [tile, L, i, k8, kk]
    lo, hi = u[..., :4], u[..., 4:]  # k0..k3 low nibbles, k4..k7 high nibbles
    b = lo | (hi << 4)  # [tile, L, i, k8, 4]: byte for (k0|k4), (k1|k5), (k2|k6), (k3|k7)
    # bytes of lane L: 2i, 2i+1 <- (k0|k4), (k1|k5); 8+2i, 8+2i+1 <- (k2|k6), (k3|k7)
    first, second = b[..., 0:2], b[..., 2:4]  # [tile, L, i, k8, 2]
    lane = torch.stack([first, second], dim=2)  # [tile, L, half, i, k8, 2]
    return lane.permute(0, 4, 1, 2, 3, 5).reshape(n // TILE, k // 8, 64).contiguous()


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_codes: uint8 [N/16, K/8, 64] -> codes int8 [N, K]."""
    tiles, k8 = packed.shape[0], packed.shape[1]
    lane = packed.reshape(tiles, k8, 4, 2, 4, 2).permute(0, 2, 4, 1, 3, 5)  # [tile, L, i, k8, half, 2]
    b = lane.reshape(tiles, 4, 4, k8, 4)  # [tile, L, i, k8, 4]: (k0|k4), (k1|k5), (k2|k6), (k3|k7)
    u = torch.cat([b & 15, b >> 4], dim=-1)  # [tile, L, i, k8, 8]: k0..k7
    return (u.to(torch.int16) - 8).to(torch.int8).reshape(tiles * TILE, k8 * 8)


def pack(codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes int8 [N, K], scale [N, K/group] -> (packed uint8 [N/16, K/8, 64], scales [N/16, groups, 16])."""
    return pack_codes(codes), pack_scales(scale)


def gemm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group: int,
         variant: Variant | None = None) -> torch.Tensor:
    """x [..., K] (any float dtype; rounded to bf16) -> fp32 [..., N] with the packed weight, on the chosen variant
    (or the one named)."""
    fn = FAMILY.lib_for(variant).specquant_w4_bf16_gemm
    return run_gemm(fn, x.to(torch.bfloat16).contiguous(), packed, scales, group)


@torch.library.custom_op("specquant::w4_bf16_gemm", mutates_args=())
def gemm_op(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """`gemm` as a torch operator, so torch.compile keeps it in the graph as one opaque call (a ctypes call is a
    graph break); QuantLinear uses it only while compiling, since the dispatcher costs a few us per call."""
    return gemm(x, packed, scales, group)


@gemm_op.register_fake
def _(x, packed, scales, group):
    return x.new_empty(*x.shape[:-1], packed.shape[0] * TILE, dtype=torch.float32)


FAMILY = Family("w4_bf16", VARIANTS, FUNCTIONS, Layout(pack_codes, unpack_codes, pack_scales), supports, gemm,
                gemm_op)
