"""The one entry point from a checkpoint directory to a ready model: `load_model`.

It sits above both layers and composes them, as gpt-fast's generate.py composes model.py and quantize.py: model/
builds the decoder and reads dense tensors, quant/ swaps in QuantLinear modules and reads compressed-tensors
`pack-quantized` tensors, and neither imports the other in that direction. Which path a checkpoint takes is read
from its own config.json (`quantization_config`), never from its name.
"""

from __future__ import annotations

import os

import torch

from specquant.model.checkpoint import load_dense, parse_dtype, read_hf_config, resolve
from specquant.model.decoder import Transformer
from specquant.model.fuse import for_decoding
from specquant.quant.checkpoint import load_quantized_model
from specquant.quant.prune_vocab import ATTRIBUTE, read_vocab_map


def load_model(name_or_dir: str | os.PathLike, dtype: torch.dtype | str = torch.float32,
               device: str | torch.device = "cpu", fuse: bool = False, w4_activations: str = "float") -> Transformer:
    """Build the decoder for a checkpoint (directory or bundled name) and load its weights, dense or INT4/INT8.
    Its architecture is read from config.json (dense Llama / Qwen2 / Qwen3, or the Qwen3.5 hybrid, also the text
    part of a multimodal Qwen3.5 checkpoint; ModelConfig.describe names it).

    fuse: fuse q/k/v and gate/up projections for decoding (model.fuse; the model can then not be saved or
    quantized), and store its dense fp32 weights that hold bf16 values as bf16 (model.bf16_store: the same
    outputs, half the bytes). w4_activations: "float" (W4A16, the checkpoint's arithmetic), "int8" (W4A8 on the
    native W4A8 kernel; kernels/w4a8.py) or "auto" (the engines' default: int8 where that kernel runs), for a
    quantized checkpoint's 4-bit layers."""
    dtype = parse_dtype(dtype)
    path = resolve(name_or_dir)
    hf = read_hf_config(path)
    quantization = hf.get("quantization_config")
    if not quantization:
        model = load_dense(path, dtype, device)
    else:
        model = load_quantized_model(path, hf, dtype, device, w4_activations)
    token_ids = read_vocab_map(hf)
    if token_ids is not None:  # a pruned vocabulary (quant/prune_vocab.py): the full-vocabulary id of each index
        setattr(model, ATTRIBUTE, token_ids.to(device))
    if fuse:  # decoding only: fused projections, and dense weights of bf16 values stored as bf16 (same outputs)
        for_decoding(model)
    return model.eval()
