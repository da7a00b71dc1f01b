"""Round-to-nearest: min/max scales per group, no calibration data. The baseline AWQ and GPTQ must beat.

Method interface (shared by rtn, awq, gptq): `quantize_layer(layer, targets, inputs, cfg, scale_dtype, *, stats,
call, seq_len)` where layer is a DecoderLayer, targets = {name within the layer: nn.Linear} to quantize, inputs =
{name: captured input [tokens, in]} or None, call = the arguments the model's forward gives the layer after the
hidden state (quant.calib.layer_calls; None without calibration), returns {name: QuantizedWeight}. The method may
rewrite float weights of the layer (AWQ folds scales into norms) but must not replace modules; the caller swaps in
QuantLinear.
"""

from __future__ import annotations

import torch
from torch import nn

from specquant.quant.grid import QuantizedWeight, quantize_weight

NEEDS_CALIBRATION = False


@torch.no_grad()
def quantize_linear(name: str, linear: nn.Linear, cfg, scale_dtype: torch.dtype) -> QuantizedWeight:
    w = linear.weight.float()
    group = cfg.group_for(name, w.shape[1])
    codes, scale, zero = quantize_weight(w, cfg, group_size=group, scale_dtype=scale_dtype)
    return QuantizedWeight(codes, scale, zero, w)


def quantize_layer(layer: nn.Module, targets: dict[str, nn.Linear], inputs, cfg, scale_dtype, **_):
    return {name: quantize_linear(name, lin, cfg, scale_dtype) for name, lin in targets.items()}
