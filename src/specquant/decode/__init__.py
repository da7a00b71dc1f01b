"""What decoding is built from: the sampling rules, the forward steps (eager, compiled, AOT-packaged, CUDA graphs)
and the result type with its timing definitions. The decoding loop is spec_decode's (target-only included)."""

from specquant.decode.result import GenerationResult
from specquant.decode.sampling import SamplingConfig

__all__ = ["GenerationResult", "SamplingConfig"]
