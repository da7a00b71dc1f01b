"""Tree verification: the tree forward scores every node as the chain along its root path does (dense, hybrid,
random Qwen3.5), the caches keep exactly the accepted path, greedy tree speculation equals target-only decoding,
and the tree rejection sampler emits the target's law (spec_decode/tree.py, model/tree.py)."""

from __future__ import annotations

import random
import zlib

import pytest
import torch
from _qwen35_models import hf_model
from conftest import assert_follows_target_law, peaky_model, small_block_draft, target_greedy, target_law

from specquant.decode.sampling import SamplingConfig
from specquant.errors import SpecquantError
from specquant.model.config import ModelConfig
from specquant.model.decoder import Transformer
from specquant.model.tree import TreeLayout
from specquant.spec_decode.config import SpecConfig
from specquant.spec_decode.drafter import Draft
from specquant.spec_decode.engine import SpecEngine, generate
from specquant.spec_decode.tree import (best_first_tree, greedy_tree_verify, layout, tree_rejection_sample,
                                        tree_rejection_sample_reference)
from specquant.spec_decode.verify import rejection_sample


def random_tree(rng: random.Random, n: int) -> TreeLayout:
    """A random tree of n nodes: each node's parent uniform over the earlier nodes (deep and wide shapes alike)."""
    return TreeLayout((-1, *[rng.randrange(i) for i in range(1, n)]))


def tree_shapes(rng: random.Random, count: int, most: int = 16) -> list[TreeLayout]:
    """Random shapes up to `most` nodes, plus the extremes: a chain, a star and a single root."""
    shapes = [TreeLayout.chain(most), TreeLayout((-1, *[0] * (most - 1))), TreeLayout((-1,))]
    return shapes + [random_tree(rng, rng.randint(2, most)) for _ in range(count)]


# --- the layout ---------------------------------------------------------------------------------------------------

def test_segments_are_chains_in_depth_first_order_that_leave_each_ones_ancestors_in_place():
    rng = random.Random(0)
    for tree in tree_shapes(rng, 200):
        seen = sorted(i for seg in tree.segments for i in seg)
        assert seen == list(range(len(tree)))  # every node in exactly one segment
        slots = {}  # depth -> node last written there, as the attention path writes them
        for seg in tree.segments:
            assert all(tree.parents[b] == a for a, b in zip(seg, seg[1:]))  # a chain
            d0 = tree.depth[seg[0]]
            assert [slots[d] for d in range(d0)] == tree.path(seg[0])[:-1]  # its ancestors, in place
            for i, node in enumerate(seg):
                slots[d0 + i] = node
    assert TreeLayout.chain(7).segments == (tuple(range(7)),)


def test_conv_windows_follow_root_paths():
    rng = random.Random(1)
    for tree in tree_shapes(rng, 50):
        windows = tree.conv_windows(4).tolist()
        for i in range(len(tree)):
            seq = ["pre0", "pre1", "pre2"] + tree.path(i)
            names = ["pre0", "pre1", "pre2"] + list(range(len(tree)))
            assert [names[j] for j in windows[i]] == seq[-4:]
    with pytest.raises(ValueError, match="parent"):
        TreeLayout((-1, 0, 2))


# --- the tree forward against each root path as its own chain (the oracle) ------------------------------------------

def qwen35(shape: str) -> Transformer:
    theirs = hf_model(shape, 4, seed=11, scale=0.35)
    model = Transformer(ModelConfig.from_hf(theirs.config.to_dict()))
    model.load_state_dict(theirs.state_dict(), strict=False)
    return model.eval()


@pytest.fixture(scope="module")
def models():
    from conftest import bundled_available
    from specquant.loader import load_model

    out = {shape: qwen35(shape) for shape in ("gva", "mha")}
    for name in ("tiny-target", "tiny-hybrid"):
        if bundled_available(name):
            out[name] = load_model(name).eval()
    return out


