"""Qwen3.5's multi-token-prediction (MTP) layer: the one-layer head Qwen3.5 checkpoints ship as `mtp.*`.

As vLLM defines it (vllm/model_executor/models/qwen3_5_mtp.py, Qwen3_5MultiTokenPredictor; the same module as
qwen3_next_mtp.py's Qwen3NextMultiTokenPredictor), for a position i with the hidden state h_i and the NEXT token
x_{i+1}:
    e = pre_fc_norm_embedding(embed(x_{i+1}))          zero-centred RMSNorm (1 + w), as every Qwen3.5 norm
    h = pre_fc_norm_hidden(h_i)
    y = fc(cat([e, h]))                                 [2H] -> [H], no bias; the EMBEDDING comes first
    y = layers.0(y)                                     one decoder layer of the full-attention kind (gated
                                                        attention + SwiGLU MLP), at position i, with its own KV cache
    g_i = norm(y)                                       the MTP's output hidden state
    logits of x_{i+2} = lm_head(g_i)                    the target's lm_head (tied: its embedding), shared
The embedding and lm_head are the target's: vLLM's loader maps only mtp.* into this module and takes embed_tokens /
lm_head from the target's tensors, so an `mtp.*` set holds exactly the names of `MTPModel.state_dict()` with the
prefix `mtp.` (fc, pre_fc_norm_embedding, pre_fc_norm_hidden, layers.0.{input_layernorm, self_attn.{q,k,v,o}_proj,
self_attn.{q,k}_norm, post_attention_layernorm, mlp.{gate,up,down}_proj}, norm).

Hidden-state convention: h_i is the target's hidden state AFTER its final norm. vLLM's Qwen3NextModel.forward
(vllm/model_executor/models/qwen3_next.py, also Qwen3.5's language model) returns `self.norm(hidden_states,
residual)`, and that return value is what the speculative proposer (vllm/v1/spec_decode) hands the MTP as
hidden_states; the MTP then normalises it again with its own pre_fc_norm_hidden. Chaining (k > 1): the next step
reads g_i, the MTP's own output after mtp.norm, at position i+1 with the token it just drafted (vLLM's proposer
feeds the draft model's returned hidden states back in).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from specquant.errors import SpecquantError
from specquant.model.checkpoint import copy_tokenizer, load_dense_into, load_tensors, read_hf_config, resolve
from specquant.model.config import DEFAULT_LAYER_TYPE, ModelConfig
from specquant.model import native_layer
from specquant.model.decoder import DecoderLayer
from specquant.model.layers import GATED_KINDS
from specquant.model.modules import Linear, make_norm
from specquant.model.rope import rope_tables
from specquant.util.files import atomic_dir

PREFIX = "mtp."  # the checkpoint prefix of the MTP tensors (model.checkpoint.KEPT_PREFIXES keeps them)
ARCHITECTURE = "Qwen3_5MTP"  # config.json `architectures` of an MTP drafter directory (vLLM's class name)
HEADS = ("shared", "bf16", "w8", "w4")  # the head an MTP drafter drafts with: the target's lm_head, or its own copy
HEAD_KEY = "specquant_mtp_head"  # config.json of an MTP drafter directory: which of HEADS


class MTPModel(nn.Module):
    """forward(hidden [B, T, H] (post-norm), next_embeds [B, T, H], start_pos) -> g [B, T, H] (post mtp.norm).

    With a cache (setup_cache) the layer attends to every earlier position it holds; without one (training) the T
    positions attend causally to each other only."""

    def __init__(self, cfg: ModelConfig, num_layers: int = 1):
        super().__init__()
        if num_layers < 1:
            raise SpecquantError(f"mtp_num_hidden_layers={num_layers} must be at least 1")
        self.config = cfg
        h = cfg.hidden_size
        kind = GATED_KINDS[DEFAULT_LAYER_TYPE] if cfg.attn_output_gate else DEFAULT_LAYER_TYPE
        self.pre_fc_norm_embedding = make_norm(cfg, h)
        self.pre_fc_norm_hidden = make_norm(cfg, h)
        self.fc = Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, kind) for _ in range(num_layers))
        self.norm = make_norm(cfg, h)
        # config.json `quantization_config` of these weights (None: dense); set by whoever quantizes / loads them
        self.quantization: dict | None = None
        self._set_rope(cfg.max_position_embeddings)

    def _set_rope(self, length: int, device=None):
        cfg = self.config
        cos, sin = rope_tables(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings, length)
        device = device or self.fc.weight.device
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)

    def setup_cache(self, batch: int, max_seq_len: int, dtype=None, device=None):
        """A full-attention KV cache per layer for up to max_seq_len positions (reused when it fits)."""
        w = self.pre_fc_norm_hidden.weight
        dtype, device = dtype or w.dtype, torch.device(device or w.device)
        for layer in self.layers:
            mixer = layer.mixer
            if mixer.cache is not None and mixer.cache.fits(batch, max_seq_len, dtype, device, None, False):
                mixer.cache.reset()
            else:
                mixer.cache = None
                mixer.cache = mixer.make_cache(batch, max_seq_len, dtype, device, None, False)
        if self.rope_cos.shape[0] < max_seq_len or self.rope_cos.device != device:
            self._set_rope(max(max_seq_len, self.config.max_position_embeddings), device)

    def rollback(self, length: int):
        """Forget positions >= length (a K/V cache only records it)."""
        for layer in self.layers:
            if layer.mixer.cache is not None:
                layer.mixer.cache.rollback(length)

    def clear_cache(self):
        for layer in self.layers:
            layer.mixer.cache = None

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor, start_pos: int = 0, layer: int = 0,
                positions: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """layer: which MTP layer runs (vLLM: spec_step_idx % num_layers; Qwen3.5 ships one).

        positions [T] / mask [T, T] bool (cache-free only): each entry's RoPE position and which entries it attends
        to, instead of start_pos.. and the causal mask; training replays chained drafts with them (train/mtp.py)."""
        t = hidden.shape[1]
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        plan = None
        if positions is None:
            cos, sin = self.rope_cos[start_pos : start_pos + t], self.rope_sin[start_pos : start_pos + t]
        else:
            assert mask is not None and all(m.mixer.cache is None for m in self.layers), "cache-free only"
            cos, sin, plan = self.rope_cos[positions], self.rope_sin[positions], (mask, False)
        block = self.layers[layer % len(self.layers)]
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        # the layer in one native call where it runs (model/native_layer.py: fused projections, a cached step), as
        # the target's layers; else its modules
        out = native_layer.step(block, x, cos, sin, start_pos) if positions is None else None
        return self.norm(block(x, cos, sin, start_pos, None, plan) if out is None else out)


def mtp_layers_in(tensors: dict[str, torch.Tensor]) -> int:
    """How many MTP layers a set of mtp.* tensors holds (0: none)."""
    ids = {int(k[len(PREFIX + "layers."):].split(".")[0]) for k in tensors if k.startswith(PREFIX + "layers.")}
    return max(ids) + 1 if ids else 0


def split_mtp(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """mtp.* tensors -> MTPModel state-dict names (the prefix dropped); other names are left out."""
    return {k[len(PREFIX):]: v for k, v in tensors.items() if k.startswith(PREFIX)}


def mtp_from_tensors(cfg: ModelConfig, tensors: dict[str, torch.Tensor], dtype=torch.float32,
                     device="cpu") -> MTPModel:
    """A dense MTPModel for the target config cfg from its checkpoint's mtp.* tensors (vLLM's names)."""
    layers = mtp_layers_in(tensors)
    if not layers:
        raise SpecquantError("the checkpoint has no mtp.* tensors (Qwen3.5's MTP layer); use a Qwen3.5 checkpoint "
                             "that ships them, or train one with `specquant distill draft --kind mtp`")
    with torch.device("meta"):
        model = MTPModel(cfg, layers)
    model.to_empty(device=device).to(dtype)
    load_dense_into(model, split_mtp(tensors))
    model._set_rope(cfg.max_position_embeddings, device)
    return model.eval()


def mtp_tensors(model: MTPModel, tensors: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The model's weights (or `tensors`, a state dict of it) under their checkpoint names (mtp.*)."""
    sd = tensors if tensors is not None else model.state_dict()
    return {PREFIX + k: v.detach().contiguous() for k, v in sd.items()}


