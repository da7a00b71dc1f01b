"""The suffix drafter (kind "suffix"): model-free drafts from earlier occurrences of the sequence's end
(spec_decode/suffix_drafter.py over suffix_automaton.py). No checkpoint (`--draft suffix`), no forward: its drafts
are point masses (Draft.probs None), which the sampling verifier accepts exactly.

Its k is its own: SuffixConfig.max_draft_len (`--suffix-max-draft-len`), not SpecConfig.draft_len, and the
adaptive controller does not apply (build_engine reads the drafter's own_draft_len; suffix_drafter.py says why).
Its settings are its row's options, SuffixConfig (`--suffix-*`); build reads them from the engine option `options`
(defaults when absent).
"""

from __future__ import annotations

from specquant.spec_decode.drafter import DrafterKind
from specquant.spec_decode.suffix_drafter import BYTES_PER_CACHED_TOKEN, SuffixConfig, SuffixDrafter

# Its settings when serving (and the hybrid's suffix part's): SuffixConfig's, with the response cache on. A server
# sees repeats (retries, agents, templated prompts, the latency protocol's 55 identical requests) that a repeated
# prompt drafts from nearly whole; a bench keeps SuffixConfig's 0, since it repeats its own prompts. 65536 tokens:
# about 64 MiB at BYTES_PER_CACHED_TOKEN; --suffix-cache-tokens 0 switches it off.
SERVE_OPTIONS = SuffixConfig(cache_tokens=1 << 16)
assert SERVE_OPTIONS.cache_tokens * BYTES_PER_CACHED_TOKEN <= 64 << 20


def _build(model, target, spec, options=None, **engine_options) -> SuffixDrafter:
    return SuffixDrafter(KIND.options_in(options))


KIND = DrafterKind(
    name="suffix", title="suffix drafter", detect=lambda hf: False, load=lambda name_or_dir, runtime: None,
    build=_build, forwards_per_step=lambda k: 0, needs_checkpoint=False, options=SuffixConfig,
    serve_options=SERVE_OPTIONS)
