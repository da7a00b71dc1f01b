"""compressed-tensors `pack-quantized` bit layout (what vLLM and transformers read).

Read from compressed_tensors 0.20 (`compressors/pack_quantized/helpers.py`), not copied:
  * a signed b-bit code c is stored as the unsigned value c + 2^(b-1) (offset binary, +8 at 4 bits);
  * 32/b values share one int32 along the packed dim; element i of a word sits at bits [b·i, b·i + b), i.e. the
    first element in the low nibble ("low nibble first");
  * weights are packed along the input dim: codes [out, in] -> weight_packed int32 [out, in·b/32];
  * asymmetric zero points are packed the same way but along dim 0: [out, groups] -> [ceil(out·b/32), groups]
    (a ragged tail is zero-padded);
  * 8-bit weight-only uses the same format (four codes per int32); the library reserves `int-quantized` for
    schemes that also quantize activations.
Only b in {4, 8} is needed here; both divide 32, so values never straddle words.
"""

from __future__ import annotations

import sys

import torch


def _shifts(bits: int, device) -> torch.Tensor:
    return torch.arange(0, 32, bits, dtype=torch.int32, device=device)


def pack_codes(codes: torch.Tensor, bits: int, dim: int = 1) -> torch.Tensor:
    """Signed int8 codes [rows, cols] -> int32, packing 32/bits values per word along `dim` (0 or 1)."""
    assert bits in (4, 8) and codes.dim() == 2
    if dim == 0:
        return pack_codes(codes.t(), bits, 1).t().contiguous()
    per = 32 // bits
    rows, cols = codes.shape
    lo, hi = (int(v) for v in codes.aminmax())
    assert -(1 << (bits - 1)) <= lo and hi < (1 << (bits - 1)), "codes outside the signed range for this bit width"
    pad = (-cols) % per
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad), value=-(1 << (bits - 1)))  # pads to unsigned 0
    # offset binary in one byte op: c + 2^(b-1) in int8 at 4 bits; at 8 bits c + 128 == c XOR 0x80 as a byte
    u = (codes.to(torch.int8) + 8).view(torch.uint8) if bits == 4 else codes.to(torch.int8).view(torch.uint8) ^ 0x80
    if bits == 4:  # two codes per byte, the first in the low nibble
        u = u[:, 0::2] | (u[:, 1::2] << 4)
    # Bytes in order, read as little-endian int32: byte 0 is the word's low byte (bits 0-7), so element i lands at
    # bits [b·i, b·i + b) as the format says. One byte-wise pass instead of 32/b int32 shifts and ORs (7x faster
    # on the 0.6B shape); tests/test_quant_grid.py compares both paths with compressed-tensors' pack_to_int32.
    if sys.byteorder != "little":
        return _pack_words(u, rows)
    return u.contiguous().view(-1).view(torch.int32).view(rows, -1)  # flat first: a [1, n] view may keep stride 1


def _pack_words(u: torch.Tensor, rows: int) -> torch.Tensor:
    """Big-endian hosts: assemble each int32 from its four bytes explicitly."""
    b = u.to(torch.int32).reshape(rows, -1, 4)
    return (b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)).contiguous()


def unpack_codes(packed: torch.Tensor, bits: int, size: int, dim: int = 1) -> torch.Tensor:
    """Inverse of pack_codes: int32 -> signed int8 codes with `size` elements along `dim`."""
    assert packed.dtype == torch.int32 and bits in (4, 8)
    if dim == 0:
        return unpack_codes(packed.t(), bits, size, 1).t().contiguous()
    mask = (1 << bits) - 1
    u = (packed.unsqueeze(-1) >> _shifts(bits, packed.device)) & mask  # arithmetic shift; the mask drops sign bits
    u = u.reshape(packed.shape[0], -1)[:, :size]
    return (u - (1 << (bits - 1))).to(torch.int8)


def packed_cols(n: int, bits: int) -> int:
    per = 32 // bits
    return (n + per - 1) // per
