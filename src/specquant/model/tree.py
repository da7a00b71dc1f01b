"""The shape of a token tree, as the layers read it in a tree forward (Transformer.forward(..., tree=...)).

A tree forward scores N nodes in one pass: node 0 is the root (the last committed token, at position start), node i
has parent parents[i] < i, and its position is start + depth[i]. Each node must come out exactly as it would at the
end of the chain of tokens on its root path: attention sees the cache and the node's ancestors and itself (never a
sibling's branch); a recurrent layer continues from its parent's state. The chain is the tree whose node i has
parent i - 1.

Segments. The layers that compute a node the way a chain forward computes it (the native attention kernel, the
delta rule's step kernel) take each node in a chain. A segment is a maximal chain that starts at the root or at a
node that is not its parent's first child and follows first children to a leaf; every node lies in exactly one.
In depth-first order of their first nodes, a segment's ancestors (the path to its first node's parent) are the
nodes the earlier segments left at depths 0 .. d0 - 1: a KV cache written depth by depth holds, at every segment,
exactly its root path (model/attention.py); a recurrent layer starts the segment from its parent's state
(model/deltanet.py). A chain is one segment.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class TreeLayout:
    parents: tuple[int, ...]  # parents[0] == -1 (the root); 0 <= parents[i] < i

    def __post_init__(self):
        if not self.parents or self.parents[0] != -1:
            raise ValueError(f"a token tree starts at its root (parents[0] == -1); got {list(self.parents[:4])}")
        for i, p in enumerate(self.parents[1:], 1):
            if not 0 <= p < i:
                raise ValueError(f"tree node {i} has parent {p}; a parent comes before its child (0 <= p < {i})")

    @classmethod
    def chain(cls, n: int) -> "TreeLayout":
        return cls((-1, *range(n - 1)))

    def __len__(self) -> int:
        return len(self.parents)

    @cached_property
    def depth(self) -> tuple[int, ...]:
        out = [0] * len(self.parents)
        for i, p in enumerate(self.parents[1:], 1):
            out[i] = out[p] + 1
        return tuple(out)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        kids = [[] for _ in self.parents]
        for i, p in enumerate(self.parents[1:], 1):
            kids[p].append(i)
        return tuple(tuple(k) for k in kids)

    def path(self, node: int) -> list[int]:
        """The nodes from the root to node, both included."""
        out = [node]
        while self.parents[out[-1]] >= 0:
            out.append(self.parents[out[-1]])
        return out[::-1]

    @cached_property
    def segments(self) -> tuple[tuple[int, ...], ...]:
        """The chains the tree splits into (module docstring), in depth-first order."""
        out, stack = [], [0]
        while stack:
            seg = [stack.pop()]
            while self.children[seg[-1]]:
                first, *rest = self.children[seg[-1]]
                stack.extend(reversed(rest))  # visited after this segment's subtree, in child order
                seg.append(first)
            out.append(tuple(seg))
        return tuple(out)

    @cached_property
    def order(self) -> tuple[int, ...]:
        """The nodes segment by segment: in this order every segment is a contiguous run."""
        return tuple(i for seg in self.segments for i in seg)

    @cached_property
    def segment_starts(self) -> tuple[int, ...]:
        """Where each segment starts in `order`."""
        out, at = [], 0
        for seg in self.segments:
            out.append(at)
            at += len(seg)
        return tuple(out)

    @cached_property
    def place(self) -> tuple[tuple[int, int], ...]:
        """Per node: (its segment's index, its offset in that segment)."""
        out = [(0, 0)] * len(self.parents)
        for s, seg in enumerate(self.segments):
            for j, node in enumerate(seg):
                out[node] = (s, j)
        return tuple(out)

    def positions(self, start: int, device=None) -> torch.Tensor:
        """[N] long: each node's position, start + its depth."""
        return torch.tensor(self.depth, device=device) + start

    def ancestor_mask(self, device=None) -> torch.Tensor:
        """[N, N] bool: row i sees column j iff j is on i's root path (itself included)."""
        n = len(self.parents)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            mask[i, self.path(i)] = True
        return mask.to(device)

    def conv_windows(self, width: int) -> torch.Tensor:
        """[N, width] long: for each node, the last `width` inputs of its root path, as rows of
        cat(width - 1 inputs before the root, the N nodes' inputs): a causal conv's window, oldest first."""
        rows = []
        for i in range(len(self.parents)):
            seq = list(range(width - 1)) + [width - 1 + j for j in self.path(i)]
            rows.append(seq[-width:])
        return torch.tensor(rows, dtype=torch.long)
