"""The suffix drafter: model-free drafts that continue earlier occurrences of the committed sequence's end
(suffix decoding, Oliaro et al. 2024), scored by how often each continuation followed.

Sources, searched every step: the request's own prompt and output (a SuffixAutomaton appended as tokens are
committed), and, when SuffixConfig.cache_tokens > 0, earlier requests of this drafter (finished automata in a
first-in-first-out DocumentCache, each matched by a MatchCursor).

The draft rule (terms as in suffix_automaton.py; a brute-force statement of it is in tests/test_suffix_drafter.py):
- candidates: per source, the longest suffix x of the sequence that occurs there (length L), then up to
  `candidates - 1` shorter suffixes with other occurrence sets (the automaton's suffix-link ancestors; within one
  state every length has the same occurrences, so its longest is the best), none shorter than `min_match`;
- a candidate drafts up to min(k, max_draft_len, floor(L * match_factor + match_offset)) tokens by walking on from
  x: at each branch (`branch`) the most recent continuation, or the one that occurred most often (ties: the most
  recent); its probability is count(x c) / count(x), where count includes an occurrence at the sequence's end (no
  continuation yet); the running product of these is each token's probability, and the walk stops when it falls
  below `min_token_prob`;
- its score is the sum of its tokens' probabilities (expected accepted tokens, were they independent); the best
  score over candidates and sources wins (ties: the longer match, then the request's own text, then the newest
  cached request). Arctic-inference's suffix decoding scores the same way, over a depth-bounded suffix tree.
- In the request's own text a walk can run into the sequence's end (its string then occurs only there): it goes on
  periodically, as the sequence would read if the draft came true.

Drafts are point masses: Draft.probs is None, which the verifier (verify.py) reads in sampling mode as "the
drafted token had probability 1", so the rule changes what is drafted, never what is emitted.

Rollback: the automaton holds only committed tokens (propose appends tokens[:, :n] before drafting, drafts are
never inserted), so the loop's accept never has anything to undo; a rollback below the committed length undoes
appends exactly (SuffixAutomaton.truncate) and re-runs the cache cursors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from specquant.decode.sampling import SamplingConfig
from specquant.errors import SpecquantError
from specquant.spec_decode.config import MAX_DRAFT_LEN
from specquant.spec_decode.drafter import Draft
from specquant.spec_decode.suffix_automaton import NO_MATCH, ROOT, DocumentCache, Match, MatchCursor, SuffixAutomaton

# an upper estimate of a cached request's memory per token (about 2 states per token, each a dict of transitions
# and five list slots; measured in docs/BENCH.md, "Suffix drafter"), for the --suffix-cache-tokens help
BYTES_PER_CACHED_TOKEN = 1024


@dataclass
class SuffixConfig:
    # K = 20: the suffix-decoding entry of the leaderboard drafted up to 20 tokens (../shared/PEERS.md)
    # The drafter's own k: `--draft suffix` drafts up to this many tokens, whatever --draft-len (build_engine)
    max_draft_len: int = field(default=20, metadata={"help": "suffix drafter: the most draft tokens per step (its "
                                                             "own k; --draft-len and --adaptive do not apply)",
                                                     "flag": "--suffix-max-draft-len"})
    # a 1-2 token match is often chance on real text; 3 still drafts on repeats of a few words
    min_match: int = field(default=3, metadata={"help": "suffix drafter: draft only from matches of at least this "
                                                        "many tokens of the sequence's end",
                                                "flag": "--suffix-min-match"})
    match_factor: float = field(default=1.0, metadata={
        "help": "suffix drafter: draft tokens per matched token, floor(match * factor + offset) up to the k "
                "(arctic-inference's max_spec_factor)", "flag": "--suffix-match-factor"})
    match_offset: float = field(default=0.0, metadata={
        "help": "suffix drafter: draft tokens added to match * factor (arctic-inference's max_spec_offset)",
        "flag": "--suffix-match-offset"})
    # 0: a draft is cut by its length rule only; the score still prefers likely drafts
    min_token_prob: float = field(default=0.0, metadata={
        "help": "suffix drafter: stop a draft where the running product of its tokens' frequencies falls below "
                "this (0..1)", "flag": "--suffix-min-token-prob"})
    # "recent" by default: on the bundled targets' greedy streams it accepts as much as "frequent" or more on most
    # sets (loops in greedy output repeat their latest turn), and keeps the real-text MAL of the first suffix
    # drafter, which drafted from the most recent occurrence (docs/BENCH.md, "Suffix drafter")
    branch: str = field(default="recent", metadata={
        "help": "suffix drafter: at a branch take the most recent continuation, or the one that occurred most often "
                "(ties: the most recent; arctic-inference's rule)", "choices": ("recent", "frequent"),
        "flag": "--suffix-branch"})
    # 1 by default: at our min_match / match_factor a shorter candidate's higher frequency won drafts that were
    # accepted less on prose (docs/BENCH.md); at the peer's knobs (min_match 1, factor 3) it is worth trying more
    candidates: int = field(default=1, metadata={
        "help": "suffix drafter: match lengths scored per source, the longest and shorter ones with other "
                "occurrences (each costs a draft walk per step)", "flag": "--suffix-candidates"})
    # off by default: a bench repeats its prompts, so a cache would measure replay rather than drafting (see the
    # replay row of benchmarks/suffix.py at dfedb37); `specquant serve` turns it on (drafters/suffix.py, SERVE_OPTIONS)
    cache_tokens: int = field(default=0, metadata={
        "help": "suffix drafter: keep earlier requests (first in first out, this many tokens in all; memory about "
                f"{BYTES_PER_CACHED_TOKEN // 1024} KiB per token) as draft sources; 0 = the request's own text only",
        "flag": "--suffix-cache-tokens"})
    cache_requests: int = field(default=16, metadata={
        "help": "suffix drafter: at most this many earlier requests in the cache (each costs a lookup per token)",
        "flag": "--suffix-cache-requests"})
    # exact would cost the suffix-link depth per token, which grows with repetition (suffix_automaton.py)
    recency_depth: int = field(default=8, metadata={
        "help": "suffix drafter: states updated per token to track each match's most recent occurrence",
        "flag": "--suffix-recency-depth"})
    # the same walk; short strings (deep in the chain) are the ones it undercounts
    count_depth: int = field(default=32, metadata={
        "help": "suffix drafter: states updated per token to count occurrences (the request's own text; cached "
                "requests count exactly)", "flag": "--suffix-count-depth"})

    def validate(self) -> "SuffixConfig":
        if not 1 <= self.max_draft_len <= MAX_DRAFT_LEN:
            raise SpecquantError(f"suffix max_draft_len {self.max_draft_len} is out of range; use 1..{MAX_DRAFT_LEN}")
        if self.min_match < 1:
            raise SpecquantError(f"suffix min_match {self.min_match} must be at least 1")
        if not self.match_factor > 0:
            raise SpecquantError(f"suffix match_factor {self.match_factor} must be positive (e.g. 1.0)")
        if not math.isfinite(self.match_offset):
            raise SpecquantError(f"suffix match_offset {self.match_offset} must be a finite number (e.g. 0)")
        if not 0 <= self.min_token_prob <= 1:
            raise SpecquantError(f"suffix min_token_prob {self.min_token_prob} is outside 0..1 (e.g. 0 or 0.1)")
        if self.branch not in BRANCH_KEYS:
            raise SpecquantError(f"suffix branch {self.branch!r} is not one of {', '.join(BRANCH_KEYS)}")
        if self.candidates < 1:
            raise SpecquantError(f"suffix candidates {self.candidates} must be at least 1 (e.g. 1 or 8)")
        if self.cache_tokens < 0 or self.cache_requests < 1:
            raise SpecquantError(f"suffix cache_tokens {self.cache_tokens} / cache_requests {self.cache_requests} "
                                 "must be >= 0 / >= 1; use cache_tokens 0 to switch the cache off")
        if self.recency_depth < 1 or self.count_depth < 1:
            raise SpecquantError(f"suffix recency_depth {self.recency_depth} / count_depth {self.count_depth} must "
                                 "be at least 1 (e.g. 8 / 32)")
        return self

    def draft_len(self, match_length: int, k: int) -> int:
        """Draft tokens for a match of match_length tokens when the loop allows k."""
        if match_length < self.min_match:
            return 0
        return max(0, min(k, self.max_draft_len, int(match_length * self.match_factor + self.match_offset + 1e-6)))


@dataclass(frozen=True)
class SuffixProposal:
    match: Match  # the longest match over all sources (NO_MATCH: none at all), whether or not it drafted
    source: str  # where the draft comes from: "self", "cache", or "none" (no candidate drafts)
    tokens: list[int]  # the draft
    score: float = 0.0  # the sum of its tokens' probabilities (module docstring)
    match_len: int = 0  # the length of the candidate the draft continues


# SuffixConfig.branch -> the order of a state's continuations (children states), best last
BRANCH_KEYS = {"frequent": lambda counts, recent: lambda tc: (counts[tc[1]], recent[tc[1]]),
               "recent": lambda counts, recent: lambda tc: recent[tc[1]]}


def walk(sam: SuffixAutomaton, state: int, count: int, periodic: bool, min_token_prob: float,
         branch: str) -> tuple[list[int], float]:
    """Up to `count` tokens continuing the strings of `state` by their best continuation (`branch`: the most
    frequent, ties the most recent; or the most recent), and the draft's score. periodic: `sam` is the request's
    own text, where a walk reaching the sequence's end goes on with the period it drafted (module docstring)."""
    nxt, counts, recent = sam.next, sam.count, sam.recent
    key = BRANCH_KEYS[branch](counts, recent)
    tokens: list[int] = []
    prob, score, here = 1.0, 0.0, counts[state]
    while len(tokens) < count:
        children = nxt[state]
        if len(children) == 1:
            (token, child), = children.items()
        elif children:
            token, child = max(children.items(), key=key)
        else:
            if periodic and tokens:  # the string walked to is a suffix of the sequence: it repeats from here
                period = len(tokens)
                while len(tokens) < count:
                    tokens.append(tokens[-period])
                    score += prob
            break
        # counts[child] <= here when both are exact; a bounded count walk can leave a short string's count behind
        # its continuation's, hence the cap
        there = counts[child]
        if there < here:
            prob *= there / here
            if prob < min_token_prob:
                break
        tokens.append(token)
        score += prob
        state, here = child, there
    return tokens, score


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
        self.doc = SuffixAutomaton(prompt, recency_depth=self.config.recency_depth, count_depth=self.config.count_depth)
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
        """The best-scoring draft over every source's candidates (module docstring)."""
        sources = [("self", self.doc, self.doc.match)]
        sources += [("cache", c.automaton, c.match()) for _, c in reversed(self.cursors)]  # newest first
        longest = max((m for _, _, m in sources), key=lambda m: m.length, default=NO_MATCH)
        best = SuffixProposal(longest, "none", [])
        cfg = self.config
        for source, sam, m in sources:
            own = source == "self"
            state, length = m.state, m.length
            for _ in range(cfg.candidates):
                if state == ROOT or length < cfg.min_match:
                    break
                count = cfg.draft_len(length, k)
                if count <= best.score:
                    break  # a draft scores at most its length, and shorter matches draft no more
                # In the request's own text every candidate also ends at the sequence's end, where nothing follows
                # it yet: its first token's probability is at most (c - 1) / c (c: its count), and so is each one's.
                here = sam.count[state]
                if not own or count * (here - 1) > best.score * here:
                    tokens, score = walk(sam, state, count, own, cfg.min_token_prob, cfg.branch)
                    if score > best.score:
                        best = SuffixProposal(longest, source, tokens, score, length)
                state = sam.link[state]
                length = sam.length[state]
        return best

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
