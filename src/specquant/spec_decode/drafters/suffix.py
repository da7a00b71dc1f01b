"""The suffix drafter (kind "suffix"): model-free drafts from earlier occurrences of the sequence's end
(spec_decode/suffix_drafter.py over suffix_automaton.py). No checkpoint (`--draft suffix`), no forward: its drafts
are point masses (Draft.probs None), which the sampling verifier accepts exactly.

Its k is its own: SuffixConfig.max_draft_len (`--suffix-max-draft-len`), not SpecConfig.draft_len, and the
adaptive controller does not apply (build_engine reads the drafter's own_draft_len; suffix_drafter.py says why).
Its settings reach build as the engine option suffix_config (SuffixConfig; default when absent).
"""

from __future__ import annotations

from specquant.spec_decode.drafter import DrafterKind
from specquant.spec_decode.suffix_drafter import SuffixConfig, SuffixDrafter


def _build(model, target, spec, suffix_config: SuffixConfig | None = None, **engine_options) -> SuffixDrafter:
    return SuffixDrafter(suffix_config or SuffixConfig())


KIND = DrafterKind(
    name="suffix", title="suffix drafter", detect=lambda hf: False, load=lambda name_or_dir, runtime: None,
    build=_build, forwards_per_step=lambda k: 0, needs_checkpoint=False)
