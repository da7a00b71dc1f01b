"""Lean decoder for the Llama / Qwen2 / Qwen3 dense families, with a static KV cache and explicit positions.

Module names mirror transformers' (`model.layers.N.self_attn.q_proj`, ...), so HF state dicts load as they are.

Cache contract: `forward(tokens, start_pos)` writes K/V for positions start_pos .. start_pos+T-1 and attends to
every earlier position still held. The caller owns the sequence length and announces a rollback to an earlier
length L with `rollback(L)` (O(1) here: stale entries past L are overwritten before they are read, so K/V caches
only record it); the next forward starts at L. Rollback is a method, not index arithmetic in the caller, so a
layer whose state cannot be rolled back by position (linear attention in hybrid models) can restore a snapshot
there instead. With `sliding_window=W` the cache is a ring of W + max_block - 1 slots: position p lives in
slot p % capacity, each query sees only (p-W, p], and memory and per-step attention cost stay bounded by W.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specquant.model.config import ModelConfig
from specquant.model.rope import apply_rope, rope_tables


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # normalized in fp32, as transformers does
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)


SMALL_ROWS = (5, 8)  # Linear: fp32 CPU inputs with this many rows (inclusive) take the W·xᵀ path ...
SMALL_MIN_WEIGHT = 1 << 21  # ... on weights of at least this many elements (measurement in Linear's docstring)


class Linear(nn.Linear):
    """nn.Linear, with a faster path for the few-row fp32 GEMMs of decode and verify steps on CPU.

    F.linear computes x·Wᵀ; from 5 rows on MKL then runs small-M kernels that stream the weight at half of memory
    bandwidth on CPU. (W·xᵀ)ᵀ is the same product with the roles swapped and is faster for 5..8 rows on weights of
    2M+ elements. Re-measured on torch 2.13 (weights streamed, 1 thread, docs/SHAPES.md): 1..4 rows F.linear is as
    fast or faster everywhere (1 row: 5.4-6.2 GB/s against 2.7-3.0 GB/s for W·xᵀ with the row sent twice, which
    earlier torch builds favoured); 5..8 rows W·xᵀ wins by 1.1-1.5x on 1024->4096/6144 and 384->8192 and loses on
    small weights (384->1024 at 8 rows: 0.64 vs 0.53 ms). Results match F.linear to float rounding (summation
    order); tests/test_model_equivalence.py compares them.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if (SMALL_ROWS[0] <= rows <= SMALL_ROWS[1] and x.dtype == torch.float32 and x.device.type == "cpu"
                and self.weight.numel() >= SMALL_MIN_WEIGHT):
            y = torch.mm(self.weight, x.reshape(rows, self.in_features).t()).t().contiguous()
            if self.bias is not None:
                y = y + self.bias
            return y.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)

    @classmethod
    def concat(cls, mods: list["Linear"]) -> "Linear | None":
        """One Linear computing cat([m(x) for m in mods], -1) (model.fuse), or None when they cannot be fused."""
        first = mods[0]
        if any(type(m) is not cls or m.in_features != first.in_features or (m.bias is None) != (first.bias is None)
               or m.weight.dtype != first.weight.dtype for m in mods):
            return None
        w = torch.cat([m.weight.detach() for m in mods])
        fused = cls(first.in_features, w.shape[0], bias=first.bias is not None, device=w.device, dtype=w.dtype)
        fused.weight.data.copy_(w)
        if first.bias is not None:
            fused.bias.data.copy_(torch.cat([m.bias.detach() for m in mods]))
        return fused.requires_grad_(False)