# exact where every op takes the native kernels (the bundled models: fp32, DeltaNet value dim a multiple of 16);
# the random Qwen3.5 shapes (value dims 20 and 6) run the chunked delta rule, equal up to rounding, and so does
# every model where the native ops are off (SPECQUANT_NATIVE=off: SDPA and the reference DeltaNet forms)
EXACT = {"tiny-target": True, "tiny-hybrid": True, "gva": False, "mha": False}


def _exact(name: str) -> bool:
    from specquant.kernels import ops

    return EXACT[name] and ops.LIBRARY.library() is not None


def _prefilled(model, prompt):
    model.setup_cache(1, 256, window=None)
    model(prompt, 0)


def _close(a, b, exact):
    if exact:
        assert torch.equal(a, b), float((a - b).abs().max())
    else:  # the tree's and the chain's delta-rule forms round apart: past 1e-4 in 10 of 1,000 random gva cases
        torch.testing.assert_close(a, b, rtol=5e-4, atol=5e-4)


@pytest.mark.parametrize("name", ["tiny-target", "tiny-hybrid", "gva", "mha"])
@torch.no_grad()
def test_tree_forward_scores_each_node_as_its_root_path_chain(models, name):
    if name not in models:
        pytest.skip(f"bundled {name} not built")
    model = models[name]
    vocab = model.config.vocab_size
    rng = random.Random(zlib.crc32(name.encode()))  # not hash(): str hashes change per process (PYTHONHASHSEED)
    for trial, tree in enumerate(tree_shapes(rng, 5)):
        gen = torch.Generator().manual_seed(trial)
        prompt = torch.randint(0, vocab, (1, rng.randint(3, 40)), generator=gen)
        nodes = torch.randint(0, vocab, (1, len(tree)), generator=gen)
        start = prompt.shape[1]
        _prefilled(model, prompt)
        logits = model(nodes, start, tree=tree)[0]
        for node in range(len(tree)):
            path = tree.path(node)
            _prefilled(model, prompt)
            chain = model(nodes[:, path], start)[0, -1]
            _close(logits[node], chain, _exact(name))
        # commit a random root path, then continue: the caches hold exactly that chain
        path = tree.path(rng.randrange(len(tree)))
        _prefilled(model, prompt)
        model(nodes, start, tree=tree)
        model.commit_tree(start, path)
        after = torch.randint(0, vocab, (1, 3), generator=gen)
        got = model(after, start + len(path))[0]
        _prefilled(model, prompt)
        model(nodes[:, path], start)
        _close(got, model(after, start + len(path))[0], _exact(name))


@torch.no_grad()
def test_tree_forward_off_the_native_path_matches_the_oracle(models, monkeypatch):
    """SDPA under the ancestor mask and the reference DeltaNet forms (SPECQUANT_NATIVE's fallback, fast=False)."""
    from specquant.kernels import ops

    monkeypatch.setattr(ops, "usable", lambda *t: False)
    for name in ("gva", "mha", "tiny-hybrid"):
        if name not in models:
            continue
        model = models[name]
        for layer in model.model.layers:
            if hasattr(layer.mixer, "fast"):
                monkeypatch.setattr(layer.mixer, "fast", False)
        rng = random.Random(5)
        for trial, tree in enumerate(tree_shapes(rng, 3)):
            gen = torch.Generator().manual_seed(trial)
            prompt = torch.randint(0, model.config.vocab_size, (1, 12), generator=gen)
            nodes = torch.randint(0, model.config.vocab_size, (1, len(tree)), generator=gen)
            _prefilled(model, prompt)
            logits = model(nodes, 12, tree=tree)[0]
            for node in range(len(tree)):
                _prefilled(model, prompt)
                _close(logits[node], model(nodes[:, tree.path(node)], 12)[0, -1], exact=False)


# --- acceptance rules -----------------------------------------------------------------------------------------------

def _random_probs(gen, rows, vocab, sharpness):
    return torch.softmax(torch.randn(rows, vocab, generator=gen) * sharpness, -1)


