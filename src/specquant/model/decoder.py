"""Lean decoder for the Llama / Qwen2 / Qwen3 dense families and the Qwen3.5 hybrid, with per-layer caches and
explicit positions.

Module names mirror transformers' (`model.layers.N.self_attn.q_proj`, ...), so HF state dicts load as they are.
Each layer's mixer comes from the layer-kind table (model/layers.py) keyed by the config's layer_types; attention
is in model/attention.py, the shared building blocks in model/modules.py, the caches in model/cache.py (all
re-exported here).

Cache contract: `forward(tokens, start_pos)` writes each layer's state for positions start_pos .. start_pos+T-1 and
reads every earlier position still held. The caller owns the sequence length and announces a rollback to an earlier
length L with `rollback(L)`; the next forward starts at L. Rollback is a method, not index arithmetic in the caller,
so a layer whose state cannot be rolled back by position (linear attention in hybrid models) can restore its state
there (model/cache.py); a K/V cache only records it (O(1): stale entries past L are overwritten before they are
read). With `sliding_window=W` a K/V cache is a ring of W + max_block - 1 slots: position p lives in slot
p % capacity, each query sees only (p-W, p], and memory and per-step attention cost stay bounded by W.

The model owns its caches: `setup_cache` has every mixer make its own, and callers go through `caches`,
`setup_cache`, `reset_cache`, `begin_step`, `rollback`, `clear_cache`, `cache_layout`, `cache_batch` and
`cache_capacity` only.
"""

from __future__ import annotations

import torch
from torch import nn

from specquant.model import native_layer
from specquant.model.attention import FOLD_MAX_ROWS, FOLD_MIN_ROWS, Attention, attention_mask
from specquant.model.cache import Cache, KVCache
from specquant.model.config import DEFAULT_LAYER_TYPE, ModelConfig
from specquant.model.layers import LAYER_KINDS, layer_kinds
from specquant.model.modules import MLP, SMALL_MIN_WEIGHT, SMALL_ROWS, Linear, RMSNorm, add_norm, make_norm
from specquant.model.rope import rope_tables
from specquant.model.tree import TreeLayout

__all__ = ["FOLD_MAX_ROWS", "FOLD_MIN_ROWS", "MLP", "SMALL_MIN_WEIGHT", "SMALL_ROWS", "Attention", "Body", "Cache",
           "DecoderLayer", "KVCache", "Linear", "RMSNorm", "Transformer", "attention_mask"]


class DecoderLayer(nn.Module):
    """x + mixer(norm(x)), then x + MLP(norm(x)); the mixer is layer_type's (model/layers.py), held under the name
    its checkpoints use (`self_attn` for attention) and reached as `mixer`."""

    def __init__(self, cfg: ModelConfig, layer_type: str = DEFAULT_LAYER_TYPE):
        super().__init__()
        kind = LAYER_KINDS[layer_type]
        self.layer_type, self.mixer_attr = layer_type, kind.attr
        self.input_layernorm = make_norm(cfg, cfg.hidden_size)
        setattr(self, kind.attr, kind.mixer(cfg))
        self.post_attention_layernorm = make_norm(cfg, cfg.hidden_size)
        self.mlp = MLP(cfg)

    @property
    def mixer(self) -> nn.Module:
        return self._modules[self.mixer_attr]

    def forward(self, x, cos, sin, start_pos, input_pos=None, plan=None, tree: TreeLayout | None = None):
        # the residual add and the second norm in one call where kernels.ops runs them (modules.add_norm)
        h = self.input_layernorm(x)
        mixed = (self.mixer(h, cos, sin, start_pos, input_pos, plan) if tree is None
                 else self.mixer(h, cos, sin, start_pos, tree=tree))
        x, h = add_norm(self.post_attention_layernorm, x, mixed)
        return x + self.mlp(h)


