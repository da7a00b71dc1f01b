"""Tree verification: which root path of a draft tree the target keeps, and its recovered or bonus token.

A draft tree (Draft.parents, spec_decode/drafter.py) has N - 1 draft tokens below a root, node 0: the last committed
token. Draft token i is node i + 1, whose parent is parents[i] (0 <= parents[i] <= i); the chain of k drafts is the
tree with parents (0, 1, ..., k - 1). The target scores every node in one forward (model/tree.py): its logits at
node u are its next-token distribution after u's root path. Terms as verify.py defines them, per path:
- accepted path: the root and the draft nodes kept, a root path; its length - 1 tokens are accepted tokens.
- greedy: from the root, move to the first child whose token is the target's argmax at the current node, until no
  child matches; that argmax is the bonus token (at a leaf) or the recovered token.
- sampling: multi-candidate rejection sampling, sequential over siblings (SpecInfer's multi-step speculative
  sampling, with a distribution per child): at node u, with residual r = target_probs_u, try each child c (token
  x_c, drawn from draft_probs_c) in order: keep it with probability min(1, r(x_c) / draft_probs_c(x_c)) and move
  to c; else r <- normalize(max(0, r - draft_probs_c)) and try the next. When no child is kept, the token is drawn
  from r. Each try is one standard rejection step against the current r, so the emitted token follows target_probs_u
  whenever each child's token was drawn from its draft_probs independently of its siblings' (iid samples, or point
  masses: a model-free or top-k draft, draft_probs None; a point mass r(x_c) is then kept with probability r(x_c)
  and the residual is r with x_c zeroed). Tokens drawn from one distribution without replacement are not
  independent and must be given as point masses.
On a chain both rules are verify.py's (tests compare them on the same random numbers).

`tree_verify` is what the loop calls; the rules take their randomness as arguments (one uniform per node, used when
that node is tried; exponential noise for the final draw), so the plain reference below can be compared exactly.
"""

from __future__ import annotations

import torch

from specquant.decode.sampling import SamplingConfig, argmax, logits_to_probs
from specquant.model.tree import TreeLayout


def layout(parents: tuple[int, ...] | list[int]) -> TreeLayout:
    """The TreeLayout of a draft tree: the root, then draft token i as node i + 1 under parents[i]."""
    return TreeLayout((-1, *parents))


def chain_parents(k: int) -> tuple[int, ...]:
    """Draft.parents of a chain of k drafts."""
    return tuple(range(k))


def tree_verify(draft_tokens: torch.Tensor, tree: TreeLayout, draft_probs: torch.Tensor | None,
                target_logits: torch.Tensor, sampling: SamplingConfig,
                generator: torch.Generator | None) -> tuple[list[int], int]:
    """One tree verify step: (accepted path as node ids, root first; recovered-or-bonus token).

    draft_tokens [N-1]; draft_probs [N-1, vocab] (sampling; None: point masses, or greedy); target_logits [N, vocab]:
    the target's logits at every node.
    """
    if sampling.greedy:
        return greedy_tree_verify(draft_tokens, tree, target_logits)
    target_probs = logits_to_probs(target_logits, sampling)
    device = target_logits.device
    uniforms = torch.rand(len(tree), generator=generator, device=device)
    noise = torch.empty(target_probs.shape[-1], device=device).exponential_(generator=generator)
    return tree_rejection_sample(draft_tokens, tree, draft_probs, target_probs, uniforms, noise)


def greedy_tree_verify(draft_tokens: torch.Tensor, tree: TreeLayout, target_logits: torch.Tensor
                       ) -> tuple[list[int], int]:
    """draft_tokens [N-1], target_logits [N, vocab] -> (accepted path, recovered-or-bonus token)."""
    n = len(tree)
    both = torch.cat([argmax(target_logits), draft_tokens]).tolist()  # the step's one host sync
    best, tokens = both[:n], [None, *both[n:]]
    node, path = 0, [0]
    while True:
        child = next((c for c in tree.children[node] if tokens[c] == best[node]), None)
        if child is None:
            return path, best[node]
        node = child
        path.append(node)


