"""Small random Qwen3.5 hybrids built by transformers (no download), for the layer, model and speculation tests.

Weights are drawn at trained-model scale, norms included (a missing +1 or a swapped name then shows), A_log and
dt_bias in transformers' ranges.
"""

from __future__ import annotations

import pytest
import torch

hf_qwen35 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
from transformers import Qwen3_5TextConfig  # noqa: E402

VOCAB = 97

# key heads != value heads, head dims that are not powers of two, more than one layer pattern
SHAPES = {
    "gva": dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=12, linear_value_head_dim=20,
                num_attention_heads=4, num_key_value_heads=2, head_dim=24, partial_rotary_factor=0.25,
                layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"]),
    "mha": dict(linear_num_key_heads=3, linear_num_value_heads=3, linear_key_head_dim=10, linear_value_head_dim=6,
                num_attention_heads=3, num_key_value_heads=3, head_dim=20, partial_rotary_factor=0.5,
                layer_types=["full_attention", "linear_attention", "full_attention", "linear_attention"]),
}


def hf_config(shape: str, layers: int = 4, **over) -> Qwen3_5TextConfig:
    kw = dict(SHAPES[shape], vocab_size=VOCAB, hidden_size=40, intermediate_size=56, num_hidden_layers=layers,
              linear_conv_kernel_dim=4, max_position_embeddings=512, tie_word_embeddings=False, rms_norm_eps=1e-6)
    kw["layer_types"] = (kw["layer_types"] * layers)[:layers]
    kw.update(over)
    cfg = Qwen3_5TextConfig(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def randomize(model: torch.nn.Module, scale: float = 0.2) -> torch.nn.Module:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.01, 4).log())
            elif name.endswith("dt_bias"):
                p.normal_(0, 1)
            elif "norm" in name:
                p.normal_(0, 0.3) if not name.endswith("linear_attn.norm.weight") else p.normal_(1, 0.3)
            else:
                p.normal_(0, scale)
    return model


def hf_model(shape: str, layers: int = 4, seed: int = 0, scale: float = 0.2, **over):
    """A random Qwen3_5ForCausalLM in fp32, eval mode."""
    torch.manual_seed(seed)
    model = hf_qwen35.Qwen3_5ForCausalLM(hf_config(shape, layers, **over)).float().eval()
    return randomize(model, scale)
