"""specquant: quantized-target + quantized-drafter speculative decoding on one machine."""

__version__ = "0.1.0"
