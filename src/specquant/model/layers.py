"""Layer kinds: which mixer each entry of config.json's `layer_types` builds. A new kind is one file and one row.

A layer is input_layernorm -> mixer -> residual -> post_attention_layernorm -> MLP -> residual (DecoderLayer); the
mixer is what differs between kinds (attention, a recurrent layer). A mixer is an nn.Module with:
- `__init__(cfg: ModelConfig)`;
- `forward(x [batch, T, hidden], cos, sin, start_pos: int, input_pos [T] | None, plan) -> [batch, T, hidden]`:
  a mixer that does not use RoPE (cos, sin [T, head_dim]) or a plan ignores them;
- `make_cache(batch, capacity, dtype, device, window, static, max_block)`: a new cache of this kind (the protocol
  in model/cache.py), or None for a kind without decode state; max_block is the longest forward a caller may roll
  back into (kinds whose cache does not need it ignore it);
- `cache`: the installed cache, or None (Transformer.setup_cache / clear_cache assign it);
- optionally `plan(start_pos, t, dtype, device)`: work every layer of this kind shares within one step, built once
  per step by the first layer of the kind and passed to each of them as `plan` (None on static caches).
`attr` is the module name the kind's checkpoints use (`model.layers.N.<attr>.*`), so HF state dicts load as they are.
Mixer files import their building blocks from model.modules (not model.decoder, which imports this table).

Keys are config.json's `layer_types` entries, with one internal variant: on a config with attn_output_gate
(Qwen3.5) a "full_attention" entry builds GATED_KINDS["full_attention"] instead, so the choice is data read from
the config (layer_kinds), not a branch in the decoder.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from specquant.errors import SpecquantError
from specquant.model.attention import Attention
from specquant.model.config import ModelConfig
from specquant.model.deltanet import GatedDeltaNet
from specquant.model.gated_attention import GatedAttention


@dataclass(frozen=True)
class LayerKind:
    attr: str  # module name in the layer and in checkpoints (self_attn, linear_attn, ...)
    mixer: type[nn.Module]


LAYER_KINDS: dict[str, LayerKind] = {
    "full_attention": LayerKind(attr="self_attn", mixer=Attention),
    "linear_attention": LayerKind(attr="linear_attn", mixer=GatedDeltaNet),  # Qwen3.5's Gated DeltaNet
    "gated_attention": LayerKind(attr="self_attn", mixer=GatedAttention),  # internal: see GATED_KINDS
}
# config.json entry -> the kind it builds when the config sets attn_output_gate
GATED_KINDS = {"full_attention": "gated_attention"}


def config_layer_types() -> tuple[str, ...]:
    """The kinds config.json's layer_types may name (the table's keys, less the internal gated variants)."""
    return tuple(k for k in LAYER_KINDS if k not in GATED_KINDS.values())


def layer_kinds(cfg: ModelConfig) -> tuple[str, ...]:
    """The layer kind (a LAYER_KINDS key) of every layer: cfg.layer_types (the default kind for each when empty),
    read through GATED_KINDS when the config gates its attention. A name the table lacks is a one-line error."""
    types = cfg.per_layer_types_hf
    unknown = sorted(set(types) - set(config_layer_types()))
    if unknown:
        raise SpecquantError(f"unsupported layer_types {unknown} in config.json; supported: "
                             f"{', '.join(config_layer_types())}")
    return tuple(GATED_KINDS.get(t, t) for t in types) if cfg.attn_output_gate else types
