"""Plain (target-only) decoding and the sampling rules shared with speculative decoding."""

from specquant.decode.generate import GenerationResult, generate
from specquant.decode.sampling import SamplingConfig

__all__ = ["GenerationResult", "SamplingConfig", "generate"]
