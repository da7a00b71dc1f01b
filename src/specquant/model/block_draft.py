"""DFlash-style block drafter: one forward proposes a whole block from the target's hidden states.

Architecture (REFERENCE.md §3, the `DFlashDraftModel` layout vLLM, SGLang and llama.cpp's converter read):
  ctx   = hidden_norm(fc(concat(h_l for l in target_layer_ids)))   # target features -> drafter width
  block = target.embed_tokens([anchor, MASK x (B-1)])                # queries, at positions n .. n+B-1
  each Qwen3-style layer: q from the block; k/v = [k/v_proj(ctx) ; k/v_proj(block)] (k_norm + RoPE on both),
  non-causal inside the block, every context position before the anchor visible
  logits = target.lm_head(norm(block)) at block positions 1..B-1
`h_l` is the output of the target's decoder layer l (0-based), i.e. transformers' `hidden_states[l + 1]`.
Which layers a fresh drafter reads (its taps) is `default_target_layer_ids`: DFlash's rule for hybrid targets.

The target's embeddings and lm_head are reused by reference (`attach_target`), never copied: they are not
submodules, so they are neither saved, trained nor quantized with the drafter.

Context cache: per layer the context K/V of the positions the target has accepted, written by `append_context`.
Like the decoder's cache it keeps no truth about length beyond `context_len`, so `rollback(L)` is O(1). With a
sliding window W the cache is a ring of W + chunk slots and a block query at position p sees context positions
(p - W, n): per-step cost and memory stay bounded by W however long the context (serve time only; training is
full attention, as in the reference).

A drafter layer is a Qwen3 decoder layer: its projections, q/k norms, MLP and SDPA are the decoder's own modules
(model/decoder.py); only the masking differs (block queries over context K/V + the block). Laid out for decoding
(fused, as the block kind loads it), a layer's serving step is one native call (model/native_layer.py block_step)
that also writes the K/V of the context rows given to `propose`, so those rows cost no second pass over the weights;
the block's own K/V go to the cache's slots past the context (never read as context: the next append overwrites
them), which is why the cache has block_size slots more than the context needs. This file is the model:
its training loss is train/block_draft.py's, its checkpoint I/O model/checkpoint.py's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from specquant.errors import SpecquantError
from specquant.kernels import ops
from specquant.model import native_layer
from specquant.model.attention import NATIVE_MAX_ROWS
from specquant.model.config import ModelConfig
from specquant.model.decoder import MLP, Attention, Linear, RMSNorm
from specquant.model.modules import add_norm
from specquant.model.rope import apply_rope, rope_tables

ARCHITECTURE = "DFlashDraftModel"
APPEND_CHUNK = 64  # largest number of context positions one ring-cache write takes (prefill is chunked)
DENSE_TAPS = 4  # taps of a fresh drafter on a dense (Qwen3-style) target: this project's rule, as trained so far
HYBRID_TAPS = 5  # on a hybrid (Qwen3.5) target: DFlash's released Qwen3.5 drafters read five layers


def dflash_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """DFlash's tap rule (z-lab/dflash model/utils.py build_target_layer_ids, which SGLang mirrors): num_taps
    layers spread evenly, rounded, from layer 1 to layer N-3; one tap reads the middle layer N // 2. At 32 layers
    and 5 taps: [1, 8, 15, 22, 29].

    Index convention: 0-based decoder layer ids, each naming that layer's output (the residual stream after it),
    which DFlash reads as transformers' hidden_states[id + 1] (hidden_states[0] is the embeddings) and our
    Transformer.forward(hidden_layers=ids) returns directly. Targets too shallow for num_taps distinct layers in
    1..N-3 get fewer taps (DFlash's formula would repeat layers there)."""
    if num_target_layers < 1 or num_taps < 1:
        raise SpecquantError(f"a tap rule needs at least one target layer and one tap, not {num_target_layers} "
                             f"layers and {num_taps} taps")
    first, last = 1, num_target_layers - 3
    taps = min(num_taps, max(1, last - first + 1))
    if taps == 1:
        return [num_target_layers // 2]
    return [round(first + i * (last - first) / (taps - 1)) for i in range(taps)]


def default_target_layer_ids(target: ModelConfig) -> list[int]:
    """The layers a fresh drafter reads on this target: DFlash's rule for hybrids (HYBRID_TAPS over 1..N-3, the
    reference's choice for Qwen3.5), and for dense targets DENSE_TAPS spread from layer 1 to N-2 (the last
    layer's output is the final norm's input only), kept so dense drafters train as before."""
    n = target.num_hidden_layers
    if "linear_attention" in target.per_layer_types_hf:
        return dflash_target_layer_ids(n, HYBRID_TAPS)
    taps, last = min(DENSE_TAPS, n), max(1, n - 2)
    return sorted({round(1 + i * (last - 1) / max(1, taps - 1)) for i in range(taps)})


@dataclass
class BlockDraftConfig:
    """Drafter shape; hidden_size and vocab_size must equal the target's (its embeddings and lm_head are reused)."""

    hidden_size: int = 384
    intermediate_size: int = 1024
    num_hidden_layers: int = 2
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    vocab_size: int = 8192
    block_size: int = 16  # anchor + block_size - 1 drafted tokens per forward
    target_layer_ids: list[int] = field(default_factory=lambda: [1, 3, 5, 6])  # 0-based target decoder layers
    num_target_layers: int = 8
    mask_token_id: int = 3
    sliding_window: int | None = None  # serve-time window over the context (None: full attention)
    eos_token_id: int | list[int] | None = 0
    tie_word_embeddings = False  # class attribute, not a field: the drafter has no embeddings of its own

    def validate(self) -> "BlockDraftConfig":
        if self.block_size < 2:
            raise SpecquantError(f"block_size {self.block_size} must be at least 2 (anchor + one drafted token)")
        if not self.target_layer_ids:
            raise SpecquantError("target_layer_ids is empty; list the target decoder layers the drafter reads")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise SpecquantError(f"target_layer_ids {bad} lie outside the target's {self.num_target_layers} layers "
                                 f"(0-based: 0..{self.num_target_layers - 1})")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise SpecquantError(f"mask_token_id {self.mask_token_id} is outside the vocabulary 0..{self.vocab_size - 1}")
        if self.sliding_window is not None and self.sliding_window < 2:
            raise SpecquantError(f"drafter sliding window {self.sliding_window} must be at least 2 (or None)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise SpecquantError(f"num_attention_heads {self.num_attention_heads} must be a multiple of "
                                 f"num_key_value_heads {self.num_key_value_heads}")
        return self

    @classmethod
    def for_target(cls, target: ModelConfig, **overrides) -> "BlockDraftConfig":
        """A drafter shaped like the target's layers (same width, heads, RoPE), with `overrides` applied."""
        base = dict(hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
                    num_attention_heads=target.num_attention_heads, num_key_value_heads=target.num_key_value_heads,
                    head_dim=target.head_dim, rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta,
                    rope_scaling=target.rope_scaling, max_position_embeddings=target.max_position_embeddings,
                    vocab_size=target.vocab_size, num_target_layers=target.num_hidden_layers,
                    eos_token_id=target.eos_token_id)
        return cls(**{**base, **overrides}).validate()

    def layer_config(self) -> ModelConfig:
        """One drafter layer as the decoder's ModelConfig: a Qwen3 layer (q/k norms, no biases, no window)."""
        return ModelConfig(model_type="qwen3", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
                           num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                           head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
                           rope_scaling=self.rope_scaling, max_position_embeddings=self.max_position_embeddings,
                           tie_word_embeddings=False, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=True,
                           sliding_window=None, eos_token_id=self.eos_token_id)

    def check_target(self, target: ModelConfig):
        """The drafter only works on the target it reads: same width, vocabulary and layer count."""
        for name, mine, theirs in (("hidden_size", self.hidden_size, target.hidden_size),
                                   ("vocab_size", self.vocab_size, target.vocab_size),
                                   ("num_target_layers", self.num_target_layers, target.num_hidden_layers)):
            if mine != theirs:
                raise SpecquantError(f"block drafter has {name}={mine} but the target has {theirs}; use a drafter "
                                     "trained for this target (specquant distill draft --kind block)")

    def to_hf(self) -> dict:
        """config.json in the DFlashDraftModel layout (embed/lm_head omitted: the target's are used)."""
        window = self.sliding_window
        return {
            "architectures": [ARCHITECTURE], "model_type": "qwen3",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings, "vocab_size": self.vocab_size,
            "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False, "is_causal": False,
            "block_size": self.block_size, "num_target_layers": self.num_target_layers,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids),
                              "block_size": self.block_size},
            # the window is a serve-time setting: full-attention layers in the file, ours under our own key
            "layer_types": ["full_attention"] * self.num_hidden_layers, "use_sliding_window": False,
            "sliding_window": None, "specquant_sliding_window": window,
            "eos_token_id": self.eos_token_id,
        }

    @classmethod
    def from_hf(cls, hf: dict) -> "BlockDraftConfig":
        if ARCHITECTURE not in (hf.get("architectures") or []):
            raise SpecquantError(f"config.json architectures {hf.get('architectures')} is not [{ARCHITECTURE!r}]; "
                                 "not a block drafter checkpoint")
        dflash = hf.get("dflash_config") or {}
        try:
            rope = hf.get("rope_parameters") or {}
            return cls(
                hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
                num_hidden_layers=hf["num_hidden_layers"], num_attention_heads=hf["num_attention_heads"],
                num_key_value_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
                head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
                rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
                rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
                rope_scaling=hf.get("rope_scaling"),
                max_position_embeddings=hf.get("max_position_embeddings", 2048), vocab_size=hf["vocab_size"],
                block_size=int(dflash.get("block_size", hf.get("block_size", 16))),
                target_layer_ids=list(dflash["target_layer_ids"]), num_target_layers=hf["num_target_layers"],
                mask_token_id=int(dflash["mask_token_id"]),
                sliding_window=hf.get("specquant_sliding_window") or (
                    hf.get("sliding_window") if hf.get("use_sliding_window") else None),
                eos_token_id=hf.get("eos_token_id"),
            ).validate()
        except KeyError as e:
            raise SpecquantError(f"block drafter config.json lacks {e.args[0]!r}; it needs the DFlashDraftModel "
                                 "fields (dflash_config.target_layer_ids, dflash_config.mask_token_id, "
                                 "num_target_layers, ...)") from None

    def to_json(self) -> dict:
        return asdict(self)


