"""The GGUF architectures: one row of ARCHS per model_type (gguf-py's architecture, the metadata keys beyond the
shared ones, the per-tensor rewrites llama.cpp's graph for it expects). export/gguf.py writes files through these
rows; a new architecture is one row plus its hparams and rewrites functions.

Rows: llama / qwen2 / qwen3, and the Qwen3.5 hybrid as llama.cpp's `qwen35`, for which the vendored converter
(conversion/qwen.py, Qwen3_5TextModel) is the reference: norms + 1, A_log -> -e^A, dt_bias -> ssm_dt.bias, the conv
kernel squeezed, value heads reordered from grouped to tiled order (rows, and out_proj's input columns in value-head
pieces, so quantized blocks move whole).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from specquant.errors import SpecquantError
from specquant.model.config import ModelConfig
from specquant.model.rope import ROPE_VARIANTS


def _gguf():
    try:
        import gguf
    except ImportError:
        raise SpecquantError("GGUF export needs the `gguf` package: pip install 'specquant[export]'") from None
    return gguf


def _llama_permute(x: np.ndarray | torch.Tensor, n_head: int):
    """llama.cpp's `llama` arch applies RoPE to adjacent pairs, HF to the two halves of a head: reorder q/k rows the
    way convert_hf_to_gguf.py does (rows are output channels, so quantized blocks move whole)."""
    rows = x.shape[0]
    return (x.reshape(n_head, 2, rows // n_head // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape))


# --- rewrites -------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Rewrite:
    """How one checkpoint tensor (or quantized Linear) becomes its GGUF tensor. Permutations move whole output rows
    or whole 32-column blocks, so quantized codes and scales move with them and stay exact."""

    rows: torch.Tensor | None = None  # new row i is old row rows[i] (output channels; dim 0)
    cols: torch.Tensor | None = None  # new column j is old column cols[j] (input channels; dim 1)
    value: Callable[[torch.Tensor], torch.Tensor] | None = None  # elementwise, in fp32 (dense tensors only)
    squeeze: bool = False  # drop singleton dims (Conv1d weight [C, 1, K] -> [C, K])
    name: str | None = None  # the checkpoint name GGUF's tensor map knows this tensor by, when it differs


NO_REWRITE = Rewrite()


def _no_rewrites(cfg: ModelConfig) -> Callable[[str], Rewrite]:
    return lambda name: NO_REWRITE


def _llama_rewrites(cfg: ModelConfig) -> Callable[[str], Rewrite]:
    """q/k rows reordered from HF's half-split RoPE to llama.cpp's adjacent pairs."""
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    rows = {p: _llama_permute(torch.arange(n * cfg.head_dim), n) for p, n in heads.items()}

    def rewrite(name: str) -> Rewrite:
        base = name.rpartition(".")[0]  # model.layers.N.self_attn.{q,k}_proj(.weight | .bias)
        proj = base.rpartition(".")[2]
        return Rewrite(rows=rows[proj]) if proj in rows and base.endswith(f"self_attn.{proj}") else NO_REWRITE

    return rewrite


def _value_head_order(num_k_heads: int, num_v_heads: int, head_dim: int) -> torch.Tensor:
    """Index of each channel of the value heads in llama.cpp's order. HF groups the value heads by the key head
    they read ([k0: v0..v(r-1), k1: ...]); ggml broadcasts key heads tiled ([k0, k1, ..., k0, k1, ...]), so the
    converter (conversion/qwen.py, _LinearAttentionVReorderBase) reorders every value-head axis to tiled order."""
    r = num_v_heads // num_k_heads
    return torch.arange(num_v_heads * head_dim).reshape(num_k_heads, r, head_dim).transpose(0, 1).reshape(-1)


def _plus_one(t: torch.Tensor) -> torch.Tensor:
    return t.float() + 1  # zero-centred RMSNorm: llama.cpp multiplies by the weight itself


def _neg_exp(t: torch.Tensor) -> torch.Tensor:
    return -t.float().exp()  # llama.cpp's ssm_a is the decay rate A = -e^{A_log}, as our forward computes it


def _qwen35_rewrites(cfg: ModelConfig) -> Callable[[str], Rewrite]:
    """Qwen3.5 as llama.cpp's qwen35 reads it: zero-centred norms + 1 (not the gated DeltaNet norm), A_log as -e^A,
    dt_bias as ssm_dt.bias, the conv kernel squeezed, and every value-head axis in tiled order when there are fewer
    key heads than value heads. Full attention's q_proj (query | gate interleaved per head) is read as it is."""
    nk, nv, dk = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim
    v = _value_head_order(nk, nv, cfg.linear_value_head_dim)
    heads = _value_head_order(nk, nv, 1)
    qk = 2 * nk * dk
    qkv = torch.cat([torch.arange(qk), qk + v])  # q | k unchanged, then the value channels
    reorder = nk != nv
    by_leaf = {  # linear_attn.<leaf> -> Rewrite
        "in_proj_qkv": Rewrite(rows=qkv if reorder else None),
        "in_proj_z": Rewrite(rows=v if reorder else None),
        "in_proj_a": Rewrite(rows=heads if reorder else None),
        "in_proj_b": Rewrite(rows=heads if reorder else None),
        "conv1d": Rewrite(rows=qkv if reorder else None, squeeze=True),
        "out_proj": Rewrite(cols=v if reorder else None),
        "A_log": Rewrite(rows=heads if reorder else None, value=_neg_exp),
        "norm": NO_REWRITE,
    }

    def rewrite(name: str) -> Rewrite:
        base = name.removesuffix(".weight")
        parent, _, leaf = base.rpartition(".")
        if parent.endswith(".linear_attn"):
            if leaf == "dt_bias":
                return Rewrite(rows=heads if reorder else None, name=f"{parent}.dt_proj.bias")
            return by_leaf.get(leaf, NO_REWRITE)
        if leaf.endswith("norm") and name.endswith(".weight"):  # input/post-attention, q/k and final norms
            return Rewrite(value=_plus_one)
        return NO_REWRITE

    return rewrite


