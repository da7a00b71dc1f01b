"""Attention, the "full_attention" layer kind: GQA over a KVCache (full or ring), with RoPE and optional q/k norms.

A mixer of model/layers.py: it makes its own cache (`make_cache`), plans what every attention layer of one step
shares (`plan`: the mask, whether to fold), and is called as `mixer(x, cos, sin, start_pos, input_pos, plan)`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specquant.kernels import ops
from specquant.model.cache import KVCache
from specquant.model.config import ModelConfig
from specquant.model.modules import Linear, RMSNorm
from specquant.model.rope import apply_rope
from specquant.model.tree import TreeLayout


FOLD_MAX_ROWS = 16  # Attention: cached CPU steps of up to this many queries fold the GQA group into the queries,
FOLD_MIN_ROWS = {torch.float32: 1, torch.bfloat16: 2}  # from this many, in these dtypes (others: never)
# Attention.attend_cached: cached fp32 CPU eager steps of up to this many queries run kernels.ops.attention, whose
# rows are computed alike in any block: every verify width (up to a cache's max_block, 64) takes it, so a verify
# row equals the one-query decode step bit for bit and a speculative run emits exactly the target's greedy tokens
# (SDPA's rows differ from the kernel's in the last bit; with only 1..4 queries native, the hybrid demo's 21-row
# suffix verifies changed a token at a near-tie). Longer blocks (prefill) take SDPA. Speed at 1-8 queries is in
# docs/BENCH.md ("Smaller CPU wins").
NATIVE_MAX_ROWS = 64


def attention_mask(q_start: int, t: int, k_start: int, k_len: int, window: int | None, device,
                   groups: int = 1) -> torch.Tensor | None:
    """Boolean [groups * t, k_len] mask: query at q_start+i sees key at k_start+j iff causal and inside the window.

    groups > 1: the [t, k_len] mask repeated group-major (row r is query r % t), the row order of folded
    attention (Attention.fold).
    """
    if t == 1 and (window is None or k_len <= window):
        return None  # a single query sees every key handed to it
    qpos = torch.arange(q_start, q_start + t, device=device)
    qpos = (qpos.repeat(groups) if groups > 1 else qpos)[:, None]
    kpos = torch.arange(k_start, k_start + k_len, device=device)[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    return mask


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = Linear(h, self.n_heads * d, bias=cfg.qkv_bias)
        self.k_proj = Linear(h, self.n_kv * d, bias=cfg.qkv_bias)
        self.v_proj = Linear(h, self.n_kv * d, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.n_heads * d, h, bias=cfg.o_bias)
        self.qkv_proj = None  # model.fuse.fuse_projections: q/k/v in one matmul (inference only)
        # with qkv_proj, q_norm and k_norm run as one normalization with this [heads + kv_heads, head_dim] weight
        self.register_buffer("qk_norm_weight", None, persistent=False)
        self.eps = cfg.rms_norm_eps
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.sliding_window = cfg.sliding_window  # the config's; a cache may be made with another (setup_cache)
        self.cache: KVCache | None = None  # installed by Transformer.setup_cache
        self.fold_enabled = True  # False: always the reference path (SDPA with enable_gqa); tests compare the two

    @property
    def window(self) -> int | None:
        """The window this layer attends over: its cache's, else the config's (cache-free forwards)."""
        return self.sliding_window if self.cache is None else self.cache.window

    def make_cache(self, batch: int, capacity: int, dtype: torch.dtype, device: torch.device, window: int | None,
                   static: bool, max_block: int | None = None) -> KVCache:  # max_block: a ring's capacity has it
        return KVCache(batch, self.n_kv, capacity, self.head_dim, dtype, device, window, static)

    def fold(self, t: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether a cached step of t queries runs folded: one SDPA per KV head whose queries are
        the group's g query heads x t positions ([batch, kv_heads, g*t, d] against [batch, kv_heads, k_len, d]),
        so K and V are read once per KV head instead of once per query head, and the mask is built once per step.

        CPU, GQA, sliced caches, FOLD_MIN_ROWS..FOLD_MAX_ROWS queries: measured with
        benchmarks/few_query_attention.py at dfedb37 (torch 2.13, 1 thread, interleaved, docs/SHAPES.md) at the Qwen3-0.6B
        and bundled-target shapes over 64-1024 keys. fp32: folded took 0.74-1.00x of SDPA-with-enable_gqa's time
        at 2..16 queries and 0.77-1.07x at one (the 1.07x: 13.4 vs 12.5 us, tiny-target, 64 keys). bf16:
        0.71-0.99x at 2..16 queries (one 1.09x: tiny-target, 256 keys, 8 queries) but 1.09-1.36x at one, so
        bf16 decode steps keep SDPA. Longer blocks (prefill), other dtypes and devices were not measured and keep
        the reference path; so does the static cache (one masked SDPA over the whole buffer, shape-static for
        compiled steps).
        """
        return (self.fold_enabled and self.n_kv < self.n_heads and device.type == "cpu"
                and FOLD_MIN_ROWS.get(dtype, FOLD_MAX_ROWS + 1) <= t <= FOLD_MAX_ROWS)

    def plan(self, start_pos: int, t: int, dtype: torch.dtype, device: torch.device
             ) -> tuple[torch.Tensor | None, bool]:
        """(mask, folded) for a sliced-cache or cache-free step; the same for every attention layer of a model
        (one cache layout and window), so Transformer.forward builds it once per step and hands it to each.

        mask None: every query sees every key handed to it (one query), or, for t > 1, the keys are exactly the
        step's own t positions under a plain causal mask (a prompt's first block, a cache-free forward), which
        attend_cached runs as SDPA's is_causal: the same outputs as the boolean mask, bit for bit
        (test_few_query_attention compares the two), in less time, since torch's CPU flash kernel then skips the
        blocks above the diagonal instead of masking them (docs/BENCH.md, "Prefill")."""
        cache = self.cache
        k_start = start_pos if cache is None else cache.key_start(start_pos)
        folded = cache is not None and self.fold(t, dtype, device)
        if k_start == start_pos and not folded and (self.window is None or t <= self.window):
            return None, False  # the keys are the step's own t positions (k_len == t)
        k_len = start_pos + t - k_start
        groups = self.n_heads // self.n_kv if folded else 1
        return attention_mask(start_pos, t, k_start, k_len, self.window, device, groups), folded

    def forward(self, x, cos, sin, start_pos: int, input_pos: torch.Tensor | None = None,
                plan: tuple[torch.Tensor | None, bool] | None = None, tree: TreeLayout | None = None):
        q, k, v = self.project(x, cos, sin)
        if tree is not None:
            return self.o_proj(self.attend_tree(q, k, v, start_pos, tree))
        return self.o_proj(self.attend_cached(q, k, v, start_pos, input_pos, plan))

    def project(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [b, t, hidden] -> q [b, heads, t, d], k, v [b, kv_heads, t, d]: projected, q and k normalized (where
        the layer has q/k norms) and rotated."""
        b, t, _ = x.shape
        if self.qkv_proj is not None:  # fused: q and k are normalized and rotated together, as one tensor
            y, d, nqk = self.qkv_proj(x), self.head_dim, self.n_heads + self.n_kv
            qk = y[..., : nqk * d].view(b, t, nqk, d)
            v = y[..., nqk * d :].view(b, t, self.n_kv, d).transpose(1, 2)
            if ops.usable(qk, cos, sin):  # the norm and RoPE in one native call, out in the layout below
                qk = ops.norm_rope(qk, cos, sin, self.qk_norm_weight, self.eps,
                                   normalize=self.qk_norm_weight is not None)
            else:
                if self.qk_norm_weight is not None:  # RMSNorm's math, with q_norm's / k_norm's weight per head
                    qk = self.qk_norm_weight * F.rms_norm(qk.float(), (d,), None, self.eps).to(qk.dtype)
                qk = apply_rope(qk.transpose(1, 2), cos, sin)  # [b, heads + kv_heads, t, head_dim]
            q, k = qk[:, : self.n_heads], qk[:, self.n_heads :]
        else:
            q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim)
            k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim)
            v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q = apply_rope(q.transpose(1, 2), cos, sin)  # [b, heads, t, head_dim]
            k = apply_rope(k.transpose(1, 2), cos, sin)
        return q, k, v

    def attend_tree(self, q, k, v, start_pos: int, tree: TreeLayout) -> torch.Tensor:
        """A tree forward's attention (model/tree.py): q [b, heads, N, d], k, v [b, kv_heads, N, d] of the nodes,
        at positions start_pos + depth; node i sees the cache's positions < start_pos, its ancestors and itself.
        -> [b, N, heads * d]. The cache keeps every node's k, v for commit_tree.

        fp32 CPU (ops.usable): segment by segment (TreeLayout.segments), the segment's nodes are written at their
        depths' slots, where the earlier segments left its ancestors, and the native kernel attends them as the
        chain verify of that root path does, row for row: a node's row equals the one-query decode step's bit for
        bit, so greedy tree speculation stays exact. Otherwise every node at slot start_pos + i, under the
        ancestor mask, in one SDPA (equal up to rounding)."""
        cache = self.cache
        if cache is None:
            raise ValueError("a tree forward needs a cache (Transformer.setup_cache)")
        b, _, n, d = q.shape
        cache.begin_tree(start_pos, k, v)
        if n <= NATIVE_MAX_ROWS and ops.usable(q, cache.k, cache.v):
            order = torch.tensor(tree.order, device=q.device)  # segments as contiguous runs
            qs, ks, vs = (t.index_select(2, order) for t in (q, k, v))
            outs = []
            for seg, at in zip(tree.segments, tree.segment_starts):
                lo, m = start_pos + tree.depth[seg[0]], len(seg)
                cache.k[:, :, lo : lo + m] = ks[:, :, at : at + m]
                cache.v[:, :, lo : lo + m] = vs[:, :, at : at + m]
                outs.append(ops.attention(qs[:, :, at : at + m], cache.k, cache.v, lo, 0, None))
            out = torch.empty(b, n, self.n_heads, d, dtype=q.dtype, device=q.device)
            out[:, order] = torch.cat(outs, 1)
            return out.view(b, n, self.n_heads * d)
        end = start_pos + n
        cache.k[:, :, start_pos:end] = k
        cache.v[:, :, start_pos:end] = v
        mask = torch.cat([torch.ones(n, start_pos, dtype=torch.bool, device=q.device),
                          tree.ancestor_mask(q.device)], 1)
        out = self.attend(q, cache.k[:, :, :end], cache.v[:, :, :end], mask, folded=False)
        return out.transpose(1, 2).reshape(b, n, self.n_heads * d)

    def attend_cached(self, q, k, v, start_pos: int, input_pos: torch.Tensor | None,
                      plan: tuple[torch.Tensor | None, bool] | None) -> torch.Tensor:
        """Store k, v [b, kv_heads, t, d] in the cache (if any) and attend q [b, heads, t, d] over it ->
        [b, t, heads * d], what o_proj reads. Cached fp32 CPU eager steps of up to NATIVE_MAX_ROWS queries run the
        native kernel (kernels.ops.attention, which takes the positions and builds no mask); every other step,
        and SPECQUANT_NATIVE=off, runs `attend` (SDPA) under the step's plan."""
        b, _, t, d = q.shape
        folded, k_start = False, None
        if self.cache is not None and self.cache.static:
            keys, values, mask = self.cache.update_static(input_pos, k, v)
        else:
            if self.cache is None:  # training / cache-free scoring: the whole sequence is in this call
                keys, values = k, v
            else:
                keys, values, k_start = self.cache.update(start_pos, k, v)
                if t <= NATIVE_MAX_ROWS and ops.usable(q, keys, values):
                    return ops.attention(q, keys, values, start_pos, k_start, self.window).view(b, t, -1)
            if plan is None or (plan[1] and not self.fold_enabled):  # the step's plan is the first layer's choice
                plan = self.plan(start_pos, t, q.dtype, q.device)
            mask, folded = plan
        out = self.attend(q, keys, values, mask, folded, causal=mask is None and t > 1)
        return out.transpose(1, 2).reshape(b, t, self.n_heads * d)

    def attend(self, q, keys, values, mask, folded: bool, causal: bool = False) -> torch.Tensor:
        """q [b, heads, t, d] over keys/values [b, kv_heads, S, d] -> [b, heads, t, d]; folded: see fold()."""
        if folded:
            b, _, t, d = q.shape
            q = q.reshape(b, self.n_kv, self.n_heads // self.n_kv * t, d)
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask).reshape(b, self.n_heads, t, d)
        gqa = self.n_kv != self.n_heads
        if causal:
            return F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa)
