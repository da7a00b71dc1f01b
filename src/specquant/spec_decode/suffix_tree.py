"""Draft trees from a suffix automaton: the suffix drafter's chain, plus the other continuations of its match.

The automaton state of the matched suffix x has one transition per distinct token that followed an occurrence of x
(suffix_automaton.py), and walking transitions from there spells every continuation the text holds: a trie of them,
for free. The tree keeps the chain draft whole first (so a tree never holds less than the chain it extends), then
adds the other branches best first: a branch's rank is how many times its path left a state's most recent
continuation (0 along the most recent one, r for the r-th most recent sibling), and among equal ranks the shallower
node first. Recency, not counts: the automaton records each state's most recent occurrence, not how many there
are (an occurrence count per state would cost a pass over the suffix links per token).
"""

from __future__ import annotations

import heapq

from specquant.spec_decode.suffix_automaton import SuffixAutomaton


def continuation_tree(sam: SuffixAutomaton, state: int, chain: list[int], nodes: int
                      ) -> tuple[list[int], list[int]]:
    """(tokens, parents) as Draft.parents reads them: chain (the drafter's continuation of the match in state)
    under the root, then other continuations from the automaton, at most `nodes` tokens in all and none deeper
    than the chain."""
    tokens = list(chain[:nodes])
    parents = list(range(len(tokens)))
    depth = len(tokens)
    # the automaton state reached at each node of the chain (None past the text: a periodic continuation)
    states = [state]
    for t in tokens:
        states.append(None if states[-1] is None else sam.next[states[-1]].get(t))
    heap: list[tuple[int, int, int, int, int, int]] = []  # (rank, depth, order, parent node, token, state)
    order = 0

    def offer(node: int, at: int | None, d: int, rank: int, skip: int | None) -> None:
        """Queue node's children (at depth d + 1) other than skip, most recent first."""
        nonlocal order
        if at is None or d >= depth:
            return
        kids = sorted(((tok, s) for tok, s in sam.next[at].items() if tok != skip), key=lambda kv: -sam.recent[kv[1]])
        first = 0 if skip is None else 1  # a chain node's most recent continuation is the chain itself
        for r, (tok, s) in enumerate(kids[:nodes]):
            heapq.heappush(heap, (rank + first + r, d + 1, order, node, tok, s))
            order += 1

    for d, at in enumerate(states[:depth]):
        offer(d, at, d, 0, tokens[d])
    while heap and len(tokens) < nodes:
        rank, d, _, parent, tok, s = heapq.heappop(heap)
        tokens.append(tok)
        parents.append(parent)
        offer(len(tokens), s, d, rank, None)
    return tokens, parents
