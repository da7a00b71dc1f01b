"""Triton W4A16 (and W8A16) GEMM for few-row inputs, read straight from the compressed-tensors pack-quantized buffers.

    y[M, N] = x[M, K] @ dequant(W)ᵀ (+ bias),  dequant(W)[n, k] = (code[n, k] - zero[n, k // G]) · scale[n, k // G]

Inputs are QuantLinear's buffers as they are (see quant/pack.py for the bit layout): no repacking, so the checkpoint,
the reference path and this kernel share one copy of the weight.
  weight_packed     int32 [N, K·bits/32]   word n, j holds codes k = j·per .. j·per+per-1, low bits first, +2^(bits-1)
  weight_scale      [N, K/G] (bf16/fp16/fp32)
  weight_zero_point int32 [ceil(N·bits/32), K/G]   asymmetric only; packed along N the same way

Why our own kernel rather than a library's: Marlin / Machete / torchao's int4 kernels need the weight repacked
into their own tile layouts (a second copy, or a checkpoint that vLLM and transformers no longer read as
compressed-tensors), and the CPU tinygemm kernel linear.py uses does not run on CUDA. This one reads the checkpoint
layout directly, for the 1..16-row decode and verify shapes (any M works; M is tiled by 16).

One program computes a [16, BLOCK_N] output tile over one slice of K (split-K fills the GPU when N alone gives too
few programs, as in a 2560-wide down projection). Each BLOCK_K step stays inside one quantization group
(BLOCK_K divides G), so a step needs one scale (and zero) per output column. The weight tile is dequantized in
fp32 and rounded once to the scale dtype, then to x's dtype — the same numbers as `QuantLinear.dequantized_weight()`
— so kernel and reference differ only in the matmul's summation order. The products accumulate in fp32.

Under TRITON_INTERPRET=1 (CPU tests) tl.dot on bfloat16 multiplies raw bit patterns (triton-lang/triton#11584,
"not supported yet"), so there the dot runs on fp32 copies of the tiles; everything else is the code the GPU runs.
(The interpreter also truncates fp32 -> bf16 casts where the GPU rounds to nearest: interpreted bf16 results can
differ from the reference by one bf16 ulp per weight; fp16 is exact there.)
fp32 activations also take the fp32 dot, with input_precision="ieee" (no TF32 rounding).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # rows per tile: the smallest M tl.dot takes; decode (1 row) and verify (k+1 <= 16) fit in one
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _w4a16_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, M, N, K, groups, k_tiles_per_split,
                  stride_xm, stride_om, stride_os,
                  BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, USE_DOT: tl.constexpr):
    PER: tl.constexpr = 32 // BITS  # codes per int32 word
    MASK: tl.constexpr = (1 << BITS) - 1
    OFFSET: tl.constexpr = 1 << (BITS - 1)  # stored value = code + OFFSET (offset binary)
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    words = K // PER
    shift = (offs_k % PER) * BITS  # [BLOCK_K]: where code k sits in its word
    if HAS_ZERO:
        z_shift = (offs_n % PER) * BITS  # zero points are packed along N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_tiles = K // BLOCK_K
    first = pid_k * k_tiles_per_split
    last = tl.minimum(first + k_tiles_per_split, k_tiles)
    for kt in range(first, last):
        k0 = kt * BLOCK_K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :], mask=m_ok[:, None], other=0.0)
        # [BLOCK_K, BLOCK_N] codes: each word is read PER times (once per code it holds); the repeats hit L1
        packed = tl.load(w_ptr + offs_n[None, :] * words + ((k0 + offs_k) // PER)[:, None], mask=n_ok[None, :],
                         other=0)
        q = ((packed >> shift[:, None]) & MASK) - OFFSET
        g = k0 // GROUP  # BLOCK_K divides GROUP: one group per step
        scale = tl.load(s_ptr + offs_n * groups + g, mask=n_ok, other=0.0)
        if HAS_ZERO:
            zw = tl.load(z_ptr + (offs_n // PER) * groups + g, mask=n_ok, other=0)
            q = q - (((zw >> z_shift) & MASK) - OFFSET)[None, :]
        # (code - zero)·scale is exact in fp32; one rounding to the scale dtype = QuantLinear.dequantized_weight()
        w = (q.to(tl.float32) * scale.to(tl.float32)[None, :]).to(scale.dtype)
        if not USE_DOT:  # GEMV (BLOCK_M = 1): multiply-add on CUDA cores, no 16-row padding
            acc += tl.sum(x.to(tl.float32)[:, :, None] * w.to(x.dtype).to(tl.float32)[None, :, :], axis=1)
        elif DOT_F32:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    out = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def block_k(group_size: int) -> int | None:
    """The K step: the largest of 128/64/32/16 dividing the group (a step must not straddle two groups)."""
    for b in (128, 64, 32, 16):
        if group_size % b == 0:
            return b
    return None


def supports(m, x: torch.Tensor) -> bool:
    """Shapes and dtypes this kernel takes (the device is the caller's business: CUDA, or the interpreter)."""
    return (m.bits in (4, 8) and x.dtype in DTYPES and block_k(m.group_size) is not None
            and m.in_features % m.group_size == 0 and m.weight_scale.dtype in DTYPES)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: a small "GPU", so tests cover split-K
    return torch.cuda.get_device_properties(device).multi_processor_count


def interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)
    return bool(knobs.runtime.interpret) if knobs is not None else False


