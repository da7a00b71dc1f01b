"""Load a block drafter checkpoint, dense or compressed-tensors W4 (sits above model/ and quant/, like loader.py).

Which kind a draft checkpoint is comes from spec_decode/drafters (its config.json, never its name); here
`quantization_config` makes it a quantized one.
"""

from __future__ import annotations

import os

import torch

from specquant.errors import SpecquantError
from specquant.model.block_draft import BlockDraftConfig, BlockDraftModel, is_block_draft_config
from specquant.model.checkpoint import load_block_draft_dense, load_tensors, read_hf_config, resolve
from specquant.util.dtypes import parse_dtype
from specquant.quant.checkpoint import load_quantized_into
from specquant.quant.linear import set_w4_activations


def load_block_draft(name_or_dir: str | os.PathLike, dtype: torch.dtype | str = torch.float32,
                     device: str | torch.device = "cpu", w4_activations: str = "float") -> BlockDraftModel:
    """A block drafter ready to attach to its target (`model.attach_target(target)`); w4_activations as
    loader.load_model's."""
    dtype = parse_dtype(dtype)
    path = resolve(name_or_dir)
    hf = read_hf_config(path)
    if not is_block_draft_config(hf):
        raise SpecquantError(f"{path} is not a block drafter (config.json architectures {hf.get('architectures')}); "
                             "pass a DFlashDraftModel checkpoint")
    quantization = hf.get("quantization_config")
    if not quantization:
        return load_block_draft_dense(path, hf, dtype, device)
    with torch.device("meta"):
        model = BlockDraftModel(BlockDraftConfig.from_hf(hf))
    load_quantized_into(model, load_tensors(path), quantization, dtype, device)
    model._set_rope(model.config.max_position_embeddings)
    model.quantization = quantization
    model.source_path = path
    set_w4_activations(model, w4_activations)
    return model.eval()