def is_block_draft_config(hf: dict) -> bool:
    """Whether a config.json dict describes a block drafter (rather than a small LM drafter)."""
    return ARCHITECTURE in (hf.get("architectures") or [])


class ContextCache(nn.Module):
    """Context K/V [1, kv_heads, capacity, head_dim] of one layer; slot = position (full) or position % capacity."""

    def __init__(self, kv_heads, capacity, head_dim, dtype, device):
        super().__init__()
        self.register_buffer("k", torch.zeros(1, kv_heads, capacity, head_dim, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("v", torch.zeros_like(self.k), persistent=False)
        self.capacity = capacity

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor):
        slots = torch.arange(start, start + k.shape[2], device=k.device) % self.capacity
        self.k.index_copy_(2, slots, k)
        self.v.index_copy_(2, slots, v)

    def read(self, first: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        if first == 0 and end <= self.capacity:  # full cache (or a ring not yet wrapped): a view, no copy
            return self.k[:, :, :end], self.v[:, :, :end]
        idx = torch.arange(first, end, device=self.k.device) % self.capacity
        return self.k.index_select(2, idx), self.v.index_select(2, idx)


class BlockAttention(Attention):
    """The decoder's attention (q/k/v/o projections, q/k norms, RoPE, `attend`) with the drafter's masking:
    block queries over [context K/V ; the block's own K/V]. The context K/V come from outside (`kv` of the
    context, cached in `context_cache` at serve time), so the decoder's KV-cache path is never used here."""

    def __init__(self, cfg: BlockDraftConfig):
        super().__init__(cfg.layer_config())
        self.context_cache: ContextCache | None = None

    def kv(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """x [b, T, hidden] -> k, v [b, kv_heads, T, head_dim] (k normalized and rotated)."""
        if self.qkv_proj is not None:  # fused (model/fuse.py, for decoding): q comes along and is dropped
            return self.project(x, cos, sin)[1:]
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.n_kv, self.head_dim))
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        return apply_rope(k.transpose(1, 2), cos, sin), v

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask, at: tuple[int, int, int | None] | None = None):
        """x [b, Q, hidden] block queries; ctx_k/ctx_v [b, kv, C, d]; mask [b|1, 1, Q, C+Q] bool or None. at: a
        serving step's (block position n, first context position, window): the same visibility as `mask`, by
        position, which the native kernel takes (fp32 CPU eager) instead of SDPA under the mask, as the decoder's
        cached steps do (model/attention.py attend_cached), so this equals the one-call layer (native_layer.py)."""
        b, t, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        keys, values = torch.cat((ctx_k, k), 2), torch.cat((ctx_v, v), 2)
        if at is not None and t <= NATIVE_MAX_ROWS and ops.usable(q, keys, values):
            out = ops.attention(q, keys, values, at[0], at[1], at[2], block=True).view(b, t, -1)
        else:
            out = self.attend(q, keys, values, mask, folded=False).transpose(1, 2).reshape(b, t, -1)
        return self.o_proj(out)


