"""The suffix drafter (kind "suffix"): model-free drafts from earlier occurrences of the sequence's end
(spec_decode/suffix_drafter.py over suffix_automaton.py). No checkpoint (`--draft suffix`), no forward: its drafts
are point masses (Draft.probs None), which the sampling verifier accepts exactly.

Its own SuffixConfig.max_draft_len caps one propose; the loop caps it again at the engine's k, and the target cache
is sized from SpecConfig.longest_draft, so a run that wants its longest drafts sets draft_len to at least that
(adaptive off). Its SuffixConfig fields get no flags here: `max_draft_len` would clash with SpecConfig's.
"""

from __future__ import annotations

from specquant.spec_decode.drafter import DrafterKind
from specquant.spec_decode.suffix_drafter import SuffixConfig, SuffixDrafter

KIND = DrafterKind(
    name="suffix", title="suffix drafter", detect=lambda hf: False, load=lambda name_or_dir, runtime: None,
    build=lambda model, target, spec, **engine_options: SuffixDrafter(SuffixConfig()), forwards_per_step=lambda k: 0,
    needs_checkpoint=False)