def _hparams_common(writer, cfg: ModelConfig):
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)


def _hparams_dense(writer, cfg: ModelConfig):
    writer.add_rope_dimension_count(cfg.head_dim)


# Qwen3.5's M-RoPE sections as the converter writes them when a config omits them (_Qwen35MRopeMixin)
QWEN35_MROPE_SECTIONS = (11, 11, 10, 0)


def mrope_sections(cfg: ModelConfig) -> list[int]:
    """The rope.dimension_sections for qwen35. Text positions are equal in the first three M-RoPE axes and 0 in the
    fourth, so RoPE is plain 1-D exactly when every rotary pair reads one of the first three (ggml's interleaved
    rule: pair p reads axis p % 3 while p < 3·sections[p % 3]) and the sections sum to at most head_dim (ggml
    asserts it). The converter's default when that holds (the 4B shape), else equal thirds of the pairs."""
    pairs = cfg.rotary_dim // 2

    def one_d(sec) -> bool:
        return sum(sec) <= cfg.head_dim and all(p < 3 * sec[p % 3] for p in range(pairs))

    if one_d(QWEN35_MROPE_SECTIONS):
        return list(QWEN35_MROPE_SECTIONS)
    third = -(-pairs // 3)
    return [third, third, third, 0]


def _hparams_qwen35(writer, cfg: ModelConfig):
    """The keys llama.cpp's qwen35 loader reads (src/models/qwen35.cpp), named as the converter writes them."""
    if cfg.linear_key_head_dim != cfg.linear_value_head_dim:
        raise SpecquantError(f"linear_key_head_dim={cfg.linear_key_head_dim} != linear_value_head_dim="
                             f"{cfg.linear_value_head_dim}: llama.cpp's qwen35 has one DeltaNet head size "
                             "(ssm.state_size) for both; this model cannot run there")
    if cfg.rope_scaling:
        raise SpecquantError(f"rope scaling {cfg.rope_scaling} on a qwen35 export: llama.cpp's qwen35 graph applies "
                             "M-RoPE with the default frequencies only; export a config with default RoPE")
    writer.add_rope_dimension_count(cfg.rotary_dim)
    writer.add_rope_dimension_sections(mrope_sections(cfg))
    writer.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    writer.add_ssm_state_size(cfg.linear_key_head_dim)
    writer.add_ssm_group_count(cfg.linear_num_key_heads)
    writer.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    writer.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    # gguf-py 0.19.0 has no add_recurrent_layers; the key as the vendored gguf-py names it (Keys.Attention)
    writer.add_array(f"{writer.arch}.attention.recurrent_layers",
                     [t == "linear_attention" for t in cfg.per_layer_types_hf])
    # the fallback llama.cpp reads when recurrent_layers is absent: the first full-attention layer's 1-based index
    types = cfg.per_layer_types_hf
    writer.add_full_attention_interval(next((i + 1 for i, t in enumerate(types) if t == "full_attention"), 4))


@dataclass(frozen=True)
class GGUFArch:
    arch: str  # gguf.MODEL_ARCH member name
    hparams: Callable  # (writer, cfg): the keys beyond _hparams_common
    rewrites: Callable[[ModelConfig], Callable[[str], Rewrite]] = _no_rewrites


ARCHS: dict[str, GGUFArch] = {  # our model_type -> its GGUF architecture
    "llama": GGUFArch("LLAMA", _hparams_dense, _llama_rewrites),
    "qwen2": GGUFArch("QWEN2", _hparams_dense),
    "qwen3": GGUFArch("QWEN3", _hparams_dense),
    "qwen3_5_text": GGUFArch("QWEN35", _hparams_qwen35, _qwen35_rewrites),
}


def gguf_arch(cfg: ModelConfig) -> GGUFArch:
    row = ARCHS.get(cfg.model_type)
    if row is None:
        raise SpecquantError(f"model_type {cfg.model_type!r} has no GGUF export; supported: {', '.join(ARCHS)}")
    return row


def _gguf_arch(cfg: ModelConfig):
    return getattr(_gguf().MODEL_ARCH, gguf_arch(cfg).arch)


def add_hparams(writer, cfg: ModelConfig, file_type: int):
    gguf = _gguf()
    _hparams_common(writer, cfg)
    gguf_arch(cfg).hparams(writer, cfg)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    scaling = cfg.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(scaling["factor"]))
    elif rope_type == "yarn":
        if scaling.get("attention_factor") is not None or scaling.get("mscale") or not scaling.get("truncate", True):
            raise SpecquantError(f"yarn rope_scaling {scaling} sets attention_factor/mscale/truncate, which GGUF's "
                                 "yarn keys do not carry; export a config with the default yarn attention factor")
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(scaling["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(scaling.get("original_max_position_embeddings")
                                                 or cfg.max_position_embeddings))
        writer.add_rope_scaling_yarn_beta_fast(float(scaling.get("beta_fast") or 32))
        writer.add_rope_scaling_yarn_beta_slow(float(scaling.get("beta_slow") or 1))
    elif rope_type not in ("default", "llama3"):  # llama3 is carried by the rope_freqs tensor (rope_factors)
        raise SpecquantError(f"rope type {rope_type!r} has no GGUF export; supported: default, linear, llama3, yarn")


def rope_factors(cfg: ModelConfig) -> np.ndarray | None:
    """llama3 rope: llama.cpp divides each frequency by rope_freqs[i]; ours are inv_freq / scaled inv_freq."""
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "llama3":
        return None
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))
    scaled, _ = ROPE_VARIANTS["llama3"](inv, scaling, cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
    return (inv / scaled).numpy().astype(np.float32)
