"""Layer kinds: which mixer each entry of config.json's `layer_types` builds. A new kind is one file and one row.

A layer is input_layernorm -> mixer -> residual -> post_attention_layernorm -> MLP -> residual (DecoderLayer); the
mixer is what differs between kinds (attention, a recurrent layer). A mixer is an nn.Module with:
- `__init__(cfg: ModelConfig)`;
- `forward(x [batch, T, hidden], cos, sin, start_pos: int, input_pos [T] | None, plan) -> [batch, T, hidden]`:
  a mixer that does not use RoPE (cos, sin [T, head_dim]) or a plan ignores them;
- `make_cache(batch, capacity, dtype, device, window, static)`: a new cache of this kind (the protocol in
  model/cache.py), or None for a kind without decode state;
- `cache`: the installed cache, or None (Transformer.setup_cache / clear_cache assign it);
- optionally `plan(start_pos, t, dtype, device)`: work every layer of this kind shares within one step, built once
  per step by the first layer of the kind and passed to each of them as `plan` (None on static caches).
`attr` is the module name the kind's checkpoints use (`model.layers.N.<attr>.*`), so HF state dicts load as they are.
Mixer files import their building blocks from model.modules (not model.decoder, which imports this table).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from specquant.model.attention import Attention


@dataclass(frozen=True)
class LayerKind:
    attr: str  # module name in the layer and in checkpoints (self_attn, linear_attn, ...)
    mixer: type[nn.Module]


LAYER_KINDS: dict[str, LayerKind] = {
    "full_attention": LayerKind(attr="self_attn", mixer=Attention),
}