def test_greedy_tree_verify_walks_the_matching_children():
    rng = random.Random(2)
    gen = torch.Generator().manual_seed(2)
    for tree in tree_shapes(rng, 300):
        n, vocab = len(tree), 4  # a small vocabulary: many drafts match the target's argmax
        logits = torch.randn(n, vocab, generator=gen)
        drafts = torch.randint(0, vocab, (n - 1,), generator=gen)
        path, token = greedy_tree_verify(drafts, tree, logits)
        best = logits.argmax(-1).tolist()
        node, expect = 0, [0]  # brute force: follow the first matching child
        while True:
            nxt = [c for c in range(1, n) if tree.parents[c] == node and int(drafts[c - 1]) == best[node]]
            if not nxt:
                break
            node = nxt[0]
            expect.append(node)
        assert (path, token) == (expect, best[node])


@pytest.mark.parametrize("point_mass", [False, True])
def test_tree_rejection_sampler_matches_reference_exactly(point_mass):
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    for tree in tree_shapes(rng, 200, most=10):
        n, vocab = len(tree), 5
        target_probs = _random_probs(gen, n, vocab, 2.0)
        draft_probs = None if point_mass else _random_probs(gen, n - 1, vocab, 2.0)
        drafts = torch.randint(0, vocab, (n - 1,), generator=gen)
        uniforms = torch.rand(n, generator=gen)
        noise = torch.empty(vocab).exponential_(generator=gen)
        fast = tree_rejection_sample(drafts, tree, draft_probs, target_probs, uniforms, noise)
        ref = tree_rejection_sample_reference(drafts.tolist(), tree, None if point_mass else draft_probs.tolist(),
                                              target_probs.tolist(), uniforms.tolist(), noise.tolist())
        assert fast == ref


@pytest.mark.parametrize("point_mass", [False, True])
def test_on_a_chain_the_tree_sampler_is_the_chain_sampler(point_mass):
    gen = torch.Generator().manual_seed(4)
    for trial in range(300):
        k, vocab = 1 + trial % 6, 6
        target_probs = _random_probs(gen, k + 1, vocab, 2.0)
        draft_probs = None if point_mass else _random_probs(gen, k, vocab, 2.0)
        drafts = torch.randint(0, vocab, (k,), generator=gen)
        uniforms = torch.rand(k, generator=gen)
        noise = torch.empty(vocab).exponential_(generator=gen)
        accepted, token = rejection_sample(drafts, draft_probs, target_probs, uniforms, noise)
        path, tree_token = tree_rejection_sample(drafts, TreeLayout.chain(k + 1), draft_probs, target_probs,
                                                 torch.cat([torch.zeros(1), uniforms]), noise)
        assert (path, tree_token) == (list(range(accepted + 1)), token)


@pytest.mark.parametrize("point_mass", [False, True])
def test_tree_rejection_sampler_emits_the_target_law(point_mass):
    """The root has three children (iid draws from one draft law, or three fixed tokens), the first of them a
    child of its own. Over N=12000 steps the first emitted token ~ target_probs[0], and the second, given that the
    first child was kept, ~ target_probs[1]. Each chi-square statistic (5 dof) exceeds 30 with probability < 2e-5
    under the null, so the pair fails falsely less than once in 25,000 seeds; the seed is fixed (deterministic)."""
    gen = torch.Generator().manual_seed(5)
    vocab, n = 6, 12000
    tree = layout((0, 0, 0, 1))  # nodes 1, 2, 3 under the root; node 4 under node 1
    target_probs = _random_probs(gen, 5, vocab, 1.5)
    law = _random_probs(gen, 1, vocab, 1.5)[0]
    fixed = torch.tensor([int(target_probs[0].argmax()), int(target_probs[0].argmin()), 0, 3])
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    for _ in range(n):
        if point_mass:
            drafts, draft_probs = fixed, None
        else:  # every child drawn from the law given its parent path, independently of its siblings
            drafts = torch.multinomial(law, 4, replacement=True, generator=gen)
            draft_probs = law.expand(4, vocab)
        uniforms = torch.rand(5, generator=gen)
        noise = torch.empty(vocab).exponential_(generator=gen)
        path, token = tree_rejection_sample(drafts, tree, draft_probs, target_probs, uniforms, noise)
        emitted = [int(drafts[c - 1]) for c in path[1:]] + [token]
        first[emitted[0]] += 1
        if path[1:2] == [1]:
            second[emitted[1]] += 1

    def chi2(counts, probs):
        expected = probs * counts.sum()
        return float(((counts - expected) ** 2 / expected).sum())

    assert chi2(first, target_probs[0]) < 30.0, first
    assert second.sum() > 2000  # the conditional test has power
    assert chi2(second, target_probs[1]) < 30.0, second
    # the test can fail: the draft's law (or the fixed tokens) is far from the target's
    wrong = law if not point_mass else torch.full((vocab,), 1e-3).index_fill(0, fixed[:3], 1.0)
    assert chi2(first, wrong / wrong.sum()) > 100.0