def tree_rejection_sample(draft_tokens: torch.Tensor, tree: TreeLayout, draft_probs: torch.Tensor | None,
                          target_probs: torch.Tensor, uniforms: torch.Tensor, noise: torch.Tensor
                          ) -> tuple[list[int], int]:
    """Sampling-mode tree verification (module docstring). draft_tokens [N-1]; draft_probs [N-1, vocab] or None
    (point masses); target_probs [N, vocab]; uniforms [N] (node c's is used when c is tried; the root's never);
    noise [vocab] Exp(1) draws for the final token (exponential race)."""
    tokens = [None, *draft_tokens.tolist()]
    node, path = 0, [0]
    while True:
        residual = target_probs[node]
        for c in tree.children[node]:
            x = tokens[c]
            # u < p/q without a division, in the tensors' precision (as verify.rejection_sample decides)
            keep = uniforms[c] <= residual[x] if draft_probs is None else \
                uniforms[c] * draft_probs[c - 1, x] <= residual[x]
            if bool(keep):
                break
            if draft_probs is None:  # max(0, r - one_hot(x)) is r with x zeroed (r <= 1)
                left = residual.scatter(0, torch.tensor([x], device=residual.device), 0.0)
            else:
                left = (residual - draft_probs[c - 1]).clamp_min(0)
            total = left.sum()
            # r == q up to rounding cannot reject in exact arithmetic; if it did, r itself is the right law
            if float(total) > 0:
                residual = left / total.clamp_min(1e-30)
        else:
            return path, int(argmax(residual / noise))
        node = c
        path.append(node)


def tree_rejection_sample_reference(draft_tokens, tree: TreeLayout, draft_probs, target_probs, uniforms,
                                    noise) -> tuple[list[int], int]:
    """The same rule as a plain loop over Python numbers; the test oracle for tree_rejection_sample."""
    tokens = [None, *[int(t) for t in draft_tokens]]
    node, path = 0, [0]
    while True:
        residual = [float(a) for a in target_probs[node]]
        accepted = None
        for c in tree.children[node]:
            x = tokens[c]
            row = [1.0 if j == x else 0.0 for j in range(len(residual))] if draft_probs is None \
                else [float(b) for b in draft_probs[c - 1]]
            if float(uniforms[c]) * row[x] <= residual[x]:
                accepted = c
                break
            left = [max(0.0, a - b) for a, b in zip(residual, row)]
            total = sum(left)
            if total > 0:
                residual = [a / total for a in left]
        if accepted is None:
            scores = [d / float(e) for d, e in zip(residual, noise)]
            return path, max(range(len(scores)), key=lambda j: scores[j])
        node = accepted
        path.append(node)


def best_first_tree(logprobs: torch.Tensor, nodes: int) -> tuple[list[int], list[int]]:
    """A draft tree from per-depth distributions that do not depend on the path (a block drafter's: its block
    positions are drafted in parallel), DDTree-style: the `nodes` root paths of highest probability, each path's
    score the sum of its tokens' log-probabilities at their depths. Best first: a heap of frontier candidates,
    where taking a node offers its first child (the next depth's best token) and its next sibling (the same
    depth's next-best token under the same parent); every prefix of a taken path scores at least as high, so the
    taken set is a tree. logprobs [depth, vocab] -> (tokens, parents) as Draft.parents reads them; siblings come
    best first.
    """
    import heapq

    depth = logprobs.shape[0]
    if depth == 0 or nodes <= 0:
        return [], []
    width = min(nodes, logprobs.shape[1])
    top_lp, top_ids = (t.tolist() for t in logprobs.topk(width, dim=-1))  # [depth, width] each, best first
    tokens, parents = [], []
    # (-score, order, parent node, depth, rank, parent's score); order breaks ties in insertion order
    heap, order = [(-top_lp[0][0], 0, 0, 0, 0, 0.0)], 1
    while heap and len(tokens) < nodes:
        neg, _, parent, d, rank, base = heapq.heappop(heap)
        tokens.append(top_ids[d][rank])
        parents.append(parent)
        node, score = len(tokens), -neg
        if d + 1 < depth:
            heapq.heappush(heap, (-(score + top_lp[d + 1][0]), order, node, d + 1, 0, score))
            order += 1
        if rank + 1 < width:
            heapq.heappush(heap, (-(base + top_lp[d][rank + 1]), order, parent, d, rank + 1, base))
            order += 1
    return tokens, parents
