"""Weight-only INT4/INT8 quantization (RTN, AWQ, GPTQ) to compressed-tensors pack-quantized checkpoints.

    report = quantize(model, QuantConfig(method=AWQConfig(grid=20), bits=4, group_size=128), tokenizer)
    save_quantized(model, "out/", tokenizer_from="tiny-target")
"""

from specquant.quant.checkpoint import load_quantized_into, save_quantized
from specquant.quant.config import AWQConfig, GPTQConfig, QuantConfig, RTNConfig
from specquant.quant.linear import QuantLinear, set_backend, set_w4_activations
from specquant.quant.pipeline import quantize

__all__ = ["AWQConfig", "GPTQConfig", "QuantConfig", "QuantLinear", "RTNConfig", "load_quantized_into", "quantize", "save_quantized", "set_backend",
           "set_w4_activations"]