def test_best_first_tree_takes_the_most_likely_root_paths():
    """Against brute force: every root path over the top tokens per depth, scored by its summed log-probs; the
    tree holds the `nodes` best (ties aside), and is prefix-closed."""
    import itertools

    gen = torch.Generator().manual_seed(6)
    for trial in range(40):
        depth, vocab, nodes = 1 + trial % 4, 5, 1 + trial % 9
        logprobs = torch.log_softmax(torch.randn(depth, vocab, generator=gen) * 2, -1)
        tokens, parents = best_first_tree(logprobs, nodes)
        tree = layout(parents)
        paths = [tuple(tokens[c - 1] for c in tree.path(i)[1:]) for i in range(1, len(tree))]
        scores = {p: sum(float(logprobs[d, t]) for d, t in enumerate(p)) for p in paths}
        every = [p for d in range(1, depth + 1) for p in itertools.product(range(vocab), repeat=d)]
        every_scores = sorted((sum(float(logprobs[d, t]) for d, t in enumerate(p)) for p in every), reverse=True)
        assert len(paths) == min(nodes, len(every)) and len(set(paths)) == len(paths)
        assert sorted(scores.values(), reverse=True) == pytest.approx(every_scores[: len(paths)])


# --- end to end -----------------------------------------------------------------------------------------------------

class OracleTreeDrafter:
    """Random tree shapes whose tokens are random, except along one random root path, which carries the target's
    own greedy continuation (known in advance) for a random number of levels: long accepted paths, branches off
    them, and rejections everywhere."""

    target_layers = ()

    def __init__(self, reference: list[int], vocab: int, seed: int):
        self.reference, self.vocab, self.rng = reference, vocab, random.Random(seed)

    def setup(self, batch, max_len):
        pass

    def prefill(self, prompt_ids, target_hidden):
        pass

    def propose(self, tokens, k, sampling, generator):
        raise AssertionError("a tree drafter's propose is not called with tree_nodes > 0")

    def propose_tree(self, tokens, nodes, depth, sampling, generator):
        rng, n = self.rng, tokens.shape[1]
        size = rng.randint(1, nodes)
        tree = random_tree(rng, size + 1)
        while max(tree.depth) > depth:
            tree = random_tree(rng, rng.randint(2, size + 1))
        drafted = [rng.randrange(self.vocab) for _ in range(len(tree) - 1)]
        right = tree.path(rng.randrange(len(tree)))[1:]
        for d, node in enumerate(right[: rng.randint(0, len(right))]):
            drafted[node - 1] = self.reference[n + d] if n + d < len(self.reference) else 0
        return Draft(torch.tensor([drafted]), parents=tree.parents[1:])

    def accept(self, length, target_hidden):
        pass

    def rollback(self, length):
        pass


