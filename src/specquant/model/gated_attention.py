"""Gated full attention: Qwen3.5's attention layers (transformers' Qwen3_5Attention), on the decoder's KV cache.

What differs from the decoder's Attention, and how it is laid out in the checkpoint (`self_attn.{q_proj, k_proj,
v_proj, o_proj, q_norm, k_norm}`):
- q_proj is twice as wide: viewed as [heads, 2 * head_dim], each head's query is followed by its output gate
  (interleaved per head, not two halves of the output);
- q_norm / k_norm are zero-centred RMSNorms (1 + w, model/norms.py);
- RoPE rotates only the first rotary_dim = head_dim * partial_rotary_factor dims of each head, with
  rotate_half over those rotary_dim dims: model/rope.py's apply_rope on that slice, with rope_tables(rotary_dim)
  rows as cos / sin (ModelConfig.rotary_dim; the decoder builds its tables that wide);
- the attention output is multiplied by sigmoid(gate) before o_proj (kernels.ops.sigmoid_mul on fp32 CPU eager
  steps: one native call, and the one model/native_layer.py makes, so both paths agree bit for bit).
The rest (GQA, masks, the sliced / ring / static KV cache, folded few-query attention) is the decoder's Attention,
inherited: plan(), fold(), attend() and the KVCache are the same code.
"""

from __future__ import annotations

import torch

from specquant.kernels import ops
from specquant.model.attention import Attention
from specquant.model.modules import Linear
from specquant.model.norms import ZeroCentredRMSNorm
from specquant.model.rope import apply_rope


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [batch, heads, T, head_dim]; cos / sin rope_tables rows [T, rotary_dim]: rotate the first rotary_dim."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat([apply_rope(x[..., :rot], cos, sin), x[..., rot:]], -1)


class GatedAttention(Attention):
    """Mixer: forward(x [batch, T, hidden] after input_layernorm, cos, sin, start_pos, input_pos, plan)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        d = self.head_dim
        self.q_proj = Linear(cfg.hidden_size, 2 * self.n_heads * d, bias=cfg.qkv_bias)  # query | gate per head
        self.q_norm = ZeroCentredRMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, start_pos: int, input_pos: torch.Tensor | None = None,
                plan: tuple[torch.Tensor | None, bool] | None = None, tree=None):
        b, t, _ = x.shape
        h, kv, d = self.n_heads, self.n_kv, self.head_dim
        if self.qkv_proj is not None:  # model.fuse: [query | gate] x heads, then k, then v, in one matmul
            y = self.qkv_proj(x)
            qg, k, v = y[..., : 2 * h * d], y[..., 2 * h * d : (2 * h + kv) * d], y[..., (2 * h + kv) * d :]
        else:
            qg, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        qg = qg.view(b, t, h, 2 * d)
        q, gate = qg[..., :d], qg[..., d:]
        k = k.view(b, t, kv, d)
        if ops.usable(q, k, cos, sin):  # each norm and its partial RoPE in one native call
            q = ops.norm_rope(q, cos, sin, self.q_norm.weight, self.q_norm.eps, self.q_norm.offset)
            k = ops.norm_rope(k, cos, sin, self.k_norm.weight, self.k_norm.eps, self.k_norm.offset)
        else:
            q = apply_partial_rope(self.q_norm(q).transpose(1, 2), cos, sin)  # [b, heads, t, head_dim]
            k = apply_partial_rope(self.k_norm(k).transpose(1, 2), cos, sin)
        v = v.view(b, t, kv, d).transpose(1, 2)
        out = (self.attend_cached(q, k, v, start_pos, input_pos, plan) if tree is None  # [b, t, h * d]
               else self.attend_tree(q, k, v, start_pos, tree))
        if out.is_contiguous() and ops.usable(out, gate):  # in place, by the call the native layer step makes
            out = ops.sigmoid_mul(out.view(b, t, h, d), gate).view(b, t, h * d)
        else:
            out = out * torch.sigmoid(gate.reshape(b, t, h * d))
        return self.o_proj(out)