# Rows up to which the plain multiply-add (gemv) variant, at block_n 128, is the default: under graph replay on an H100
# it beat every tl.dot tile choice at 1-8 rows on each Qwen3-4B layer shape, and lost at 16 (docs/BENCH.md, GPU).
GEMV_MAX_ROWS = 8


def split_k_for(n_tiles: int, k_tiles: int, sms: int) -> int:
    """Split K until ~2 programs per SM (weight streaming needs many loads in flight), never below one tile each."""
    want = -(-2 * sms // n_tiles)
    return max(1, min(want, k_tiles))


def w4a16_matmul(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                 weight_zero_point: torch.Tensor | None, bits: int, group_size: int, bias: torch.Tensor | None = None,
                 block_n: int | None = None, split_k: int | None = None, num_warps: int = 4,
                 gemv: bool | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype. split_k None: chosen from the SM count (see split_k_for).

    gemv: one row per program and no tl.dot (a plain multiply-add reduction); None: on for at most GEMV_MAX_ROWS
    rows, where benchmarks/gpu.py measured it faster than the tl.dot tile (docs/GPU.md)."""
    n, k = weight_scale.shape[0], x.shape[-1]
    groups = weight_scale.shape[1]
    bk = block_k(group_size)
    assert bk is not None and k == groups * group_size and weight_packed.shape == (n, k * bits // 32)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if gemv is None:
        gemv = m <= GEMV_MAX_ROWS
    if block_n is None:
        block_n = 128 if gemv else 64
    n_tiles, k_tiles = triton.cdiv(n, block_n), k // bk
    splits = split_k if split_k is not None else split_k_for(n_tiles, k_tiles, _sm_count(x.device))
    per_split = triton.cdiv(k_tiles, splits)
    splits = triton.cdiv(k_tiles, per_split)  # no empty split
    if splits == 1:
        out = torch.empty(1, m, n, dtype=x.dtype, device=x.device)
    else:  # fp32 partial sums, reduced below (one extra small kernel; captured in the CUDA graph with the rest)
        out = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    zp = weight_zero_point if weight_zero_point is not None else weight_packed  # dummy pointer when symmetric
    block_m = 1 if gemv else BLOCK_M
    grid = (n_tiles, splits, triton.cdiv(m, block_m))
    _w4a16_kernel[grid](
        x2, weight_packed, weight_scale, zp, out, m, n, k, groups, per_split,
        x2.stride(0), out.stride(1), out.stride(0),
        BITS=bits, GROUP=group_size, HAS_ZERO=weight_zero_point is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=bk, DOT_F32=x.dtype == torch.float32 or interpreting(), USE_DOT=not gemv, num_warps=num_warps,
    )
    y = out[0] if splits == 1 else out.sum(0)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


# A torch custom op, so torch.compile treats the kernel as one opaque call (its fake shape below) and CUDA-graph
# capture sees a plain launch; registered when this module is first imported (quant/linear.py imports it lazily).
@torch.library.custom_op("specquant::w4a16_matmul", mutates_args=())
def w4a16_op(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
             weight_zero_point: torch.Tensor | None, bits: int, group_size: int) -> torch.Tensor:
    return w4a16_matmul(x, weight_packed, weight_scale, weight_zero_point, bits, group_size)


@w4a16_op.register_fake
def _(x, weight_packed, weight_scale, weight_zero_point, bits, group_size):
    return x.new_empty(*x.shape[:-1], weight_scale.shape[0])


def forward(m, x: torch.Tensor) -> torch.Tensor:
    """The QuantLinear backend: m's own buffers, no cache."""
    y = w4a16_op(x, m.weight_packed, m.weight_scale, m.weight_zero_point, m.bits, m.group_size)
    return y if m.bias is None else y + m.bias.to(y.dtype)