@pytest.mark.parametrize("name", ["tiny-target", "tiny-hybrid", "gva", "mha"])
@pytest.mark.parametrize("nodes", [3, 16])
def test_greedy_tree_speculation_equals_target_greedy(models, name, nodes):
    if name not in models:
        pytest.skip(f"bundled {name} not built")
    target = models[name]
    vocab = target.config.vocab_size
    for i, length in enumerate((4, 30)):
        prompt = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(length))
        ref = target_greedy(target, prompt, 40)
        drafter = OracleTreeDrafter(prompt[0].tolist() + ref, vocab, seed=i)
        engine = SpecEngine(target, drafter, SpecConfig(draft_len=8, tree_nodes=nodes))
        out = engine.generate(prompt, 40, stop_on_eos=False)
        assert out.token_ids[0] == ref
        s = out.stats
        assert s["new_tokens"] == 1 + s["num_accepted_tokens"] + (s["target_forwards"] - 1)
    assert engine.metrics.num_accepted_tokens > 0


def test_tree_sampling_end_to_end_follows_the_target_law():
    """The block drafter's best-first trees (point masses) under sampling: the first two new tokens follow the
    target's law (conftest.assert_follows_target_law states the test's odds)."""
    from specquant.spec_decode.drafters.block import BlockDrafter

    target = peaky_model(3, 0)
    draft = small_block_draft(target)
    cfg = SpecConfig(draft_len=3, tree_nodes=8)
    prompt = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(5))
    law = target_law(target, prompt)
    engine = SpecEngine(target, BlockDrafter(draft, target, cfg), cfg)
    assert_follows_target_law(engine, prompt, law, n=600, tv_bound=0.35)
    assert engine.metrics.num_accepted_tokens > 0


def test_tree_errors():
    target = peaky_model(2, 0)
    with pytest.raises(SpecquantError, match="chains only"):
        SpecEngine(target, peaky_model(1, 1), SpecConfig(tree_nodes=4))
    with pytest.raises(SpecquantError, match="tree_nodes"):
        SpecConfig(tree_nodes=64).validate()
    with pytest.raises(SpecquantError, match="adaptive"):
        SpecConfig(tree_nodes=4, adaptive=True).validate()
    drafter = OracleTreeDrafter([], 96, 0)
    with pytest.raises(SpecquantError, match="eager"):
        SpecEngine(target, drafter, SpecConfig(tree_nodes=4), compile=True)


def test_suffix_continuation_tree_holds_the_chain_and_only_continuations_that_occurred():
    from specquant.spec_decode.suffix_automaton import SuffixAutomaton
    from specquant.spec_decode.suffix_tree import continuation_tree

    rng = random.Random(7)
    for trial in range(60):
        text = [rng.randrange(4) for _ in range(rng.randint(20, 80))]  # 4 symbols: many repeats, many branches
        sam = SuffixAutomaton(text, recency_depth=None)
        match = sam.match
        if match.length == 0:
            continue
        suffix = text[len(text) - match.length :]
        # the chain: what followed the suffix's most recent earlier occurrence (brute force; the drafter's draft)
        at = max(i for i in range(len(text) - match.length) if text[i : i + match.length] == suffix)
        chain = text[at + match.length : at + match.length + rng.randint(1, 6)]
        nodes = rng.randint(1, 16)
        tokens, parents = continuation_tree(sam, sam.link[sam.last], chain, nodes)
        tree = layout(parents)
        assert tokens[: min(nodes, len(chain))] == chain[:nodes] and len(tokens) <= nodes
        assert max(tree.depth) <= len(chain)
        for node in range(min(nodes, len(chain)) + 1, len(tree)):  # every branch off the chain occurred after it
            path = [tokens[c - 1] for c in tree.path(node)[1:]]
            want = suffix + path
            assert any(text[i : i + len(want)] == want for i in range(len(text) - len(want) + 1)), (want, text)
        for kids in tree.children:
            toks = [tokens[c - 1] for c in kids]
            assert len(set(toks)) == len(toks)  # siblings differ: a repeated sibling could never be accepted


