"""Lossless speculative decoding (vLLM's folder name): a drafter proposes, the target verifies in one forward.

- drafter.py: the `Drafter` protocol (and how a block drafter plugs in); lm_drafter.py: the small-LM drafter.
- loop.py: the loop (prefill, then propose -> verify -> accept); verify.py: the verification rules;
  adaptive.py: adaptive draft length; engine.py: `SpecEngine` (a request: checks, caches, timing, EOS).
- metrics.py: `SpecMetrics` with vLLM's counter names; timing.py: optional per-component timing wrappers.
"""

from specquant.spec_decode.config import SpecConfig
from specquant.spec_decode.drafter import Draft, Drafter
from specquant.spec_decode.engine import SpecEngine
from specquant.spec_decode.lm_drafter import LMDrafter
from specquant.spec_decode.metrics import SpecMetrics

__all__ = ["Draft", "Drafter", "LMDrafter", "SpecConfig", "SpecEngine", "SpecMetrics"]
