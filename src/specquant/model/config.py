"""ModelConfig: the one home of the decoder's architecture fields, read from an HF config.json.

Dense families (llama, qwen2, qwen3) and the Qwen3.5 hybrid (qwen3_5_text, or the text part of a qwen3_5
multimodal config) are one dataclass: the hybrid's fields are named as transformers' Qwen3_5TextConfig names them
and switch per-model choices on (zero-centred norms, gated full attention, partial RoPE), never a forked decoder.
"""

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
    # hybrid: Gated DeltaNet + gated full attention (HYBRID_FLAGS below), zero-centred norms, partial RoPE
    "qwen3_5_text": {"qkv_bias": None, "qk_norm": True, "hybrid": True},
}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3_5_text": "Qwen3_5ForCausalLM"}
MULTIMODAL = {"qwen3_5": "qwen3_5_text"}  # wrapper model_type -> its text_config's, the part specquant runs
# what a hybrid family turns on (Qwen3.5: transformers builds every one of them unconditionally)
HYBRID_FLAGS = {"attn_output_gate": True, "zero_centred_norms": True}
HYBRID_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_conv_kernel_dim")
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
DEFAULT_LAYER_TYPE = "full_attention"  # the layer kind of a dense decoder's every layer
# config.json keys that are not dataclass fields but are interpreted by from_hf or written by to_hf
# (quantization_config describes the weights, not the architecture: the loader hands it to Transformer.quantization)
_INTERPRETED_KEYS = ("architectures", "hidden_act", "attention_bias", "mlp_bias", "rope_parameters",
                     "specquant_sliding_window", "quantization_config", "full_attention_interval")


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
    # Qwen3.5 hybrids (set by from_hf for qwen3_5_text; off for the dense families):
    partial_rotary_factor: float = 1.0  # RoPE rotates the first int(head_dim * factor) dims of each head
    attn_output_gate: bool = False  # full_attention layers are GatedAttention (query | gate from q_proj)
    zero_centred_norms: bool = False  # layer, final and q/k norms compute x * (1 + w) (model/norms.py)
    # Gated DeltaNet's shape (linear_attention layers only; model/deltanet.py)
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = 0
    extra: dict = field(default_factory=dict)  # config.json keys we keep but do not interpret

    def __post_init__(self):
        # the names in layer_types are checked against the layer-kind table where layers are built
        # (model/layers.py layer_kinds): this module sits below the table and the mixers it imports
        self.layer_types = tuple(self.layer_types)
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise SpecquantError(f"layer_types lists {len(self.layer_types)} layers but num_hidden_layers is "
                                 f"{self.num_hidden_layers}; give one kind per layer")
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if kv <= 0 or heads % kv:
            raise SpecquantError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}; "
                                 "each KV head serves a whole group of query heads")
        if "linear_attention" in self.layer_types:
            vh, kh = self.linear_num_value_heads, self.linear_num_key_heads
            if kh <= 0 or vh % kh:
                raise SpecquantError(f"linear_num_value_heads={vh} is not a multiple of linear_num_key_heads={kh}; "
                                     "each DeltaNet key head serves a whole group of value heads")
            if self.linear_conv_kernel_dim < 1:
                raise SpecquantError(f"linear_conv_kernel_dim={self.linear_conv_kernel_dim} must be at least 1")
        rot = self.rotary_dim
        if not 0 < rot <= self.head_dim or rot % 2:
            raise SpecquantError(f"partial_rotary_factor={self.partial_rotary_factor} gives {rot} rotary dims of "
                                 f"head_dim={self.head_dim}; it needs an even count in 2..head_dim")

    @property
    def rotary_dim(self) -> int:
        """Dims RoPE rotates (the first ones of each head), as transformers computes them: int(head_dim * factor)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def architecture(self) -> str:
        """transformers' class name for this config (config.json `architectures`)."""
        return ARCHITECTURES[self.model_type]

    def describe(self) -> str:
        """One line naming the architecture and, for a hybrid, its layer mix (what `specquant models` prints)."""
        if not self.layer_types:
            return self.architecture
        counts = {t: self.layer_types.count(t) for t in dict.fromkeys(self.layer_types)}
        return f"{self.architecture} ({' + '.join(f'{n} {t}' for t, n in counts.items())})"

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Build from an HF config.json dict; raises SpecquantError on unsupported architectures. A multimodal
        wrapper (qwen3_5) gives its text_config, with the wrapper's tie_word_embeddings and token ids."""
        model_type = hf.get("model_type")
        if model_type in MULTIMODAL:
            hf = _text_part(hf, MULTIMODAL[model_type])
            model_type = hf["model_type"]
        if model_type not in FAMILIES:
            raise SpecquantError(
                f"unsupported model_type {model_type!r} in config.json; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES + tuple(MULTIMODAL))}"
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
        # Llama's attention_bias also covers o_proj; Qwen3's (and Qwen3.5's) covers q/k/v/o too; Qwen2 has bias on
        # q/k/v only.
        o_bias = attention_bias if model_type in ("llama", "qwen3", "qwen3_5_text") else False
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
        hybrid = {}
        if fam.get("hybrid"):
            hybrid = _read_hybrid(hf)
            layer_types = hybrid.pop("layer_types")
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
            **hybrid,
        )

    def to_hf(self) -> dict:
        """The config.json dict transformers reads for this architecture."""
        hf = dict(self.extra)
        hf.update(
            model_type=self.model_type,
            architectures=[self.architecture],
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
        if FAMILIES[self.model_type].get("hybrid"):  # transformers 5 reads RoPE from rope_parameters only
            hf.pop("rope_theta")
            hf.pop("rope_scaling")
            hf["rope_parameters"] = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta,
                                     "partial_rotary_factor": self.partial_rotary_factor}
            hf["layer_types"] = list(self.per_layer_types_hf)
            hf.update({f: getattr(self, f) for f in HYBRID_FIELDS})
        return hf

    @property
    def per_layer_types_hf(self) -> tuple[str, ...]:
        """config.json's layer_types, spelled out (the default for each layer when empty)."""
        return self.layer_types or (DEFAULT_LAYER_TYPE,) * self.num_hidden_layers

    @property
    def eos_ids(self) -> tuple[int, ...]:
        e = self.eos_token_id
        if e is None:
            return ()
        return tuple(e) if isinstance(e, (list, tuple)) else (int(e),)


