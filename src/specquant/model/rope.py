"""Rotary position embeddings with the scaling variants the Llama / Qwen families ship.

Each variant maps (base inverse frequencies, config) to (inverse frequencies, attention factor); the table is a
dict of functions so adding one is one entry. `dynamic` NTK is refused: its frequencies change with the running
sequence length, which a static, rollback-able KV cache cannot honour exactly.
"""

from __future__ import annotations

import math

import torch

from specquant.errors import SpecquantError


def _default(inv_freq, cfg, dim, base, max_pos):
    return inv_freq, 1.0


def _linear(inv_freq, cfg, dim, base, max_pos):
    return inv_freq / float(cfg["factor"]), 1.0


def _llama3(inv_freq, cfg, dim, base, max_pos):
    factor = float(cfg["factor"])
    low, high = float(cfg.get("low_freq_factor", 1.0)), float(cfg.get("high_freq_factor", 4.0))
    old_ctx = float(cfg.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled), 1.0


def _yarn(inv_freq, cfg, dim, base, max_pos):
    factor = float(cfg["factor"])
    orig = cfg.get("original_max_position_embeddings") or max_pos
    beta_fast, beta_slow = float(cfg.get("beta_fast") or 32), float(cfg.get("beta_slow") or 1)

    def mscale(scale, m=1.0):
        return 0.1 * m * math.log(scale) + 1.0 if scale > 1 else 1.0

    attn = cfg.get("attention_factor")
    if attn is None:
        ms, ms_all = cfg.get("mscale"), cfg.get("mscale_all_dim")
        attn = mscale(factor, ms) / mscale(factor, ms_all) if ms and ms_all else mscale(factor)

    def correction_dim(rotations):
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if cfg.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    inv = (inv_freq / factor) * (1 - extrapolation_weight) + inv_freq * extrapolation_weight
    return inv, float(attn)


ROPE_VARIANTS = {"default": _default, "linear": _linear, "llama3": _llama3, "yarn": _yarn}


def rope_tables(head_dim: int, base: float, scaling: dict | None, max_pos: int, length: int):
    """cos and signed-sin tables [length, head_dim] in float32 for positions 0..length-1.

    The sin table has its first half negated, for `apply_rope`'s roll form; only apply_rope should read it.
    """
    rope_type = "default" if not scaling else scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ROPE_VARIANTS:
        raise SpecquantError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(ROPE_VARIANTS)} "
            "(dynamic NTK changes frequencies with sequence length and cannot use a static cache)"
        )
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    inv_freq, attn_factor = ROPE_VARIANTS[rope_type](inv_freq, scaling or {}, head_dim, base, max_pos)
    freqs = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    sign = torch.cat((-torch.ones(head_dim // 2), torch.ones(head_dim // 2)))
    return emb.cos() * attn_factor, emb.sin() * sign * attn_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]; cos/sin: rope_tables' rows [seq, head_dim], already in x's dtype.

    transformers' x·cos + rotate_half(x)·sin with rotate_half(x) = cat(-x2, x1), written as
    x·cos + roll(x, half)·sin' where sin' = cat(-sin1, sin2) is the signed table: 4 ops instead of 7.
    """
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin
