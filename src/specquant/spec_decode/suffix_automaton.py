"""A suffix automaton over token ids (Blumer et al. 1985): the longest suffix of a growing sequence that occurred
earlier, and where, in O(1) amortized time per appended token.

Terms, used by the suffix drafter (suffix_drafter.py):
- match: the longest suffix of the sequence S[0..n-1] that also ends at an earlier position; its length, the
  end position e < n-1 of one earlier occurrence (S[e-L+1..e] == S[n-L..n-1]) and the state holding it (whose
  suffix links lead to the shorter suffixes with more occurrences, and whose transitions to what followed).

`SuffixAutomaton` is one document, appended token by token, with `truncate` undoing appends exactly (an undo log;
below the tokens it was constructed with, a rebuild), so it can follow a committed sequence that is rolled back.
The occurrence it reports is the most recent one, exactly when `recency_depth` is None; with a bound the
`recency_depth` nearest suffix-link ancestors of each new state are updated (constant work per token), and a
reported occurrence is always a true one but can be an older occurrence than the latest (see `_record_end`).
`first` (the earliest occurrence) is always exact.

Counts: `count[v]` is the number of end positions of state v's strings (how often they occur, the occurrence at the
sequence's end included), what the suffix drafter's frequency rule reads. Adding an end position touches every
suffix-link ancestor of the new state; with `count_depth` only that many are updated (constant work per token, like
`recency_depth`), so a short string's count can lag behind. `freeze` makes count and recent exact in one pass over
the states (a finished document is read, never appended to).

`MatchCursor` runs a second sequence against a finished automaton (matching statistics): the longest suffix of
that sequence occurring anywhere in the document, in O(1) amortized per token. The suffix drafter keeps finished
requests as automata in `DocumentCache`, a first-in-first-out cache bounded in total tokens and in count.

Hand-written rather than a library: the maintained implementation, arctic-inference's SuffixDecodingCache (the
suffix-decoding entry's drafter), ships as a vLLM plugin (it patches vLLM when installed) with a compiled
extension; a few dict operations per token in Python keep this drafter free of that dependency, with exact undo,
and testable against brute force.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

ROOT = 0


@dataclass(frozen=True)
class Match:
    length: int  # tokens in the matched suffix (0: none)
    end: int  # position of the matched suffix's last token at its earlier occurrence (-1 when length is 0)
    state: int = ROOT  # the automaton state holding the matched suffix (ROOT when length is 0)


NO_MATCH = Match(0, -1)


class SuffixAutomaton:
    """The suffix automaton of tokens appended one at a time; `match` describes the current sequence's suffix.

    States live in parallel lists (index = state id): `next` transitions (dict token -> state), suffix `link`,
    `length` (the longest string of the state), `first` (end of the state's earliest occurrence), `recent`
    (end of its most recent recorded occurrence) and `count` (its recorded occurrences).
    """

    def __init__(self, tokens=(), recency_depth: int | None = 8, undo: bool = True, count_depth: int | None = 32):
        self.recency_depth, self.count_depth, self.undo = recency_depth, count_depth, undo
        self._reset(tokens)

    def _reset(self, tokens) -> None:
        """The automaton of `tokens`, built without undo records: a truncate below them rebuilds instead (a
        prompt is never rolled back in the loop, and its records would double its build time)."""
        self.next: list[dict[int, int]] = [{}]
        self.link = [-1]
        self.length = [0]
        self.first = [-1]
        self.recent = [-1]
        self.count = [0]  # the root's count is never read (a draft starts from a match of at least one token)
        self.last = ROOT
        self.tokens: list[int] = []
        self.matches: list[Match] = []  # matches[i]: the match of the prefix S[0..i]
        self._log: list[tuple] | None = None
        for t in tokens:
            self.append(int(t))
        self._log_start = len(self.tokens)  # appends from here on have undo records
        self._log = [] if self.undo else None

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def match(self) -> Match:
        return self.matches[-1] if self.matches else NO_MATCH

    def append(self, token: int) -> None:
        """Append one token (Blumer et al.'s online construction, with an undo record)."""
        n = len(self.tokens)
        nxt, link, length = self.next, self.link, self.length
        states_before, prev_last = len(link), self.last
        cur = self._new_state(length[prev_last] + 1, n, n, 1)
        added, redirected, split = [], [], None
        p = prev_last
        while p != -1 and token not in nxt[p]:
            nxt[p][token] = cur
            added.append(p)
            p = link[p]
        if p == -1:
            link[cur] = ROOT
        else:
            q = nxt[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:  # split q: the strings of q up to length[p] + 1 gain the end position n
                clone = self._new_state(length[p] + 1, self.first[q], self.recent[q], self.count[q])
                nxt[clone] = dict(nxt[q])
                link[clone] = link[q]
                split = (q, link[q])
                while p != -1 and nxt[p].get(token) == q:
                    nxt[p][token] = clone
                    redirected.append(p)
                    p = link[p]
                link[q] = link[cur] = clone
        v = link[cur]
        # read the occurrence before n is recorded on v: the match must end strictly earlier
        self.matches.append(Match(length[v], self.recent[v], v) if v != ROOT else NO_MATCH)
        self.tokens.append(token)
        self.last = cur
        changed = self._record_end(v, n)
        if self._log is not None:
            self._log.append((prev_last, states_before, token, added, redirected, split, changed))

    def _new_state(self, length: int, first: int, recent: int, count: int) -> int:
        self.next.append({})
        self.link.append(-1)
        self.length.append(length)
        self.first.append(first)
        self.recent.append(recent)
        self.count.append(count)
        return len(self.link) - 1

    def _record_end(self, v: int, n: int) -> list[tuple[int, int]]:
        """Record end position n on v and its suffix-link ancestors: every one of them now also ends at n
        (`recent` set to n, `count` one more).

        Walking the whole chain is exact but costs its depth, which grows with the sequence on repetitive text
        (about n / period on a periodic one). With `recency_depth` only that many states get `recent`; the query
        reads `recent` of the match state only, and it is stale only when the state's latest occurrence happened
        while it sat deeper than the bound below the then-new state (a long run of repeats nested inside each
        other). `count_depth` bounds the count updates the same way: the states deeper than it (short strings)
        undercount. Returns the (state, old recent) pairs visited, for the undo log."""
        changed = []
        r_depth, c_depth = self.recency_depth, self.count_depth
        depth = None if r_depth is None or c_depth is None else max(r_depth, c_depth)
        recent, count, link = self.recent, self.count, self.link
        while v > ROOT and (depth is None or len(changed) < depth):
            i = len(changed)
            changed.append((v, recent[v]))
            if r_depth is None or i < r_depth:
                recent[v] = n
            if c_depth is None or i < c_depth:
                count[v] += 1
            v = link[v]
        return changed

    def truncate(self, length: int) -> None:
        """Undo appends until `length` tokens remain: the automaton is then exactly as it was at that length."""
        if length >= len(self.tokens):
            return
        if self._log is None:
            raise RuntimeError("this automaton keeps no undo log (undo=False); rebuild it instead")
        if length < self._log_start:
            self._reset(self.tokens[:length])
            return
        nxt, link = self.next, self.link
        while len(self.tokens) > length:
            prev_last, states_before, token, added, redirected, split, changed = self._log.pop()
            c_depth = self.count_depth
            for i, (v, old) in enumerate(changed):
                self.recent[v] = old  # unchanged when past recency_depth: old is what it held
                if c_depth is None or i < c_depth:
                    self.count[v] -= 1
            if split is not None:
                q, q_link = split
                link[q] = q_link
                for p in redirected:
                    nxt[p][token] = q
            for p in added:
                del nxt[p][token]
            del nxt[states_before:], link[states_before:], self.length[states_before:]
            del self.first[states_before:], self.recent[states_before:], self.count[states_before:]
            self.last = prev_last
            self.tokens.pop()
            self.matches.pop()

    def freeze(self) -> "SuffixAutomaton":
        """Drop the undo log (a finished document is never truncated) and make `count` and `recent` exact: each
        state's end positions are those of the prefix states below it in the suffix-link tree (one pass, longest
        first). A prefix state (made for a new token, not a clone) is the one whose longest string starts at 0."""
        self._log, self.undo = None, False
        length, first, link = self.length, self.first, self.link
        count = [1 if length[v] == first[v] + 1 else 0 for v in range(len(link))]
        recent = [first[v] if count[v] else -1 for v in range(len(link))]
        by_length: list[list[int]] = [[] for _ in range(len(self.tokens) + 1)]  # a counting sort: O(states)
        for v in range(1, len(link)):
            by_length[length[v]].append(v)
        for bucket in reversed(by_length):
            for v in bucket:
                u = link[v]
                count[u] += count[v]
                recent[u] = max(recent[u], recent[v])
        count[ROOT], recent[ROOT] = 0, -1
        self.count, self.recent = count, recent
        return self


class MatchCursor:
    """Matching statistics of a sequence fed token by token against a finished automaton: the longest suffix of
    the fed sequence that occurs in the automaton's document, and the state holding it."""

    def __init__(self, automaton: SuffixAutomaton):
        self.automaton = automaton
        self.state, self.length = ROOT, 0

    def feed(self, token: int) -> None:
        sam = self.automaton
        nxt, link = sam.next, sam.link
        state, length = self.state, self.length
        while state != ROOT and token not in nxt[state]:
            state = link[state]
            length = sam.length[state]
        if token in nxt[state]:
            state, length = nxt[state][token], length + 1
        self.state, self.length = state, length

    def reset(self) -> None:
        self.state, self.length = ROOT, 0

    def match(self) -> Match:
        """The matched suffix and its earliest occurrence in the document (the one with the longest continuation
        after it: a finished document has no recency relation to the sequence fed)."""
        if self.length == 0:
            return NO_MATCH
        return Match(self.length, self.automaton.first[self.state], self.state)


class DocumentCache:
    """Finished documents (frozen automata), first in first out, bounded in total tokens and in count (a reader
    matches against every document, so the count bounds its per-token work)."""

    def __init__(self, max_tokens: int, max_docs: int):
        self.max_tokens, self.max_docs = max_tokens, max_docs
        self.docs: OrderedDict[int, SuffixAutomaton] = OrderedDict()
        self.tokens = 0
        self._ids = 0

    def __len__(self) -> int:
        return len(self.docs)

    def add(self, automaton: SuffixAutomaton) -> int | None:
        """Insert a finished document; evicts the oldest until the total fits. A document longer than the whole
        budget is not kept (None)."""
        if len(automaton) == 0 or len(automaton) > self.max_tokens:
            return None
        self._ids += 1
        self.docs[self._ids] = automaton.freeze()
        self.tokens += len(automaton)
        while self.tokens > self.max_tokens or len(self.docs) > self.max_docs:
            _, old = self.docs.popitem(last=False)
            self.tokens -= len(old)
        return self._ids