def test_suffix_and_block_trees_are_lossless_end_to_end():
    """Greedy speculation with the real tree drafters equals target-only decoding, on repetitive prompts (the
    suffix drafter drafts) and with a random block drafter."""
    from specquant.model.block_draft import BlockDraftConfig, BlockDraftModel
    from specquant.spec_decode.drafters.block import BlockDrafter
    from specquant.spec_decode.suffix_drafter import SuffixConfig, SuffixDrafter

    target = peaky_model(3, 0)
    dcfg = BlockDraftConfig.for_target(target.config, num_hidden_layers=1, block_size=6, target_layer_ids=[1, 2],
                                       mask_token_id=5)
    torch.manual_seed(2)
    block = BlockDraftModel(dcfg).eval()
    for nodes in (4, 12):
        cfg = SpecConfig(draft_len=5, tree_nodes=nodes)
        for prompt in (torch.tensor([[7, 8, 9, 10, 7, 8, 11, 7, 8, 9, 12, 7, 8]]),
                       torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(1))):
            ref = generate(target, prompt, 30, stop_on_eos=False).token_ids[0]
            suffix = SuffixDrafter(SuffixConfig(max_draft_len=5, min_match=1))
            for drafter in (suffix, BlockDrafter(block, target, cfg)):
                engine = SpecEngine(target, drafter, cfg)
                assert engine.generate(prompt, 30, stop_on_eos=False).token_ids[0] == ref
                assert engine.metrics.num_drafts > 0


def test_tree_benchmark_verify_cost_at_a_tiny_hybrid_shape(monkeypatch, capsys):
    """benchmarks/tree.py --shape at a tiny Qwen3.5 shape, one repetition: what it prints (times are noise here)."""
    import json
    import sys

    from conftest import load_benchmark

    from specquant.bench.shapes import SHAPES, hybrid

    monkeypatch.setitem(SHAPES, "qwen3.5-tiny", lambda: hybrid(
        4, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        linear_num_key_heads=2, linear_num_value_heads=4, vocab_size=300))
    tree_bench = load_benchmark("tree.py")
    monkeypatch.setattr(sys, "argv", ["tree.py", "--shape", "qwen3.5-tiny", "--layers", "4", "--mode", "fp32",
                                      "--nodes", "4,8", "--context", "16", "--reps", "1"])
    tree_bench.main()
    out = capsys.readouterr().out
    res = json.loads(out.strip().splitlines()[-1])
    rows = res["verify_cost"]
    assert [r["rows"] for r in rows] == [5, 9] and all(r["chain_ms"] > 0 and r["star_ms"] > 0 for r in rows)
    assert all(1 <= r["ddtree_segments"] <= r["nodes"] for r in rows)
    assert "ddtree/chain" in out


def test_suffix_tree_from_an_earlier_request():
    """A match found in the drafter's cache of earlier requests drafts its tree from that document's automaton."""
    from specquant.spec_decode.suffix_drafter import SuffixConfig, SuffixDrafter

    drafter = SuffixDrafter(SuffixConfig(max_draft_len=4, min_match=2, cache_tokens=1000))
    greedy = SamplingConfig()
    drafter.prefill(torch.tensor([[5, 6, 7, 8, 9, 5, 6, 3, 4]]), None)
    drafter.propose_tree(torch.tensor([[5, 6, 7, 8, 9, 5, 6, 3, 4]]), 8, 4, greedy, None)
    prompt = torch.tensor([[1, 2, 5, 6]])  # "5 6" is followed by 7 and by 3 in the earlier request
    drafter.prefill(prompt, None)
    draft = drafter.propose_tree(prompt, 8, 4, greedy, None)
    assert drafter.last.source == "cache"
    tree = layout(draft.parents)
    first = sorted(int(draft.tokens[0, c - 1]) for c in tree.children[0])
    assert first == [3, 7] and len(tree) - 1 <= 8


def test_bench_rows_draft_trees_only_where_the_drafter_does():
    from specquant.bench.ablation import ROW_SPECS
    from specquant.bench.config import BenchConfig

    cfg = BenchConfig(spec=SpecConfig(draft_window=128, tree_nodes=8))
    nodes = {kind: spec(cfg, False, None).tree_nodes for kind, spec in ROW_SPECS.items()}
    assert nodes == {"lm": 0, "block": 8, "suffix": 8, "hybrid": 0, "mtp": 0}