class Body(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, kind) for kind in layer_kinds(cfg))
        self.norm = make_norm(cfg, cfg.hidden_size)


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
        # checkpoint tensors the decoder does not run (Qwen3.5's mtp.* head; model.checkpoint.KEPT_PREFIXES), as
        # loaded: kept for a drafter that reads them, and saved back by save_model
        self.extra_tensors: dict[str, torch.Tensor] = {}
        self._set_rope(cfg.max_position_embeddings)

    def _set_rope(self, length: int):
        cfg = self.config
        cos, sin = rope_tables(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings, length)
        device = self.model.embed_tokens.weight.device
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)

    def setup_cache(self, batch_size: int, max_seq_len: int, max_block: int = 64, dtype=None, device=None,
                    window: int | None = -1, static: bool = False):
        """Give every layer its cache for sequences of up to max_seq_len positions, reusing the ones already there.

        Buffers are allocated once and reused by every request that fits (as gpt-fast's setup_caches): the same
        tensors, so compiled steps are not recompiled per request. They are reallocated only when a request needs
        more positions, or another batch size, dtype, device, window or layout.
        window: attend to the last W positions (-1: the config's sliding_window; None: full attention). A windowed
        model gets a ring of W + max_block - 1 slots whatever max_seq_len is; it takes at most max_block tokens per
        forward, and a caller may roll back by up to max_block - 1 positions past what it wrote since.
        static: attention always spans the whole buffer under a mask built from tensors, so a step's shapes do
        not depend on the position (what torch.compile / CUDA graphs need); the sliced path is its reference.
        """
        capacity, window, dtype, device = self._cache_args(max_seq_len, max_block, dtype, device, window)
        self.max_block = None if window is None else max_block
        installed = [c for c in self.caches() if c is not None]
        if installed and all(c.fits(batch_size, capacity, dtype, device, window, static, max_block)
                             for c in installed):
            self.reset_cache()
        else:
            for mixer in self.mixers():
                mixer.cache = None  # the old buffers go before the new ones are allocated
                mixer.cache = mixer.make_cache(batch_size, capacity, dtype, device, window, static, max_block)
        self.static_cache = static
        if self.rope_cos.shape[0] < max_seq_len or self.rope_cos.device != device:
            self._set_rope(max(max_seq_len, self.config.max_position_embeddings))
            self.rope_cos, self.rope_sin = self.rope_cos.to(device), self.rope_sin.to(device)

    def _cache_args(self, max_seq_len: int, max_block: int, dtype, device, window: int | None
                    ) -> tuple[int, int | None, torch.dtype, torch.device]:
        """setup_cache's rules: (capacity, window, dtype, device) of the caches it makes for these arguments."""
        w = self.model.embed_tokens.weight
        window = self.config.sliding_window if window == -1 else window
        window = window or None
        capacity = max_seq_len if window is None else window + max_block - 1
        return capacity, window, dtype or w.dtype, torch.device(device or w.device)

    def make_caches(self, batch_size: int, max_seq_len: int, max_block: int = 64, dtype=None, device=None,
                    window: int | None = -1, static: bool = False) -> list[Cache | None]:
        """New caches, one per layer (None for a layer kind without state), as setup_cache would make them for
        these arguments, without installing them."""
        capacity, window, dtype, device = self._cache_args(max_seq_len, max_block, dtype, device, window)
        return [m.make_cache(batch_size, capacity, dtype, device, window, static, max_block) for m in self.mixers()]

    def cache_layout(self, batch_size: int, max_seq_len: int, max_block: int = 64, dtype=None, device=None,
                     window: int | None = -1, static: bool = False) -> dict:
        """JSON-able layout of the caches setup_cache makes for these arguments: the device, the largest block a
        forward takes whole (ring caches), and every layer's `Cache.layout()` (None: no state). Built from caches
        made on the meta device, so a compiled step can be keyed on the caches before they exist."""
        _, window, dtype, device = self._cache_args(max_seq_len, max_block, dtype, device, window)
        caches = self.make_caches(batch_size, max_seq_len, max_block, dtype, "meta", window, static)
        return {"device": str(device), "max_block": None if window is None else max_block,
                "layers": [None if c is None else c.layout() for c in caches]}

    def begin_step(self, start_pos: int | None, t: int):
        """Announce a static-cache forward of t tokens at start_pos (None: where the caches are) that is given
        input_pos: a compiled, AOT-packaged or CUDA-graph step, whose caller runs this eagerly first (as it runs
        rollback after), so that a cache's Python bookkeeping (Cache.begin) happens once per step and outside
        the traced or captured code. forward does it itself when it is given start_pos alone."""
        if not self.static_cache:
            return
        for cache in self.caches():
            if cache is not None:
                cache.begin(start_pos, t)

    def mixers(self) -> list[nn.Module]:
        """Every layer's mixer (model/layers.py), in layer order."""
        return [layer.mixer for layer in self.model.layers]

    def caches(self) -> list[Cache | None]:
        """Every layer's installed cache, in layer order (None: not set up, or a layer kind without state)."""
        return [layer.mixer.cache for layer in self.model.layers]

    def cache_batch(self) -> int | None:
        """The batch size the installed caches hold (None: no caches)."""
        return next((c.batch for c in self.caches() if c is not None), None)

    def cache_capacity(self) -> int | None:
        """Positions (a ring's: slots) the installed caches hold, the smallest of any layer's (None: no caches)."""
        capacities = [c.capacity for c in self.caches() if c is not None]
        return min(capacities) if capacities else None

    def reset_cache(self):
        """Start a new sequence in the installed caches' buffers (the same tensors: compiled steps stay bound)."""
        for cache in self.caches():
            if cache is not None:
                cache.reset()

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
        for cache in self.caches():
            if cache is not None:
                cache.rollback(length)

    def commit_tree(self, start: int, path: list[int]):
        """After a tree forward at start (forward's tree): the sequence continues from the root path `path`
        (node ids, the root first), at length start + len(path); every other node is forgotten."""
        for cache in self.caches():
            if cache is not None:
                cache.commit_tree(start, path)

    def clear_cache(self):
        """Drop every cache: forwards are cache-free again (training, scoring whole sequences)."""
        self.static_cache = False
        for mixer in self.mixers():
            mixer.cache = None
        self.max_block = None

    def forward(self, tokens: torch.Tensor, start_pos: int = 0, last_only: bool = False,
                input_pos: torch.Tensor | None = None, hidden_layers: tuple[int, ...] = (),
                hidden_only: bool = False, tree: TreeLayout | None = None):
        """tokens [batch, T] at positions start_pos.. (or input_pos [T], static caches) -> logits [batch, T or 1, vocab].

        hidden_layers: ids of decoder layers (0-based) whose outputs to return as well, for drafters that read the
        target's hidden states (a DFlash block drafter): then (logits, hidden [batch, T, len(hidden_layers),
        hidden_size]), every position even with last_only. Empty (default): logits only, no extra work.
        hidden_only: return the final-norm hidden states [batch, T, hidden] instead of logits, so a loss can apply
        lm_head in chunks of positions (train/qad.py's chunked KL) without ever holding [batch, T, vocab].
        tree: the T tokens are the nodes of a token tree rooted at start_pos (model/tree.py), each scored as the end
        of its root path; the caches keep the nodes until `commit_tree` picks a path. Full sliced caches only.
        """
        t = tokens.shape[1]
        if tree is not None:
            if self.static_cache or self.max_block is not None:
                raise ValueError("a tree forward runs on full, sliced caches (setup_cache(window=None, static=False))")
            assert len(tree) == t, f"{t} tokens for a tree of {len(tree)} nodes"
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
                self.begin_step(start_pos, t)
                input_pos = torch.arange(start_pos, start_pos + t, device=tokens.device)
            cos, sin = self.rope_cos[input_pos].to(x.dtype), self.rope_sin[input_pos].to(x.dtype)
        elif tree is not None:
            pos = tree.positions(start_pos, tokens.device)
            cos, sin = self.rope_cos[pos].to(x.dtype), self.rope_sin[pos].to(x.dtype)
        else:
            cos = self.rope_cos[start_pos : start_pos + t].to(x.dtype)
            sin = self.rope_sin[start_pos : start_pos + t].to(x.dtype)
        # what every layer of a kind shares in a sliced-cache step (attention's mask, whether it folds) is built
        # once per step, by the first layer of the kind that runs its modules
        plans = {}
        hidden = {}
        native = tree is None and input_pos is None
        for i, layer in enumerate(self.model.layers):
            # the whole layer in one native call where it runs (model/native_layer.py), else its modules
            out = native_layer.step(layer, x, cos, sin, start_pos) if native else None
            if out is None:
                kind = layer.layer_type
                if kind not in plans:
                    plan = None if self.static_cache or tree is not None else getattr(layer.mixer, "plan", None)
                    plans[kind] = None if plan is None else plan(start_pos, t, x.dtype, x.device)
                out = layer(x, cos, sin, start_pos, input_pos, plans[kind], tree)
            x = out
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