class KVCache(nn.Module):
    """Per-layer static K/V buffers [batch, kv_heads, capacity, head_dim]; full (slot = position) or ring."""

    def __init__(self, batch, kv_heads, capacity, head_dim, dtype, device, window: int | None, static: bool = False):
        super().__init__()
        shape = (batch, kv_heads, capacity, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.capacity = capacity
        self.window = window
        self.static = static
        self.length = 0  # positions written and not rolled back (sliced path; the static path takes tensors)
        if static:  # which position each slot holds (-1: empty); lets attention run over the whole buffer
            self.register_buffer("slot_pos", torch.full((capacity,), -1, dtype=torch.long, device=device),
                                 persistent=False)

    def fits(self, batch: int, capacity: int, dtype, device: torch.device, window: int | None, static: bool) -> bool:
        """Whether a request needing this layout can reuse these buffers (a full cache may be larger than needed)."""
        same_device = self.k.device.type == device.type and (device.index is None or self.k.device == device)
        enough = self.capacity >= capacity if window is None else self.capacity == capacity
        return (self.k.shape[0] == batch and self.k.dtype == dtype and same_device and self.window == window
                and self.static == static and enough)

    def reset(self):
        """Start a new sequence in the same buffers (stale K/V are overwritten before they are read)."""
        self.length = 0
        if self.static:
            self.slot_pos.fill_(-1)

    def update_static(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Shape-static variant for compiled steps: input_pos [T] (tensor, so no recompiles per position).

        Writes slot = position % capacity and returns the whole buffer with a [T, capacity] mask built from
        slot_pos: causal, inside the window, and never an empty slot. Stale slots past a rollback hold later
        positions, which the causal test masks out.
        """
        slots = input_pos % self.capacity
        self.k.index_copy_(2, slots, k)
        self.v.index_copy_(2, slots, v)
        self.slot_pos.index_copy_(0, slots, input_pos)
        kpos, qpos = self.slot_pos[None, :], input_pos[:, None]
        mask = (kpos >= 0) & (kpos <= qpos)
        if self.window is not None:
            mask &= kpos > qpos - self.window
        return self.k, self.v, mask

    def key_start(self, start: int) -> int:
        """Position of the first key `update(start, ...)` returns: 0, or the window's start for a ring."""
        return 0 if self.window is None else max(0, start - self.window + 1)

    def update(self, start: int, k: torch.Tensor, v: torch.Tensor):
        """Store k/v [batch, kv_heads, T, head_dim] at positions start..start+T-1.

        Returns (keys, values, first_key_position): the keys a query at start..start+T-1 may need, in position
        order, starting at first_key_position.
        """
        t = k.shape[2]
        end = start + t
        assert start <= self.length, f"write at position {start} leaves a gap after {self.length} cached positions"
        self.length = end
        if self.window is None:
            if end > self.capacity:
                raise ValueError(f"KV cache holds {self.capacity} positions; asked to write up to {end}")
            self.k[:, :, start:end] = k
            self.v[:, :, start:end] = v
            return self.k[:, :, :end], self.v[:, :, :end], 0
        if t > self.capacity - self.window + 1:
            raise ValueError(f"block of {t} tokens exceeds the ring cache's block limit")
        slots = torch.arange(start, end, device=k.device) % self.capacity
        self.k.index_copy_(2, slots, k)
        self.v.index_copy_(2, slots, v)
        first = self.key_start(start)
        idx = torch.arange(first, end, device=k.device) % self.capacity
        return self.k.index_select(2, idx), self.v.index_select(2, idx), first

    def rollback(self, length: int):
        """Forget positions >= length: nothing to undo, later writes overwrite them (see the module docstring)."""
        self.length = min(self.length, length)


FOLD_MAX_ROWS = 16  # Attention: cached CPU steps of up to this many queries fold the GQA group into the queries,
FOLD_MIN_ROWS = {torch.float32: 1, torch.bfloat16: 2}  # from this many, in these dtypes (others: never)


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
        self.window = cfg.sliding_window
        self.cache: KVCache | None = None
        self.fold_enabled = True  # False: always the reference path (SDPA with enable_gqa); tests compare the two

    def fold(self, t: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether a cached step of t queries runs folded: one SDPA per KV head whose queries are
        the group's g query heads x t positions ([batch, kv_heads, g*t, d] against [batch, kv_heads, k_len, d]),
        so K and V are read once per KV head instead of once per query head, and the mask is built once per step.

        CPU, GQA, sliced caches, FOLD_MIN_ROWS..FOLD_MAX_ROWS queries: measured with
        benchmarks/few_query_attention.py (torch 2.13, 1 thread, interleaved, docs/SHAPES.md) at the Qwen3-0.6B
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
        """(mask, folded) for a sliced-cache or cache-free step; the same for every layer of a model (one cache
        layout and window), so Transformer.forward builds it once per step and hands it to each layer."""
        if self.cache is None:
            return attention_mask(start_pos, t, start_pos, t, self.window, device), False
        k_start = self.cache.key_start(start_pos)
        k_len = start_pos + t - k_start
        folded = self.fold(t, dtype, device)
        groups = self.n_heads // self.n_kv if folded else 1
        return attention_mask(start_pos, t, k_start, k_len, self.window, device, groups), folded

    def forward(self, x, cos, sin, start_pos: int, input_pos: torch.Tensor | None = None,
                plan: tuple[torch.Tensor | None, bool] | None = None):
        b, t, _ = x.shape
        if self.qkv_proj is not None:  # fused: q and k are normalized and rotated together, as one tensor
            y, d, nqk = self.qkv_proj(x), self.head_dim, self.n_heads + self.n_kv
            qk = y[..., : nqk * d].view(b, t, nqk, d)
            v = y[..., nqk * d :].view(b, t, self.n_kv, d).transpose(1, 2)
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
        folded = False
        if self.cache is not None and self.cache.static:
            keys, values, mask = self.cache.update_static(input_pos, k, v)
        else:
            if plan is None or (plan[1] and not self.fold_enabled):  # the step's plan is layer 0's choice
                plan = self.plan(start_pos, t, x.dtype, x.device)
            mask, folded = plan
            if self.cache is None:  # training / cache-free scoring: the whole sequence is in this call
                keys, values = k, v
            else:
                keys, values, _ = self.cache.update(start_pos, k, v)
        out = self.attend(q, keys, values, mask, folded, causal=mask is None and self.cache is None and t > 1)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))

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


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, f, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = Linear(h, f, bias=bias)
        self.up_proj = Linear(h, f, bias=bias)
        self.down_proj = Linear(f, h, bias=bias)
        self.gate_up_proj = None  # model.fuse.fuse_projections: gate and up in one matmul (inference only)

    def forward(self, x):
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, start_pos, input_pos=None, plan=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, start_pos, input_pos, plan)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    """Decoder-only LM. `forward(tokens [batch, T], start_pos) -> logits [batch, T or 1, vocab]`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Body(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.max_block = None  # largest T one cached forward may take (ring caches only)
        self.static_cache = False
        # config.json `quantization_config` of the weights this model holds (None: dense). Written by whoever
        # quantizes or loads it and saved with it by model.checkpoint.save_model; model/ never interprets it.
        self.quantization: dict | None = None
        self._set_rope(cfg.max_position_embeddings)

    def _set_rope(self, length: int):
        cfg = self.config
        cos, sin = rope_tables(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings, length)
        device = self.model.embed_tokens.weight.device
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)

    def setup_cache(self, batch_size: int, max_seq_len: int, max_block: int = 64, dtype=None, device=None,
                    window: int | None = -1, static: bool = False):
        """Make K/V buffers for sequences of up to max_seq_len positions, reusing the ones already there.

        Buffers are allocated once and reused by every request that fits (as gpt-fast's setup_caches): the same
        tensors, so compiled steps are not recompiled per request. They are reallocated only when a request needs
        more positions, or another batch size, dtype, device, window or layout.
        window: attend to the last W positions (-1: the config's sliding_window; None: full attention). A windowed
        model gets a ring of W + max_block - 1 slots whatever max_seq_len is; it takes at most max_block tokens per
        forward, and a caller may roll back by up to max_block - 1 positions past what it wrote since.
        static: attention always spans the whole buffer under a mask built from tensors, so a step's shapes do
        not depend on the position (what torch.compile / CUDA graphs need); the sliced path is its reference.
        """
        cfg = self.config
        capacity, window, dtype, device = self.cache_layout(max_seq_len, max_block, dtype, device, window)
        self.max_block = None if window is None else max_block
        old = self.model.layers[0].self_attn.cache
        if old is not None and old.fits(batch_size, capacity, dtype, device, window, static):
            for layer in self.model.layers:
                layer.self_attn.cache.reset()
        else:
            for layer in self.model.layers:
                layer.self_attn.window = window
                layer.self_attn.cache = KVCache(
                    batch_size, cfg.num_key_value_heads, capacity, cfg.head_dim, dtype, device, window, static
                )
        self.static_cache = static
        if self.rope_cos.shape[0] < max_seq_len or self.rope_cos.device != device:
            self._set_rope(max(max_seq_len, cfg.max_position_embeddings))
            self.rope_cos, self.rope_sin = self.rope_cos.to(device), self.rope_sin.to(device)

    def cache_layout(self, max_seq_len: int, max_block: int = 64, dtype=None, device=None, window: int | None = -1
                     ) -> tuple[int, int | None, torch.dtype, torch.device]:
        """(capacity, window, dtype, device) of the K/V buffers setup_cache makes for these arguments (its rules
        for them, so a compiled step can be keyed on the cache before it exists)."""
        w = self.model.embed_tokens.weight
        window = self.config.sliding_window if window == -1 else window
        window = window or None
        capacity = max_seq_len if window is None else window + max_block - 1
        return capacity, window, dtype or w.dtype, torch.device(device or w.device)

    def init_non_persistent(self, device):
        """After materializing a meta-device model: tie lm_head again when the config says so (to_empty gave it
        its own tensor) and rebuild the RoPE tables (non-persistent buffers, never in a checkpoint) on device."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._set_rope(self.config.max_position_embeddings)
        self.rope_cos, self.rope_sin = self.rope_cos.to(device), self.rope_sin.to(device)

    def untie_lm_head(self):
        """Give lm_head its own copy of the embedding and record it in the config (tie_word_embeddings=False):
        needed before lm_head alone is replaced, e.g. by a quantized Linear."""
        if self.lm_head.weight is self.model.embed_tokens.weight:
            self.lm_head.weight = nn.Parameter(self.model.embed_tokens.weight.detach().clone())
        self.config.tie_word_embeddings = False

    def rollback(self, length: int):
        """The sequence continues from `length` positions (rejected draft tokens past it are forgotten)."""
        for layer in self.model.layers:
            if layer.self_attn.cache is not None:
                layer.self_attn.cache.rollback(length)

    def clear_cache(self):
        self.static_cache = False
        for layer in self.model.layers:
            layer.self_attn.cache = None
            layer.self_attn.window = self.config.sliding_window
        self.max_block = None

    def forward(self, tokens: torch.Tensor, start_pos: int = 0, last_only: bool = False,
                input_pos: torch.Tensor | None = None, hidden_layers: tuple[int, ...] = (),
                hidden_only: bool = False):
        """tokens [batch, T] at positions start_pos.. (or input_pos [T], static caches) -> logits [batch, T or 1, vocab].

        hidden_layers: ids of decoder layers (0-based) whose outputs to return as well, for drafters that read the
        target's hidden states (a DFlash block drafter): then (logits, hidden [batch, T, len(hidden_layers),
        hidden_size]), every position even with last_only. Empty (default): logits only, no extra work.
        hidden_only: return the final-norm hidden states [batch, T, hidden] instead of logits, so a loss can apply
        lm_head in chunks of positions (train/qad.py's chunked KL) without ever holding [batch, T, vocab].
        """
        t = tokens.shape[1]
        if self.max_block is not None and t > self.max_block:  # ring cache: feed long prompts in blocks
            outs = [
                self.forward(tokens[:, i : i + self.max_block], start_pos + i, last_only, hidden_layers=hidden_layers,
                             hidden_only=hidden_only)
                for i in range(0, t, self.max_block)
            ]
            if not hidden_layers:
                return outs[-1] if last_only else torch.cat(outs, dim=1)
            logits = outs[-1][0] if last_only else torch.cat([o[0] for o in outs], dim=1)
            return logits, torch.cat([o[1] for o in outs], dim=1)
        x = self.model.embed_tokens(tokens)
        if self.static_cache:
            if input_pos is None:
                input_pos = torch.arange(start_pos, start_pos + t, device=tokens.device)
            cos, sin = self.rope_cos[input_pos].to(x.dtype), self.rope_sin[input_pos].to(x.dtype)
        else:
            cos = self.rope_cos[start_pos : start_pos + t].to(x.dtype)
            sin = self.rope_sin[start_pos : start_pos + t].to(x.dtype)
        # the sliced path's mask (and whether attention folds) is the same for every layer: built once per step
        plan = None if self.static_cache else self.model.layers[0].self_attn.plan(start_pos, t, x.dtype, x.device)
        hidden = {}
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, start_pos, input_pos, plan)
            if i in hidden_layers:
                hidden[i] = x
        if last_only:
            x = x[:, -1:]
        x = self.model.norm(x)
        logits = x if hidden_only else self.lm_head(x)
        if not hidden_layers:
            return logits
        return logits, torch.stack([hidden[i] for i in hidden_layers], dim=2)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())