class BlockLayer(nn.Module):
    """A Qwen3 decoder layer over BlockAttention; `mixer` as DecoderLayer's, so model/fuse.py fuses it too."""

    mixer_attr = "self_attn"

    def __init__(self, cfg: BlockDraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = BlockAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.layer_config())

    @property
    def mixer(self) -> BlockAttention:
        return self._modules["self_attn"]

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask, at: tuple[int, int, int | None] | None = None):
        # the context is not normalized by input_layernorm: hidden_norm already did (as in the reference)
        mixed = self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask, at)
        x, h = add_norm(self.post_attention_layernorm, x, mixed)  # as DecoderLayer.forward (one native call)
        return x + self.mlp(h)


class BlockDraftModel(nn.Module):
    """The drafter's own weights (fc, hidden_norm, layers, norm); the target's embed/lm_head are attached."""

    def __init__(self, cfg: BlockDraftConfig):
        super().__init__()
        self.config = cfg.validate()
        h = cfg.hidden_size
        self.fc = Linear(len(cfg.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(BlockLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self._target_modules: tuple[nn.Module, nn.Module] | None = None  # (embed_tokens, lm_head), not submodules
        self.window: int | None = None
        self.context_len = 0
        self._set_rope(cfg.max_position_embeddings)

    # -- wiring ---------------------------------------------------------------------------------------------------
    def _set_rope(self, length: int):
        cfg = self.config
        cos, sin = rope_tables(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings, length)
        self.rope_cos, self.rope_sin = cos, sin

    def attach_target(self, target, lm_head: nn.Module | None = None) -> "BlockDraftModel":
        """Reuse `target`'s embed_tokens and lm_head (a specquant Transformer); checks the shapes match. lm_head:
        a head to use instead of the target's (a vocabulary-pruned copy of its rows: `propose` then returns
        logits over that head's outputs)."""
        self.config.check_target(target.config)
        self._target_modules = (target.model.embed_tokens, target.lm_head if lm_head is None else lm_head)
        return self

    @property
    def embed_tokens(self) -> nn.Module:
        if self._target_modules is None:
            raise SpecquantError("block drafter has no target attached; call attach_target(target) first")
        return self._target_modules[0]

    @property
    def lm_head(self) -> nn.Module:
        return self._target_modules[1] if self._target_modules else self.embed_tokens

    def _rope(self, positions: torch.Tensor, dtype, device):
        """positions [..., T] -> cos, sin [..., T, head_dim] (grown on demand: RoPE tables are cheap)."""
        need = int(positions.max()) + 1
        if self.rope_cos.shape[0] < need:
            self._set_rope(max(need, 2 * self.rope_cos.shape[0]))
        if self.rope_cos.device != torch.device(device):
            self.rope_cos, self.rope_sin = self.rope_cos.to(device), self.rope_sin.to(device)
        return self.rope_cos[positions].to(dtype), self.rope_sin[positions].to(dtype)

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """features [b, T, len(target_layer_ids) * hidden] (concat of the chosen layers) -> ctx [b, T, hidden]."""
        return self.hidden_norm(self.fc(features))

    def block_embeddings(self, anchors: torch.Tensor) -> torch.Tensor:
        """anchor token ids [...] -> embeddings of [anchor, MASK x (B-1)]: [..., B, hidden]."""
        B = self.config.block_size
        ids = torch.full((*anchors.shape, B), self.config.mask_token_id, dtype=torch.long, device=anchors.device)
        ids[..., 0] = anchors
        return self.embed_tokens(ids)

    # -- training: many blocks in one forward -----------------------------------------------------------------------
    def block_logits(self, features: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Teacher-forced forward over many blocks at once.

        features [b, L, taps*hidden] (target features of every position), tokens [b, L], anchors [b, A] (positions,
        1 <= a < L). Block i holds [tokens[a_i], MASK...] at positions a_i .. a_i+B-1; it sees context strictly
        before a_i and itself bidirectionally, never another block. Returns logits [b, A, B-1, vocab] for block
        positions 1..B-1.
        """
        b, L = tokens.shape
        A, B = anchors.shape[1], self.config.block_size
        ctx = self.project_context(features)
        x = self.block_embeddings(tokens.gather(1, anchors)).reshape(b, A * B, -1)
        block_pos = (anchors[:, :, None] + torch.arange(B, device=anchors.device)).reshape(b, A * B)
        q_cos, q_sin = self._rope(block_pos, x.dtype, x.device)  # [b, A*B, d]
        c_cos, c_sin = self._rope(torch.arange(L, device=x.device), x.dtype, x.device)
        q_cos, q_sin, c_cos, c_sin = q_cos[:, None], q_sin[:, None], c_cos, c_sin
        mask = training_block_mask(anchors, L, B)
        for layer in self.layers:
            ctx_k, ctx_v = layer.self_attn.kv(ctx, c_cos, c_sin)
            x = layer(x, q_cos, q_sin, ctx_k, ctx_v, mask)
        h = self.norm(x).view(b, A, B, -1)[:, :, 1:]
        return self.lm_head(h)

    # -- serving: context cache + one forward per block ---------------------------------------------------------------
    def setup_cache(self, max_seq_len: int, window: int | None = -1, dtype=None, device=None):
        """Allocate the context cache. window: -1 the config's sliding_window, None full attention, or W."""
        w = self.norm.weight  # a dense tensor even when the Linears are quantized
        dtype, device = dtype or w.dtype, device or w.device
        cfg = self.config
        window = cfg.sliding_window if window == -1 else window
        if window is not None and window < 2:
            raise SpecquantError(f"drafter window {window} must be at least 2 (or None for full attention)")
        self.window = window if window is not None and window < max_seq_len else None
        # + block_size: the one-call layers write the block's own K/V past the context (native_layer.block_step);
        # in a ring the block's slots then lie below every position a rollback of up to APPEND_CHUNK still shows
        ring = max_seq_len if self.window is None else min(max_seq_len, self.window + APPEND_CHUNK)
        capacity = ring + cfg.block_size
        for layer in self.layers:
            layer.self_attn.context_cache = ContextCache(cfg.num_key_value_heads, capacity, cfg.head_dim, dtype, device)
        self.context_len = 0

    def clear_cache(self):
        for layer in self.layers:
            layer.self_attn.context_cache = None
        self.context_len, self.window = 0, None

    def rollback(self, length: int):
        """Forget context positions >= length (O(1): later writes overwrite them)."""
        if not 0 <= length <= self.context_len:
            raise ValueError(f"cannot roll the drafter's context back to {length}; it holds {self.context_len}")
        if self.window is not None and self.context_len - length > APPEND_CHUNK:
            raise ValueError(f"ring cache can roll back at most {APPEND_CHUNK} positions")
        self.context_len = length

    def append_context(self, features: torch.Tensor):
        """Add the target features [1, T, taps*hidden] of positions context_len .. context_len+T-1."""
        if self.window is not None and self.layers:
            # a ring keeps the last `capacity` positions: earlier ones would be overwritten by this same call, so
            # they are not projected at all (the ring ends up holding the same K/V)
            skip = max(0, features.shape[1] - self.layers[0].self_attn.context_cache.capacity)
            self.context_len += skip
            features = features[:, skip:]
        step = APPEND_CHUNK if self.window is not None else features.shape[1]
        for i in range(0, features.shape[1], max(step, 1)):
            chunk = features[:, i : i + step]
            start, t = self.context_len, chunk.shape[1]
            ctx = self.project_context(chunk)
            cos, sin = self._rope(torch.arange(start, start + t, device=ctx.device), ctx.dtype, ctx.device)
            for layer in self.layers:
                attn = layer.self_attn
                if attn.context_cache is None:
                    raise RuntimeError("block drafter: setup_cache() before append_context()")
                if self.window is None and start + t > attn.context_cache.capacity:
                    raise ValueError(f"drafter context cache holds {attn.context_cache.capacity} positions; asked for "
                                     f"{start + t}")
                attn.context_cache.write(start, *attn.kv(ctx, cos, sin))
            self.context_len = start + t

    def propose(self, anchor: torch.Tensor, num_tokens: int | None = None,
                context: torch.Tensor | None = None) -> torch.Tensor:
        """anchor: the last emitted token id (0-dim), at position n = context_len once `context` is in. Returns logits
        [num_tokens, vocab] for positions n+1 .. n+num_tokens (default: block_size - 1). context: target features
        [1, T, taps*hidden] of the next T positions, not yet appended (the drafter's pending ones): appended by this
        forward, each layer writing their K/V in the same call as the block's where it runs as one native call
        (model/native_layer.py block_step: the layer's weights stream once for both), else as append_context does.

        The whole trained block (anchor + B-1 masks) always runs, because attention inside it is bidirectional:
        a shorter block would not be the computation the drafter was trained on. Only the lm_head is cut to k.
        A query at p sees context positions (p - W, n) under a window W, and the whole block.
        """
        B = self.config.block_size
        k = B - 1 if num_tokens is None else num_tokens
        if not 1 <= k <= B - 1:
            raise SpecquantError(f"block drafter proposes 1..{B - 1} tokens per forward; asked for {k}")
        ctx = None
        if context is not None and context.shape[1]:
            if context.shape[1] + B > NATIVE_MAX_ROWS or context.shape[1] > APPEND_CHUNK:
                self.append_context(context)  # too many rows for one call with the block
            else:
                ctx = self.project_context(context)
        c = 0 if ctx is None else ctx.shape[1]
        n = self.context_len + c
        capacity = self.layers[0].self_attn.context_cache.capacity if self.layers else n + B
        if self.window is None and n + B > capacity:  # a full cache does not wrap (append_context's check)
            raise ValueError(f"drafter context cache holds {capacity - B} positions; asked for {n}")
        x = self.block_embeddings(anchor.reshape(1))  # [1, B, hidden]
        pos = torch.arange(n - c, n + B, device=x.device)  # the new context rows', then the block's
        cos, sin = self._rope(pos, x.dtype, x.device)
        block_cos, block_sin, pos = cos[c:], sin[c:], pos[c:]
        window = self.window
        first = 0 if window is None else max(0, n - window + 1)
        mask = None
        if window is not None and n + B > window:  # some query's window starts after position 0
            kpos = torch.arange(first, n, device=x.device)
            ctx_vis = kpos[None, :] > pos[:, None] - window  # [B, n-first]
            mask = torch.cat((ctx_vis, torch.ones(B, B, dtype=torch.bool, device=x.device)), 1)
        for layer in self.layers:
            out = native_layer.block_step(layer, x, cos, sin, ctx, n, window)
            if out is None:
                attn = layer.self_attn
                if ctx is not None:
                    attn.context_cache.write(n - c, *attn.kv(ctx, cos[:c], sin[:c]))
                ctx_k, ctx_v = attn.context_cache.read(first, n)
                out = layer(x, block_cos, block_sin, ctx_k, ctx_v, mask, (n, first, window))
            x = out
        self.context_len = n
        return self.lm_head(self.norm(x[0, 1 : k + 1]))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def training_block_mask(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """anchors [b, A] -> bool [b, 1, A*B, L + A*B]: block i sees context positions < a_i and all of block i."""
    b, A = anchors.shape
    qb = torch.arange(A * block_size, device=anchors.device) // block_size  # block of each query
    ctx = torch.arange(context_len, device=anchors.device)[None, None, :] < anchors.gather(1, qb[None].expand(b, -1))[
        :, :, None]  # [b, A*B, L]
    same = (qb[:, None] == qb[None, :])[None].expand(b, -1, -1)  # [b, A*B, A*B]
    return torch.cat((ctx, same), 2)[:, None]
