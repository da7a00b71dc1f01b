"""ModelConfig: the one home of the decoder's architecture fields, read from an HF config.json."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from specquant.errors import SpecquantError

# Families the lean decoder implements; their differences are data, not code paths.
FAMILIES: dict[str, dict[str, Any]] = {
    # qkv_bias: q/k/v projections carry a bias (Qwen2); qk_norm: RMSNorm on per-head q and k (Qwen3).
    "llama": {"qkv_bias": None, "qk_norm": False},  # None: read `attention_bias` from the config
    "qwen2": {"qkv_bias": True, "qk_norm": False},
    "qwen3": {"qkv_bias": None, "qk_norm": True},
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
DEFAULT_LAYER_TYPE = "full_attention"  # the layer kind of a dense decoder's every layer
# config.json keys that are not dataclass fields but are interpreted by from_hf or written by to_hf
# (quantization_config describes the weights, not the architecture: the loader hands it to Transformer.quantization)
_INTERPRETED_KEYS = ("architectures", "hidden_act", "attention_bias", "mlp_bias", "rope_parameters",
                     "specquant_sliding_window", "quantization_config")


@dataclass
class ModelConfig:
    model_type: str = "qwen3"
    vocab_size: int = 8192
    hidden_size: int = 512
    intermediate_size: int = 1536
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF rope_scaling / rope_parameters minus rope_theta; None = default RoPE
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = True
    sliding_window: int | None = None  # attend to the last W positions only (ring-buffer KV cache)
    # the layer kind of each layer (model/layers.py's LAYER_KINDS), as config.json's `layer_types`; empty: every
    # layer is DEFAULT_LAYER_TYPE (kept empty then, so that changing num_hidden_layers needs no list)
    layer_types: tuple[str, ...] = ()
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = 0
    extra: dict = field(default_factory=dict)  # config.json keys we keep but do not interpret

    def __post_init__(self):
        # imported here: layers.py imports the mixers, and they import this module
        from specquant.model.layers import LAYER_KINDS

        self.layer_types = tuple(self.layer_types)
        unknown = sorted(set(self.layer_types) - set(LAYER_KINDS))
        if unknown:
            raise SpecquantError(f"layer_types has unknown layer kinds {unknown}; supported: {', '.join(LAYER_KINDS)}")
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise SpecquantError(f"layer_types lists {len(self.layer_types)} layers but num_hidden_layers is "
                                 f"{self.num_hidden_layers}; give one kind per layer")

    @property
    def per_layer_types(self) -> tuple[str, ...]:
        """The layer kind of every layer (layer_types, or the default for each)."""
        return self.layer_types or (DEFAULT_LAYER_TYPE,) * self.num_hidden_layers

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Build from an HF config.json dict; raises SpecquantError on unsupported architectures."""
        model_type = hf.get("model_type")
        if model_type not in FAMILIES:
            raise SpecquantError(
                f"unsupported model_type {model_type!r} in config.json; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        fam = FAMILIES[model_type]
        if hf.get("hidden_act", "silu") not in ("silu", "swish"):
            raise SpecquantError(
                f"hidden_act {hf['hidden_act']!r} in config.json is not supported; the decoder's MLP uses silu"
            )
        heads = hf["num_attention_heads"]
        hidden = hf["hidden_size"]
        head_dim = hf.get("head_dim") or hidden // heads
        attention_bias = bool(hf.get("attention_bias", False))
        qkv_bias = attention_bias if fam["qkv_bias"] is None else fam["qkv_bias"]
        # Llama's attention_bias also covers o_proj; Qwen3's covers q/k/v/o too; Qwen2 has bias on q/k/v only.
        o_bias = attention_bias if model_type in ("llama", "qwen3") else False
        rope_theta, rope_scaling = _read_rope(hf)
        window = None
        if hf.get("use_sliding_window") and hf.get("sliding_window"):
            raise SpecquantError(
                f"config.json sets use_sliding_window with sliding_window={hf['sliding_window']}; per-layer windows "
                "(max_window_layers) are not supported: set use_sliding_window to false"
            )
        if model_type not in ("qwen2", "qwen3") and hf.get("sliding_window"):
            window = int(hf["sliding_window"])
        if hf.get("specquant_sliding_window"):
            window = int(hf["specquant_sliding_window"])
        # Keys read above or rewritten by to_hf() are not "extra": keeping them there made from_hf(to_hf(c)) != c.
        known = {f.name for f in dataclasses.fields(cls)} | set(_INTERPRETED_KEYS)
        extra = {k: v for k, v in hf.items() if k not in known}
        layer_types = tuple(hf.get("layer_types") or ())
        if layer_types and len(layer_types) == hf["num_hidden_layers"] and set(layer_types) == {DEFAULT_LAYER_TYPE}:
            layer_types = ()  # the default, spelled out (transformers writes it for every Qwen config)
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=fam["qk_norm"],
            sliding_window=window,
            layer_types=layer_types,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            extra=extra,
        )

    def to_hf(self) -> dict:
        """The config.json dict transformers reads for this architecture."""
        hf = dict(self.extra)
        hf.update(
            model_type=self.model_type,
            architectures=[{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[
                self.model_type
            ]],
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            hidden_act="silu",
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
        )
        hf.pop("rope_parameters", None)
        if self.model_type in ("llama", "qwen3"):
            hf["attention_bias"] = self.qkv_bias
        if self.model_type == "llama":
            hf["mlp_bias"] = self.mlp_bias
        if self.sliding_window:
            hf["specquant_sliding_window"] = self.sliding_window
        if self.layer_types:
            hf["layer_types"] = list(self.layer_types)
        return hf

    @property
    def eos_ids(self) -> tuple[int, ...]:
        e = self.eos_token_id
        if e is None:
            return ()
        return tuple(e) if isinstance(e, (list, tuple)) else (int(e),)


def _read_rope(hf: dict) -> tuple[float, dict | None]:
    """transformers 4.x writes rope_theta + rope_scaling; 5.x writes rope_parameters. Accept both."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and params:
        params = dict(params)
        theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = params.get("rope_type", params.get("type", "default"))
        return theta, (None if rope_type == "default" else params)
    theta = float(hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling")
    if scaling:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "default":
            scaling = None
    return theta, scaling or None
