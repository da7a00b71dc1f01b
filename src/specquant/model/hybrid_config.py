"""HybridFields: the Qwen3.5 (qwen3_5_text) config.json fields the hybrid layer kinds read, beside ModelConfig's.

Named exactly as transformers' Qwen3_5TextConfig names them, so they can be folded into ModelConfig as they are.
The mixers (model/deltanet.py, model/gated_attention.py) read them as attributes of the config they are given,
together with ModelConfig's hidden_size, rms_norm_eps, num_attention_heads, num_key_value_heads, head_dim,
qkv_bias and o_bias.

RoPE: Qwen3.5 configs carry M-RoPE (`mrope_section`, `mrope_interleaved`) for images and video. For text the three
position rows are equal, and the interleaved sections then give exactly 1-D RoPE over the first
rotary_dim = head_dim * partial_rotary_factor dims.
"""

from __future__ import annotations

from dataclasses import dataclass

from specquant.errors import SpecquantError

LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"
LAYER_TYPES = (LINEAR_ATTENTION, FULL_ATTENTION)


@dataclass
class HybridFields:
    layer_types: list[str]
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    partial_rotary_factor: float = 0.25
    # Not a Qwen3_5TextConfig field: transformers' Qwen3.5 attention always gates. Kept so a config that says
    # otherwise (Qwen3-Next-style configs carry it) is refused rather than misread.
    attn_output_gate: bool = True

    @classmethod
    def from_hf(cls, hf: dict) -> "HybridFields":
        """Read and check the hybrid fields of a qwen3_5_text config.json dict (see check())."""
        layers = hf["num_hidden_layers"]
        types = hf.get("layer_types")
        if types is None:  # transformers' default: every full_attention_interval-th layer is full attention
            every = int(hf.get("full_attention_interval", 4))
            types = [FULL_ATTENTION if (i + 1) % every == 0 else LINEAR_ATTENTION for i in range(layers)]
        rope = hf.get("rope_parameters") or {}
        factor = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
        fields = cls(
            layer_types=list(types),
            linear_num_key_heads=int(hf.get("linear_num_key_heads", 16)),
            linear_num_value_heads=int(hf.get("linear_num_value_heads", 32)),
            linear_key_head_dim=int(hf.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(hf.get("linear_value_head_dim", 128)),
            linear_conv_kernel_dim=int(hf.get("linear_conv_kernel_dim", 4)),
            partial_rotary_factor=float(factor),
            attn_output_gate=bool(hf.get("attn_output_gate", True)),
        )
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        fields.check(layers, head_dim)
        return fields

    def check(self, num_hidden_layers: int, head_dim: int):
        """SpecquantError naming the value and the fix for configs these layer kinds cannot run."""
        bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
        if bad:
            raise SpecquantError(f"unsupported layer_types {bad} in config.json; supported: {', '.join(LAYER_TYPES)}")
        if len(self.layer_types) != num_hidden_layers:
            raise SpecquantError(f"config.json lists {len(self.layer_types)} layer_types for num_hidden_layers="
                                 f"{num_hidden_layers}; give one entry per layer")
        if self.linear_num_key_heads <= 0 or self.linear_num_value_heads % self.linear_num_key_heads:
            raise SpecquantError(f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                                 f"linear_num_key_heads={self.linear_num_key_heads}; each key head serves a whole "
                                 "group of value heads")
        if self.linear_conv_kernel_dim < 1:
            raise SpecquantError(f"linear_conv_kernel_dim={self.linear_conv_kernel_dim} must be at least 1")
        rot = rotary_dim(head_dim, self.partial_rotary_factor)
        if not 0 < rot <= head_dim or rot % 2:
            raise SpecquantError(f"partial_rotary_factor={self.partial_rotary_factor} gives {rot} rotary dims of "
                                 f"head_dim={head_dim}; it needs an even count in 2..head_dim")
        if not self.attn_output_gate:
            raise SpecquantError("attn_output_gate=false in config.json: Qwen3.5's full attention always gates "
                                 "its output (as transformers builds it); remove the key")


def rotary_dim(head_dim: int, partial_rotary_factor: float) -> int:
    """Dims RoPE rotates (the first ones of each head), as transformers computes them: int(head_dim * factor)."""
    return int(head_dim * partial_rotary_factor)
