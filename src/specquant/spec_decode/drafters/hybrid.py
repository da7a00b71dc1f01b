"""The hybrid drafter (kind "hybrid", `--draft suffix+DRAFT`): per step, the suffix drafter's draft when its match
is long enough (HybridConfig.min_match), else a model drafter's (block, LM, or any kind `--draft` takes) while that
pays, else no draft.

When the model drafter pays. A model step costs its draft plus a (k+1)-row verify, more than a plain step, and
emits 1 + accepted tokens, so a drafter that accepts little loses to not drafting. The hybrid keeps a running mean
of what the model's own steps accepted and, while it is below HybridConfig.model_min_accept, runs the steps without
a long suffix match undrafted (one token, one 1-row forward), trying the model again after PROBE_EVERY such steps
(then after twice as many, up to PROBE_MAX, while it still does not pay) so that the mean follows the text. The rule
reads accepted counts only, never the clock, so a seeded run makes the same choices every time.

Both sub-drafters see every step, whoever drafted: `prefill` and `accept` go to both, so the suffix automaton holds
every committed token, the block drafter's context every verified position (accept hands it the target's hidden
states of the accepted positions, which the target returns on every step because the hybrid reads the model
drafter's target_layers), and the LM drafter's KV cache catches up on the tokens it did not draft at its next
propose (drafters/lm.py reads them from the committed sequence). A step the model drafter did not draft leaves it
nothing to roll back: it wrote nothing past the verified prefix.

Draft length. The loop's k is the hybrid's own (own_draft_len: the larger of the suffix drafter's and the model
drafter's longest), so a suffix step may draft up to SuffixConfig.max_draft_len. The model drafter keeps the
k the user set (SpecConfig.draft_len), and SpecConfig.adaptive, when on, adapts it from the model drafter's own
steps only: a long accepted suffix draft says nothing about how far the model drafter is right.

Sampling: a suffix step proposes point masses (Draft.probs None), a model step its own distributions; the verifier
is exact for each (verify.py), so the mixture is too (the rule reads only committed tokens, never the target's
answer to the current draft).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from specquant.decode.sampling import SamplingConfig
from specquant.errors import SpecquantError
from specquant.spec_decode.adaptive import next_draft_len
from specquant.spec_decode.config import SpecConfig
from specquant.spec_decode.drafter import Draft, Drafter, DrafterKind
from specquant.spec_decode.drafters import suffix
from specquant.spec_decode.metrics import SpecMetrics
from specquant.spec_decode.suffix_drafter import SuffixDrafter

PREFIX = "suffix+"  # `--draft suffix+DRAFT`


@dataclass
class HybridConfig:
    # 3, the suffix drafter's own min_match: the match lengths the suffix drafter alone drafts on go to it here too.
    # (4 won a sweep over 1, 2, 4, 8 while every other step went to the model drafter, before the model gate below:
    # docs/BENCH.md, "Hybrid drafter"; with the gate a short match's draft competes with an
    # undrafted step, which is what the suffix drafter alone does.)
    min_match: int = field(default=3, metadata={
        "help": "hybrid drafter: draft from the suffix match when at least this many tokens of the sequence's end "
                "matched earlier text, else with the model drafter while it pays (--hybrid-model-min-accept)",
        "flag": "--hybrid-min-match"})

    # 0.5: between the two bundled pairs' block drafters, measured in the demo (docs/BENCH.md, "Hybrid drafter
    # model gate"): on the Qwen3 pair the model steps accept 1.0-1.1 tokens and drafting them beat not drafting;
    # on the hybrid pair they accept 0.1-0.3 and not drafting won by 1.27x in tokens/s. A cost-aware rule (the
    # break-even is a model step's cost in plain steps, minus 1) would need the step times, which the rule does not
    # read (module docstring).
    model_min_accept: float = field(default=0.5, metadata={
        "help": "hybrid drafter: without a long suffix match, draft with the model drafter only while its steps "
                "accept at least this many tokens on average (else the step runs undrafted, the model retried "
                "every few steps); 0 = always the model drafter", "flag": "--hybrid-model-min-accept"})

    def validate(self) -> "HybridConfig":
        if self.min_match < 1:
            raise SpecquantError(f"hybrid min_match {self.min_match} must be at least 1 (e.g. 3)")
        if not self.model_min_accept >= 0:
            raise SpecquantError(f"hybrid model_min_accept {self.model_min_accept} must be >= 0 (e.g. 0.5; 0 = "
                                 "always draft with the model)")
        return self


# undrafted steps before the model is tried again once its mean fell below model_min_accept; each try that leaves it
# below doubles the wait, up to PROBE_MAX (a drafter that never pays costs 1 step in 65 at most), and a mean back
# above the gate resets it
PROBE_EVERY, PROBE_MAX = 8, 64
RATE_WEIGHT = 0.125  # the running mean's weight on the newest model step (about its last 8 steps)


class HybridDrafter:
    """A Drafter over a SuffixDrafter and a model drafter. `choices` counts, per source ("suffix", "model", and
    "none": the undrafted steps, each a step of MAL 1), the steps it drafted and what they accepted (this
    request's; `totals` over every request)."""

    SOURCES = ("suffix", "model", "none")

    def __init__(self, suffix: SuffixDrafter, model: Drafter, spec: SpecConfig, config: HybridConfig | None = None):
        self.suffix, self.model, self.spec = suffix, model, spec.validate()
        self.config = (config or HybridConfig()).validate()
        self.target_layers = tuple(model.target_layers)
        limit = getattr(model, "max_draft_len", None)
        self.model_longest = spec.longest_draft if limit is None else min(spec.longest_draft, limit)
        self.max_draft_len = max(suffix.config.max_draft_len, self.model_longest)
        self.own_draft_len = self.max_draft_len  # build_engine gives the loop this k (module docstring)
        self.model_k = min(spec.draft_len, self.model_longest)  # the model drafter's k, adapted on its own steps
        self.choices = {s: SpecMetrics() for s in self.SOURCES}
        self.totals = {s: SpecMetrics() for s in self.SOURCES}
        self._pending: tuple[str, int, int] | None = None  # (source, committed length, proposed) of the last draft
        self.model_rate: float | None = None  # running mean of the model steps' accepted tokens (None: no step yet)
        self._undrafted = 0  # undrafted steps since the last model step
        self._probe = PROBE_EVERY  # undrafted steps before the next model try

    def take_totals(self) -> dict[str, SpecMetrics]:
        """The per-source counters over every request since the last call (a bench pass's), reset."""
        totals, self.totals = self.totals, {s: SpecMetrics() for s in self.SOURCES}
        return totals

    def check_request(self, prompt_len: int, max_new_tokens: int) -> None:
        check = getattr(self.model, "check_request", None)
        if check is not None:
            check(prompt_len, max_new_tokens)

    def setup(self, batch: int, max_len: int) -> None:
        self.suffix.setup(batch, max_len)
        self.model.setup(batch, max_len)

    def prefill(self, prompt_ids: torch.Tensor, target_hidden: torch.Tensor | None) -> None:
        self.choices = {s: SpecMetrics() for s in self.SOURCES}
        self.model_k = min(self.spec.draft_len, self.model_longest)
        self._pending = None
        self.model_rate, self._undrafted, self._probe = None, 0, PROBE_EVERY
        self.suffix.prefill(prompt_ids, None)
        self.model.prefill(prompt_ids, target_hidden)

    def choose(self, tokens: torch.Tensor, k: int) -> tuple[str, list[int]]:
        """The rule: ("suffix", its draft) when the suffix match after tokens [1, n] is long enough and drafts,
        else ("model", []) while the model drafter pays (module docstring), else ("none", [])."""
        proposal = self.suffix.peek(tokens, k)
        if proposal.match.length >= self.config.min_match and proposal.tokens:
            return "suffix", proposal.tokens
        if self.model_rate is None or self.model_rate >= self.config.model_min_accept \
                or self._undrafted >= self._probe:
            return "model", []
        return "none", []

    def propose(self, tokens: torch.Tensor, k: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        source, drafted = self.choose(tokens, k)
        if source == "suffix":
            draft = Draft(torch.tensor([drafted], dtype=torch.long, device=tokens.device))
        elif source == "model" and min(k, self.model_k):
            draft = self.model.propose(tokens, min(k, self.model_k), sampling, generator)
        else:
            draft = Draft.empty(tokens.shape[0], tokens.device)
        self._pending = (source, tokens.shape[1], draft.tokens.shape[1])
        return draft

    def accept(self, length: int, target_hidden: torch.Tensor | None) -> None:
        if self._pending is not None:
            source, n, proposed = self._pending
            accepted = length - n  # the loop accepts n + accepted positions after a verify
            if proposed:
                self.choices[source].record_step(proposed, accepted)
                self.totals[source].record_step(proposed, accepted)
                if source == "model":
                    self.model_k = next_draft_len(self.model_k, proposed, accepted,
                                                  _capped(self.spec, self.model_longest))
                    self.model_rate = accepted if self.model_rate is None else \
                        self.model_rate + RATE_WEIGHT * (accepted - self.model_rate)
                    if self.model_rate >= self.config.model_min_accept:
                        self._probe = PROBE_EVERY
                    elif self._undrafted >= self._probe:  # a try after a wait that did not lift the mean
                        self._probe = min(2 * self._probe, PROBE_MAX)
                    self._undrafted = 0
            elif source == "none":
                for m in (self.choices["none"], self.totals["none"]):
                    m.num_drafts += 1  # a step, not a draft: its MAL is 1 (record_step skips empty drafts)
                self._undrafted += 1
            self._pending = None
        self.suffix.accept(length, None)
        self.model.accept(length, target_hidden)

    def rollback(self, length: int) -> None:
        self._pending = None
        self.suffix.rollback(length)
        self.model.rollback(length)


def _capped(spec: SpecConfig, longest: int) -> SpecConfig:
    """spec with its adaptive ceiling cut to what the model drafter can draft (a block: block_size - 1)."""
    return spec if spec.max_draft_len <= longest else replace(spec, max_draft_len=longest)


@dataclass(frozen=True)
class HybridParts:
    """What the kind's load returns: the model drafter's kind, its loaded model (None for a kind without a
    checkpoint) and its tokenizer (standalone kinds, for the vocabulary check). The kind's model_class: parts a
    caller assembled from a model it loaded itself (the bench's hybrid row) build like loaded ones."""

    kind: DrafterKind
    model: object
    draft_tokenizer: object = None


def split(value: str) -> str | None:
    """`suffix+DRAFT` -> DRAFT (what --draft would take for the model drafter); None when value is no hybrid."""
    if value.lower().startswith(PREFIX):
        inner = value[len(PREFIX):]
        if not inner:
            raise SpecquantError(f"--draft {value!r} names no model drafter; use suffix+DIR (a draft checkpoint or "
                                 "bundled name)")
        return inner
    return None


def _load(inner: str, runtime) -> HybridParts:
    from specquant.model.checkpoint import load_tokenizer
    from specquant.spec_decode.drafters import parse_draft

    kind, source = parse_draft(inner)  # parse_draft("suffix+" + inner) refused the kinds that draft from no model
    model = kind.load(source, runtime) if source is not None else None
    tokenizer = load_tokenizer(source) if kind.standalone and source is not None else None
    return HybridParts(kind, model, tokenizer)


def _build(parts: HybridParts, target, spec: SpecConfig, options=None, draft_tokenizer=None,
           **engine_options) -> HybridDrafter:
    """Its settings and its suffix part's from options (kind name -> settings: its own and the suffix kind's)."""
    if not isinstance(parts, HybridParts):
        raise SpecquantError("the hybrid drafter is built from `suffix+DRAFT`; pass that to --draft, or build a "
                             "HybridDrafter(SuffixDrafter(...), model_drafter, spec) yourself")
    model = parts.kind.build(parts.model, target, spec, draft_tokenizer=draft_tokenizer or parts.draft_tokenizer,
                             options=options, **engine_options)
    return HybridDrafter(SuffixDrafter(suffix.KIND.options_in(options)), model, spec, KIND.options_in(options))


KIND = DrafterKind(
    name="hybrid", title="hybrid drafter (suffix, else a model drafter)", detect=lambda hf: False, load=_load,
    build=_build,
    # A suffix step runs no forward, a model step its drafter's (1 for a block drafter, k for an LM), which the
    # kind cannot know: the bench predicts no hybrid row (cost None) and counts each source's steps instead
    forwards_per_step=lambda k: 1 if k else 0, model_class=HybridParts, options=HybridConfig)
