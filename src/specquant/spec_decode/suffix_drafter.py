"""The suffix drafter: model-free drafts that continue the longest earlier match of the committed sequence
(suffix decoding, Oliaro et al. 2024).

Sources, searched every step: the request's own prompt and output (a SuffixAutomaton appended as tokens are
committed), and, when SuffixConfig.cache_tokens > 0, earlier requests of this drafter (finished automata in a
DocumentCache, each matched by a MatchCursor). The longest match wins; on a tie the request's own text.

The draft length follows the match's confidence: nothing below `min_match` matched tokens, then
`match_factor` draft tokens per matched token, up to `max_draft_len` (and the loop's k). Drafts are point
masses: Draft.probs is None, which the verifier (verify.py) reads in sampling mode as "the drafted token had
probability 1".

Rollback: the automaton holds only committed tokens (propose appends tokens[:, :n] before drafting, drafts are
never inserted), so the loop's accept never has anything to undo; a rollback below the committed length undoes
appends exactly (SuffixAutomaton.truncate) and re-runs the cache cursors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specquant.decode.sampling import SamplingConfig
from specquant.errors import SpecquantError
from specquant.spec_decode.config import MAX_DRAFT_LEN
from specquant.spec_decode.drafter import Draft
from specquant.spec_decode.suffix_automaton import DocumentCache, Match, MatchCursor, SuffixAutomaton


@dataclass
class SuffixConfig:
    # K = 20: the suffix-decoding entry of the leaderboard drafted up to 20 tokens (../shared/PEERS.md)
    # The drafter's own k: `--draft suffix` drafts up to this many tokens, whatever --draft-len (build_engine)
    max_draft_len: int = field(default=20, metadata={"help": "suffix drafter: the most draft tokens per step (its "
                                                             "own k; --draft-len and --adaptive do not apply)",
                                                     "flag": "--suffix-max-draft-len"})
    # a 1-2 token match is often chance on real text; 3 still drafts on repeats of a few words
    min_match: int = field(default=3, metadata={"help": "suffix drafter: draft only when at least this many "
                                                        "tokens of the sequence's end matched earlier text",
                                                "flag": "--suffix-min-match"})
    match_factor: float = field(default=1.0, metadata={
        "help": "suffix drafter: draft tokens per matched token (longer matches draft more)",
        "flag": "--suffix-match-factor"})
    # off by default: a bench repeats its prompts, so a cache would measure replay rather than drafting (see the
    # replay row of benchmarks/suffix.py)
    cache_tokens: int = field(default=0, metadata={
        "help": "suffix drafter: keep earlier requests (least recently used first out, this many tokens in all) "
                "as draft sources; 0 = the request's own text only", "flag": "--suffix-cache-tokens"})
    cache_requests: int = field(default=16, metadata={
        "help": "suffix drafter: at most this many earlier requests in the cache (each costs a lookup per token)",
        "flag": "--suffix-cache-requests"})
    # exact would cost the suffix-link depth per token, which grows with repetition (suffix_automaton.py)
    recency_depth: int = field(default=8, metadata={
        "help": "suffix drafter: states updated per token to track each match's most recent occurrence",
        "flag": "--suffix-recency-depth"})

    def validate(self) -> "SuffixConfig":
        if not 1 <= self.max_draft_len <= MAX_DRAFT_LEN:
            raise SpecquantError(f"suffix max_draft_len {self.max_draft_len} is out of range; use 1..{MAX_DRAFT_LEN}")
        if self.min_match < 1:
            raise SpecquantError(f"suffix min_match {self.min_match} must be at least 1")
        if self.match_factor <= 0:
            raise SpecquantError(f"suffix match_factor {self.match_factor} must be positive (e.g. 1.0)")
        if self.cache_tokens < 0 or self.cache_requests < 1:
            raise SpecquantError(f"suffix cache_tokens {self.cache_tokens} / cache_requests {self.cache_requests} "
                                 "must be >= 0 / >= 1; use cache_tokens 0 to switch the cache off")
        if self.recency_depth < 1:
            raise SpecquantError(f"suffix recency_depth {self.recency_depth} must be at least 1")
        return self

    def draft_len(self, match_length: int, k: int) -> int:
        """Draft tokens for a match of match_length tokens when the loop allows k."""
        if match_length < self.min_match:
            return 0
        return max(0, min(k, self.max_draft_len, max(1, int(self.match_factor * match_length))))


@dataclass(frozen=True)
class SuffixProposal:
    match: Match  # the longest match found (NO_MATCH: none at all)
    source: str  # where the draft comes from: "self", "cache", or "none" (the match is too short to draft)
    tokens: list[int]  # the draft, already cut to the confidence rule's length


class SuffixDrafter:
    """A Drafter (spec_decode/drafter.py) that reads no target state: `target_layers = ()`."""

    target_layers: tuple[int, ...] = ()

    def __init__(self, config: SuffixConfig | None = None):
        self.config = (config or SuffixConfig()).validate()
        cfg = self.config
        self.max_draft_len = cfg.max_draft_len  # the loop never asks for more
        # The loop's k: the drafter's own, not SpecConfig.draft_len (build_engine reads own_draft_len). The match
        # length already sets each step's draft length, before drafting; the loop's adaptive controller would
        # only cap it, by the previous step's outcome, ramping +2 per fully accepted step: long repeats (where
        # this drafter wins) would be drafted short for many steps.
        self.own_draft_len = cfg.max_draft_len
        self.cache = DocumentCache(cfg.cache_tokens, cfg.cache_requests) if cfg.cache_tokens else None
        self.doc: SuffixAutomaton | None = None
        self.cursors: list[tuple[int, MatchCursor]] = []
        self.last: SuffixProposal | None = None  # the latest proposal (for a hybrid drafter's rule, or a bench)

    def setup(self, batch: int, max_len: int) -> None:
        if batch != 1:
            raise SpecquantError(f"the suffix drafter runs batch 1; got batch {batch}")

    def prefill(self, prompt_ids: torch.Tensor, target_hidden: torch.Tensor | None = None) -> None:
        """A new request: the previous one's text joins the cache; the prompt is the new document."""
        if prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1:
            raise SpecquantError(f"the suffix drafter takes one prompt (batch 1); got shape {list(prompt_ids.shape)}")
        if self.cache is not None and self.doc is not None:
            self.cache.add(self.doc)
        prompt = prompt_ids[0].tolist()
        self.doc = SuffixAutomaton(prompt, recency_depth=self.config.recency_depth)
        self.cursors = [] if self.cache is None else [(i, MatchCursor(d)) for i, d in self.cache.docs.items()]
        for _, cursor in self.cursors:
            for t in prompt:
                cursor.feed(t)

    def _extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.doc.append(t)
            for _, cursor in self.cursors:
                cursor.feed(t)

    def _sync(self, tokens: torch.Tensor) -> None:
        """Make the document equal the committed sequence tokens [1, n] (append what it lacks)."""
        n = tokens.shape[1]
        if n < len(self.doc):
            self.rollback(n)
        elif n > len(self.doc):
            self._extend(tokens[0, len(self.doc) : n].tolist())  # the one host read of the step

    def peek(self, tokens: torch.Tensor, k: int) -> SuffixProposal:
        """What propose would draft after tokens [1, n] (the committed sequence), as host data: the match (also
        when too short to draft from, for a rule choosing between drafters), its source and the tokens."""
        self._sync(tokens)
        self.last = self._lookup(k)
        return self.last

    def _lookup(self, k: int) -> SuffixProposal:
        """The longest match over all sources, its continuation cut to the confidence rule's length."""
        best, chosen = self.doc.match, None
        for i, cursor in self.cursors:
            m = cursor.match()
            if m.length > best.length and m.end + 1 < len(cursor.automaton):  # a match with something after it
                best, chosen = m, (i, cursor)
        count = self.config.draft_len(best.length, k)
        if count == 0:
            return SuffixProposal(best, "none", [])
        if chosen is None:
            return SuffixProposal(best, "self", self.doc.continuation(best, count))
        self.cache.touch(chosen[0])
        return SuffixProposal(best, "cache", chosen[1].continuation(count))

    def propose(self, tokens: torch.Tensor, k: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        drafted = self.peek(tokens, k).tokens
        return Draft(torch.tensor([drafted], dtype=torch.long, device=tokens.device))

    def propose_tree(self, tokens: torch.Tensor, nodes: int, depth: int, sampling: SamplingConfig,
                     generator: torch.Generator | None) -> Draft:
        """The chain propose drafts, plus the other continuations of the same match (suffix_tree.py), as a
        draft tree of at most `nodes` tokens; point masses like the chain."""
        from specquant.spec_decode.suffix_tree import continuation_tree

        proposal = self.peek(tokens, depth)
        sam, state = self.doc, None
        if proposal.source == "self":
            state = self.doc.link[self.doc.last]  # the match: the longest suffix that ended earlier too
        elif proposal.source == "cache":  # the first cursor with the winning match, as _lookup chose it
            cursor = next(c for _, c in self.cursors if c.match() == proposal.match)
            sam, state = cursor.automaton, cursor.state
        drafted, parents = continuation_tree(sam, state, proposal.tokens, nodes) if proposal.tokens else ([], [])
        return Draft(torch.tensor([drafted], dtype=torch.long, device=tokens.device), parents=tuple(parents))

    def accept(self, length: int, target_hidden: torch.Tensor | None = None) -> None:
        # the accepted drafts (and the bonus token) are read from the committed sequence at the next propose
        self.rollback(length)

    def rollback(self, length: int) -> None:
        if self.doc is None or length >= len(self.doc):
            return
        self.doc.truncate(length)
        for _, cursor in self.cursors:
            cursor.reset()
            for t in self.doc.tokens:
                cursor.feed(t)