def is_mtp_config(hf: dict) -> bool:
    return ARCHITECTURE in (hf.get("architectures") or [])


def mtp_config_json(model: MTPModel, extra_config: dict | None = None) -> dict:
    """config.json of an MTP drafter directory: the target's text config (the layer's shape, RoPE, vocabulary),
    `architectures` [Qwen3_5MTP] and mtp_num_hidden_layers (Qwen3_5TextConfig's field)."""
    hf = model.config.to_hf()
    hf["architectures"] = [ARCHITECTURE]
    hf["mtp_num_hidden_layers"] = len(model.layers)
    if model.quantization:
        hf["quantization_config"] = model.quantization
    hf.update(extra_config or {})
    return hf


def save_mtp_drafter(model: MTPModel, out, tensors: dict[str, torch.Tensor] | None = None,
                     extra_config: dict | None = None, tokenizer_from=None, overwrite: bool = False):
    """Write an MTP drafter directory atomically: config.json (mtp_config_json) + model.safetensors holding the
    mtp.* tensors only (the embedding and lm_head are the target's)."""
    hf = mtp_config_json(model, extra_config)
    named = mtp_tensors(model, tensors)
    with atomic_dir(Path(out), overwrite) as tmp:
        save_file({k: v.cpu() for k, v in named.items()}, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
        if tokenizer_from is not None:
            copy_tokenizer(resolve(tokenizer_from), tmp)
    return Path(out)


def load_mtp_dense(name_or_dir, dtype=torch.float32, device="cpu") -> MTPModel:
    """A dense MTP drafter directory (quantized ones: specquant.drafter_loader.load_mtp_drafter)."""
    path = resolve(name_or_dir)
    hf = read_hf_config(path)
    if not is_mtp_config(hf):
        raise SpecquantError(f"{path} is not an MTP drafter (config.json architectures {hf.get('architectures')}); "
                             f"pass a directory written by `specquant distill draft --kind mtp`")
    model = mtp_from_tensors(ModelConfig.from_hf(hf), load_tensors(path), dtype, device)
    model.source_path = path
    return model
