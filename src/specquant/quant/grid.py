"""Group-wise integer grid: scales, zero points, codes, dequantization. Shared by RTN, AWQ, GPTQ and QAD.

Convention (compressed-tensors'): codes are signed, `qmin = -2^(b-1)`, `qmax = 2^(b-1) - 1` ([-8, 7] at 4 bits).
  symmetric:  scale = absmax / qmax (absmax/7 at 4 bits, as the reference system), code = clamp(round(w/scale)),
              no zero point. (compressed-tensors' own observer uses absmax/7.5; the stored format is identical.)
  asymmetric: scale = (max - min) / (qmax - qmin) with min <= 0 <= max, zero = clamp(round(qmin - min/scale)),
              code = clamp(round(w/scale) + zero). The zero point is a signed integer in the code range; the
              packed bits equal "unsigned [0, 15] codes with zero + 8", the other common way to write it.
  dequant:    w = (code - zero) * scale, evaluated in the scale's dtype exactly as compressed-tensors does, so our
              dense weights and the library's decompression agree bit for bit.
Scales are rounded to the storage dtype *before* codes are computed, so the codes are optimal for the stored scale.
Shapes: weight [out, in]; scale / zero [out, in // group_size]; one group = `group_size` consecutive inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def qrange(bits: int) -> tuple[int, int]:
    return -(1 << (bits - 1)), (1 << (bits - 1)) - 1


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    out, inp = w.shape
    assert inp % group_size == 0, f"group_size {group_size} does not divide in_features {inp}"
    return w.reshape(out, inp // group_size, group_size)


def compute_qparams(w: torch.Tensor, bits: int, group_size: int, symmetric: bool, scale_dtype: torch.dtype,
                    shrink: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Min/max scales (and zero points) per group. shrink [out, groups] scales the range down (AWQ clipping).

    Returns scale [out, groups] in scale_dtype and zero [out, groups] int8 (None when symmetric).
    """
    qmin, qmax = qrange(bits)
    g = _grouped(w.float(), group_size)
    tiny = torch.finfo(scale_dtype).tiny
    if symmetric:
        absmax = g.abs().amax(-1)
        if shrink is not None:
            absmax = absmax * shrink
        scale = (absmax / qmax).clamp_min(tiny).to(scale_dtype)
        return scale, None
    mn = g.amin(-1).clamp_max(0)
    mx = g.amax(-1).clamp_min(0)
    if shrink is not None:
        mn, mx = mn * shrink, mx * shrink
    scale = ((mx - mn) / (qmax - qmin)).clamp_min(tiny).to(scale_dtype)
    zero = torch.round(qmin - mn / scale.float()).clamp(qmin, qmax).to(torch.int8)
    return scale, zero


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int) -> torch.Tensor:
    """Codes int8 [out, in] for weight [out, in] given scale/zero [out, groups] (groups may be 1 column each)."""
    qmin, qmax = qrange(bits)
    groups = scale.shape[-1]
    g = _grouped(w.float(), w.shape[-1] // groups)
    q = g / scale.float().unsqueeze(-1)
    q.round_()  # in place: one temporary for the whole weight, not one per step
    if zero is not None:
        q += zero.float().unsqueeze(-1)
    return q.clamp_(qmin, qmax).to(torch.int8).reshape(w.shape)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """(codes - zero) * scale rounded once to scale.dtype; codes [out, in] int, scale/zero [out, groups] -> [out, in].

    Computed in fp32 and rounded at the end: codes - zero is a small integer and scale has at most 11 significant
    bits, so the fp32 product is exact and the result is bit-identical to doing the arithmetic in a 16-bit
    scale dtype (what compressed-tensors does), without this CPU's slow 16-bit elementwise ops.
    """
    groups = scale.shape[-1]
    g = _grouped(codes, codes.shape[-1] // groups).float()
    if zero is not None:
        g = g - zero.float().unsqueeze(-1)
    return (g * scale.float().unsqueeze(-1)).to(scale.dtype).reshape(codes.shape)


def quantize_weight(w: torch.Tensor, cfg, group_size: int | None = None, scale_dtype: torch.dtype | None = None,
                    shrink: torch.Tensor | None = None):
    """Round-to-nearest with min/max scales: weight [out, in] -> (codes int8 [out, in], scale, zero | None).

    cfg needs `bits`, `group_size` (-1 = per channel) and `symmetric` (a QuantConfig). scale_dtype defaults to w's.
    """
    gs = group_size or (w.shape[-1] if cfg.group_size == -1 else cfg.group_size)
    scale, zero = compute_qparams(w, cfg.bits, gs, cfg.symmetric, scale_dtype or w.dtype, shrink)
    return quantize_codes(w, scale, zero, cfg.bits), scale, zero


def fake_quant(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int,
               group_size: int) -> torch.Tensor:
    """Quantize then dequantize w [out, in] on a fixed grid; result in w's dtype. Pure (no state, no STE)."""
    assert scale.shape[-1] * group_size == w.shape[-1]
    return dequantize(quantize_codes(w, scale, zero, bits), scale, zero).to(w.dtype)


def rtn_fake_quant(w: torch.Tensor, bits: int, group_size: int, symmetric: bool,
                   shrink: torch.Tensor | None = None, scale_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Min/max round-to-nearest, returned dequantized in float32 (AWQ's search loss uses this)."""
    scale, zero = compute_qparams(w, bits, group_size, symmetric, scale_dtype or w.dtype, shrink)
    return dequantize(quantize_codes(w, scale, zero, bits), scale.float(), zero)


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """10·log10(‖reference‖² / ‖reference − approx‖²); inf when equal."""
    # fp32 norms (torch's reductions sum pairwise, ~1e-7 relative): a dB figure needs 3 digits, and converting
    # whole weight matrices to float64 made this the slowest part of quantizing a 0.6B model.
    ref = reference.float()
    noise = torch.linalg.vector_norm(ref - approx.float())
    if noise == 0:
        return float("inf")
    return float(20 * torch.log10(torch.linalg.vector_norm(ref) / noise))


@dataclass
class QuantizedWeight:
    """One Linear's result: codes int8 [out, in], scale [out, groups], zero int8 [out, groups] | None, and the
    float32 weight [out, in] the codes approximate (after any AWQ rescaling), for error reports."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    reference: torch.Tensor