def _text_part(hf: dict, text_type: str) -> dict:
    """The text_config of a multimodal config.json, with the wrapper's keys that describe the text model."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise SpecquantError(f"config.json has model_type {hf['model_type']!r} but no text_config; a multimodal "
                             "checkpoint needs its text model's config there")
    text = dict(text, model_type=text.get("model_type") or text_type)
    for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id"):
        if hf.get(key) is not None:
            text[key] = hf[key]
    return text


def _read_hybrid(hf: dict) -> dict:
    """The hybrid fields of a qwen3_5_text config.json as ModelConfig keyword arguments (layer_types included)."""
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:  # transformers' default: every full_attention_interval-th layer is full attention
        every = int(hf.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers)]
    if hf.get("attn_output_gate") is False:  # not a Qwen3_5TextConfig field; Qwen3-Next-style configs carry it
        raise SpecquantError("attn_output_gate=false in config.json: Qwen3.5's full attention always gates its "
                             "output (as transformers builds it); remove the key")
    rope = hf.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    return {"layer_types": tuple(types), "partial_rotary_factor": float(factor), **HYBRID_FLAGS,
            **{f: int(hf.get(f, defaults[f])) for f in HYBRID_FIELDS}}


def _read_rope(hf: dict) -> tuple[float, dict | None]:
    """transformers 4.x writes rope_theta + rope_scaling; 5.x writes rope_parameters. Accept both."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and params:
        params = dict(params)
        theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = params.get("rope_type", params.get("type", "default"))
        params.pop("partial_rotary_factor", None)  # a ModelConfig field of its own (hybrids)
        return theta, (None if rope_type == "default" else params)
    theta = float(hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling")
    if scaling:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "default":
            scaling = None
    return theta, scaling or None
