"""Weight-only INT4/INT8 quantization (RTN, AWQ, GPTQ) to compressed-tensors pack-quantized checkpoints.

    report = quantize(model, QuantConfig(method="awq", bits=4, group_size=128), tokenizer)
    save_quantized(model, "out/", tokenizer_from="tiny-target")
"""

from specquant.quant.checkpoint import load_quantized_into, save_quantized
from specquant.quant.config import QuantConfig
from specquant.quant.linear import QuantLinear, set_backend
from specquant.quant.pipeline import quantize

__all__ = ["QuantConfig", "QuantLinear", "load_quantized_into", "quantize", "save_quantized", "set_backend"]
