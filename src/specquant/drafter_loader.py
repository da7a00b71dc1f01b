"""Load a block or MTP drafter checkpoint, dense or compressed-tensors W4 (sits above model/ and quant/, like
loader.py); `quantize_mtp` makes an MTP layer W4 with quant/'s RTN.

Which kind a draft checkpoint is comes from spec_decode/drafters (its config.json, never its name); here
`quantization_config` makes it a quantized one.
"""

from __future__ import annotations

import os

import torch

from specquant.errors import SpecquantError
from specquant.model.block_draft import BlockDraftConfig, BlockDraftModel, is_block_draft_config
from specquant.model.checkpoint import load_block_draft_dense, load_tensors, read_hf_config, resolve
from specquant.model.config import ModelConfig
from specquant.model.mtp import MTPModel, is_mtp_config, load_mtp_dense, mtp_layers_in, split_mtp
from specquant.util.dtypes import parse_dtype
from specquant.quant.checkpoint import load_quantized_into
from specquant.quant.linear import set_w4_activations


def _checkpoint(name_or_dir, is_kind, refusal: str) -> tuple:
    """(path, config.json) of a drafter checkpoint of one kind, or a one-line refusal naming what it is."""
    path = resolve(name_or_dir)
    hf = read_hf_config(path)
    if not is_kind(hf):
        raise SpecquantError(f"{path} is not {refusal.format(architectures=hf.get('architectures'))}")
    return path, hf


def _fill_quantized(model, tensors: dict, path, quantization: dict, dtype, device, w4_activations: str,
                    set_rope) -> None:
    """A meta-device drafter -> its W4 checkpoint's weights, RoPE tables, and the kernel choice for activations."""
    load_quantized_into(model, tensors, quantization, dtype, device)
    set_rope()
    model.quantization = quantization
    model.source_path = path
    set_w4_activations(model, w4_activations)


def load_block_draft(name_or_dir: str | os.PathLike, dtype: torch.dtype | str = torch.float32,
                     device: str | torch.device = "cpu", w4_activations: str = "float") -> BlockDraftModel:
    """A block drafter ready to attach to its target (`model.attach_target(target)`); w4_activations as
    loader.load_model's."""
    dtype = parse_dtype(dtype)
    path, hf = _checkpoint(name_or_dir, is_block_draft_config, "a block drafter (config.json architectures "
                           "{architectures}); pass a DFlashDraftModel checkpoint")
    quantization = hf.get("quantization_config")
    if not quantization:
        return load_block_draft_dense(path, hf, dtype, device)
    with torch.device("meta"):
        model = BlockDraftModel(BlockDraftConfig.from_hf(hf))
    _fill_quantized(model, load_tensors(path), path, quantization, dtype, device, w4_activations,
                    lambda: model._set_rope(model.config.max_position_embeddings))
    return model.eval()


def load_mtp_drafter(name_or_dir: str | os.PathLike, dtype: torch.dtype | str = torch.float32,
                     device: str | torch.device = "cpu", w4_activations: str = "float") -> MTPModel:
    """An MTP drafter directory (model/mtp.py's layout), dense or W4; its head precision (config.json
    `specquant_mtp_head`, default shared) is kept as `model.head_precision` for the drafter."""
    from specquant.model.mtp import HEAD_KEY

    dtype = parse_dtype(dtype)
    path, hf = _checkpoint(name_or_dir, is_mtp_config, "an MTP drafter (config.json architectures {architectures}); "
                           "pass a directory written by `specquant distill draft --kind mtp`")
    quantization = hf.get("quantization_config")
    if not quantization:
        model = load_mtp_dense(path, dtype, device)
    else:
        tensors = load_tensors(path)
        cfg = ModelConfig.from_hf(hf)
        with torch.device("meta"):
            model = MTPModel(cfg, mtp_layers_in(tensors))
        _fill_quantized(model, split_mtp(tensors), path, quantization, dtype, device, w4_activations,
                        lambda: model._set_rope(cfg.max_position_embeddings, device))
    model.head_precision = hf.get(HEAD_KEY, "shared")
    return model.eval()


@torch.no_grad()
def quantize_mtp(model: MTPModel, bits: int = 4, group_size: int = 32, symmetric: bool = True) -> dict:
    """Every Linear of the MTP layer (fc, attention, MLP) to W`bits` in place, with quant/'s RTN (no calibration:
    the layer is one block, and its inputs are the target's, which GPTQ would have to replay); returns a report
    with each Linear's weight SQNR."""
    from torch import nn

    from specquant.quant.checkpoint import quantization_config
    from specquant.quant.config import QuantConfig
    from specquant.quant.grid import dequantize, sqnr_db
    from specquant.quant.linear import QuantLinear
    from specquant.quant.rtn import quantize_linear

    cfg = QuantConfig(method="rtn", bits=bits, group_size=group_size, symmetric=symmetric).validate()
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    if not linears:
        raise SpecquantError("the MTP layer has no dense Linear left; quantize it once, from the dense layer")
    for name, lin in linears.items():
        cfg.group_for(name, lin.in_features)  # every group size checked before any change
    scale_dtype = model.norm.weight.dtype
    rows = []
    for name, lin in linears.items():
        res = quantize_linear(name, lin, cfg, scale_dtype)
        rows.append({"name": name, "sqnr_db": round(sqnr_db(lin.weight.float(),
                                                            dequantize(res.codes, res.scale.float(), res.zero)), 2)})
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child,
                QuantLinear.from_codes(res.codes, res.scale, res.zero, cfg.bits, lin.bias))
    model.quantization = quantization_config(model, cfg)
    return {"config": cfg.to_json(), "layers": rows}


def write_w4_mtp(src, out, bits: int = 4, group_size: int = 32, head: str = "shared",
                 overwrite: bool = False) -> dict:
    """A W`bits` copy (quantize_mtp) of the dense MTP drafter directory `src` at `out`, drafting through `head`
    (model/mtp.py's HEADS, recorded in its config.json); returns quantize_mtp's report."""
    from specquant.model.mtp import save_mtp_drafter
    from specquant.model.mtp import HEAD_KEY, HEADS

    if head not in HEADS:
        raise SpecquantError(f"MTP head {head!r} is unknown; use one of {', '.join(HEADS)}")
    path = resolve(src)
    model = load_mtp_drafter(path)
    if model.quantization:
        raise SpecquantError(f"{path} is already quantized; quantize the dense MTP drafter")
    report = quantize_mtp(model, bits, group_size)
    extra = {k: v for k, v in read_hf_config(path).items() if k.startswith("specquant_") and k != HEAD_KEY}
    tokenizer = path if (path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists() else None
    save_mtp_drafter(model, out, extra_config={**extra, HEAD_KEY: head}, tokenizer_from=tokenizer,
                     overwrite=overwrite)
    return report
