"""Decoding (vLLM's folder name for the speculative part): a drafter proposes, the target verifies in one forward;
target-only decoding is the same loop with a drafter that proposes nothing.

- drafter.py: the `Drafter` protocol and `DrafterKind`; drafters/: one file per kind (lm, block, none) and the
  table of kinds.
- loop.py: the one loop (prefill, then propose -> verify -> accept); verify.py: the verification rules;
  adaptive.py: adaptive draft length; engine.py: `SpecEngine` (a request: checks, caches, streaming, EOS, timing)
  and target-only `generate`; build.py: `build_engine`, the one place an engine is assembled from checkpoints.
- config.py: `SpecConfig`; runtime.py: `RuntimeConfig` (dtype, device, W4 activations, compiled steps, threads);
  metrics.py: `SpecMetrics` with vLLM's counter names; timing.py:
  optional per-component timing wrappers.
"""

from specquant.spec_decode.config import SpecConfig
from specquant.spec_decode.drafter import Draft, Drafter, DrafterKind
from specquant.spec_decode.drafters.lm import LMDrafter
from specquant.spec_decode.engine import SpecEngine, Step, generate
from specquant.spec_decode.metrics import SpecMetrics

__all__ = ["Draft", "Drafter", "DrafterKind", "LMDrafter", "SpecConfig", "SpecEngine", "SpecMetrics", "Step",
           "generate"]
