"""The suffix drafter: its automaton against brute force (matches, occurrences, continuations, exact rollback),
the bounded document cache, and the drafter in the speculative loop (lossless greedy on the bundled tiny-target,
drafts that get accepted, the sampling law with point-mass drafts)."""

import random

import pytest
import torch
from conftest import needs_bundled, target_greedy

from specquant.decode.compiled import Stepper
from specquant.spec_decode.engine import generate
from specquant.decode.sampling import SamplingConfig, logits_to_probs
from specquant.errors import SpecquantError
from specquant.model.config import ModelConfig
from specquant.model.decoder import Transformer
from specquant.spec_decode.config import SpecConfig
from specquant.spec_decode.drafter import Draft, Drafter
from specquant.spec_decode.engine import SpecEngine
from specquant.spec_decode.loop import decode_steps
from specquant.spec_decode.metrics import SpecMetrics
from specquant.spec_decode.suffix_automaton import DocumentCache, MatchCursor, SuffixAutomaton
from specquant.spec_decode.suffix_drafter import SuffixConfig, SuffixDrafter

FILLER = "The quick brown fox jumps over the lazy dog. "


def occurrences(seq: list[int], length: int) -> list[int]:
    """End positions e < len(seq)-1 where seq's last `length` tokens also occur."""
    n, suffix = len(seq), seq[len(seq) - length :]
    return [e for e in range(length - 1, n - 1) if seq[e - length + 1 : e + 1] == suffix]


def brute_match(seq: list[int]) -> tuple[int, list[int]]:
    """The longest suffix of seq occurring earlier, and all its earlier end positions."""
    for length in range(len(seq) - 1, 0, -1):
        ends = occurrences(seq, length)
        if ends:
            return length, ends
    return 0, []


def structure(sam: SuffixAutomaton):
    return sam.next, sam.link, sam.length, sam.first, sam.recent, sam.count, sam.last, sam.tokens, sam.matches


@pytest.mark.parametrize("depth", [None, 1, 8])
def test_longest_match_equals_brute_force_through_rollbacks(depth):
    """Random sequences over 1..4 symbols, appends mixed with truncations: the match length is exact at every
    step, the reported occurrence is a true earlier one, and the most recent one when recency is unbounded."""
    stale = 0
    for seed in range(120):
        rng = random.Random(seed)
        alphabet = rng.randint(1, 4)
        seq = [rng.randrange(alphabet) for _ in range(rng.choice((0, 0, 5, 20)))]
        sam = SuffixAutomaton(seq, recency_depth=depth)  # a truncate below these tokens rebuilds
        for _ in range(90):
            if seq and rng.random() < 0.12:
                seq = seq[: rng.randint(0, len(seq))]
                sam.truncate(len(seq))
            else:
                t = rng.randrange(alphabet)
                seq.append(t)
                sam.append(t)
            length, ends = brute_match(seq)
            m = sam.match
            assert (m.length, len(sam)) == (length, len(seq)), (seed, seq)
            if length:
                assert m.end in ends, (seed, seq, m)
                if depth is None:
                    assert m.end == max(ends), (seed, seq, m)
                stale += m.end != max(ends)
            else:
                assert m.end == -1
    if depth == 1:
        assert stale > 0  # the bound is real: with one state updated per token some occurrences are older


def test_truncate_restores_the_automaton_exactly():
    rng = random.Random(7)
    seq = [rng.randrange(3) for _ in range(200)]
    sam = SuffixAutomaton(seq)
    for cut in (180, 120, 119, 40, 0):
        sam.truncate(cut)
        assert structure(sam) == structure(SuffixAutomaton(seq[:cut]))
        for t in seq[cut : cut + 30]:  # and it keeps growing as a fresh one would
            sam.append(t)
        assert structure(sam) == structure(SuffixAutomaton(seq[: cut + 30]))
        sam.truncate(cut)


def test_periodic_text_reports_the_latest_period_under_the_bound():
    """A periodic sequence (the filler prompt's shape): the match is everything but one period, found at the
    latest occurrence even with the bounded recency walk."""
    period = [5, 9, 2, 7, 7, 1]
    seq = period * 30
    sam = SuffixAutomaton(recency_depth=8)
    for i, t in enumerate(seq):
        sam.append(t)
        if i >= len(period):
            assert sam.match.length == i + 1 - len(period)
            assert sam.match.end == i - len(period)


def test_default_recency_bound_is_exact_on_real_text():
    """The default bound (SuffixConfig.recency_depth) reports the latest occurrence of every match on the
    packaged held-out text, as the unbounded walk does; a bound of 1 does not (so the comparison can fail)."""
    from specquant.model.checkpoint import BUNDLED_DIR, load_tokenizer

    heldout = BUNDLED_DIR.parent / "data" / "heldout.txt"
    ids = load_tokenizer("tiny-target").encode(heldout.read_text()[:40000])[:5000]
    exact = SuffixAutomaton(ids, recency_depth=None).matches
    assert SuffixAutomaton(ids, recency_depth=SuffixConfig.recency_depth).matches == exact
    assert SuffixAutomaton(ids, recency_depth=1).matches != exact


def test_cursor_finds_the_longest_suffix_in_another_document():
    """Matching statistics against a finished document: the longest suffix of the fed sequence occurring in the
    document, reported at its earliest occurrence there."""
    for seed in range(60):
        rng = random.Random(100 + seed)
        alphabet = rng.randint(2, 4)
        doc = [rng.randrange(alphabet) for _ in range(rng.randint(1, 50))]
        cursor = MatchCursor(SuffixAutomaton(doc).freeze())
        fed = []
        for _ in range(40):
            fed.append(rng.randrange(alphabet))
            cursor.feed(fed[-1])
            best, ends = 0, []
            for length in range(min(len(fed), len(doc)), 0, -1):
                suffix = fed[len(fed) - length :]
                ends = [e for e in range(length - 1, len(doc)) if doc[e - length + 1 : e + 1] == suffix]
                if ends:
                    best = length
                    break
            m = cursor.match()
            assert m.length == best, (seed, doc, fed)
            if best:
                assert m.end == min(ends)
                sam = cursor.automaton
                assert sam.length[sam.link[m.state]] < best <= sam.length[m.state]  # the state holding the match


def test_document_cache_is_bounded_and_evicts_first_in_first_out():
    cache = DocumentCache(max_tokens=100, max_docs=3)
    ids = [cache.add(SuffixAutomaton(range(n))) for n in (40, 30, 20)]
    assert cache.tokens == 90 and len(cache) == 3
    new = cache.add(SuffixAutomaton(range(25)))  # 115 tokens > 100: the oldest (40) goes
    assert list(cache.docs) == [ids[1], ids[2], new] and cache.tokens == 75
    cache.add(SuffixAutomaton(range(5)))  # 4 documents > max_docs: the next oldest (30) goes
    assert list(cache.docs)[:2] == [ids[2], new] and len(cache) == 3 and cache.tokens == 50
    assert cache.add(SuffixAutomaton(range(101))) is None and cache.tokens == 50  # longer than the whole budget
    assert all(d._log is None for d in cache.docs.values())  # frozen: no undo log kept


def _count(text: list[int], x: list[int]) -> list[int]:
    """End positions of x in text (all of them, the text's last position included)."""
    return [e for e in range(len(x) - 1, len(text)) if text[e - len(x) + 1 : e + 1] == x]


def _check_counts(sam: SuffixAutomaton):
    for v in range(1, len(sam.link)):
        x = sam.tokens[sam.first[v] - sam.length[v] + 1 : sam.first[v] + 1]  # the state's longest string
        ends = _count(sam.tokens, x)
        assert (sam.count[v], sam.recent[v]) == (len(ends), max(ends)), (sam.tokens, v)


def test_counts_equal_brute_force_through_rollbacks_and_freeze():
    """count[v] is the number of occurrences of state v's strings (exact without a bound, and after freeze
    whatever the bound); a bound of 1 undercounts (so the check can fail)."""
    under = 0
    for seed in range(60):
        rng = random.Random(seed)
        alphabet = rng.randint(1, 3)
        seq = [rng.randrange(alphabet) for _ in range(rng.choice((0, 5)))]
        exact = SuffixAutomaton(seq, recency_depth=None, count_depth=None)
        bounded = SuffixAutomaton(seq, recency_depth=1, count_depth=1)
        for _ in range(60):
            if seq and rng.random() < 0.15:
                seq = seq[: rng.randint(0, len(seq))]
                exact.truncate(len(seq))
                bounded.truncate(len(seq))
            else:
                seq.append(rng.randrange(alphabet))
                exact.append(seq[-1])
                bounded.append(seq[-1])
            _check_counts(exact)
        under += bounded.count != exact.count
        _check_counts(bounded.freeze())
    assert under > 0


def brute_draft(seq: list[int], docs: list[list[int]], k: int, cfg: SuffixConfig) -> tuple[str, list[int], float]:
    """The draft rule of suffix_drafter.py by scanning the texts: every match length of every source, each
    continuation counted where it occurs (no automaton, no bound); cfg.branch picks at a branch."""
    best = ("none", [], 0.0)
    for source, text in [("self", seq)] + [("cache", d) for d in reversed(docs)]:
        for length in range(len(seq), cfg.min_match - 1, -1):
            x = seq[len(seq) - length :]
            ends = _count(text, x)
            if len(ends) < (2 if source == "self" else 1):  # in the own text, an occurrence before the end
                continue
            count = cfg.draft_len(length, k)
            tokens, prob, score = [], 1.0, 0.0
            while count and len(tokens) < count:
                ends = _count(text, x + tokens)
                following = {}  # token -> end positions of x + tokens + [token]
                for e in ends:
                    if e + 1 < len(text):
                        following.setdefault(text[e + 1], []).append(e + 1)
                if not following:
                    if source == "self" and tokens:  # the walked string is a suffix of seq: it repeats
                        period = len(tokens)
                        while len(tokens) < count:
                            tokens.append(tokens[-period])
                            score += prob
                    break
                if cfg.branch == "frequent":
                    token = max(following, key=lambda t: (len(following[t]), max(following[t])))
                else:
                    token = max(following, key=lambda t: max(following[t]))
                prob *= len(following[token]) / len(ends)
                if prob < cfg.min_token_prob:
                    break
                tokens.append(token)
                score += prob
            if score > best[2]:
                best = (source, tokens, score)
    return best


@pytest.mark.parametrize("branch", ["frequent", "recent"])
@pytest.mark.parametrize("seed", range(4))
def test_draft_rule_equals_brute_force(seed, branch):
    """The drafter without bounds (recency, counts, candidates) drafts what the brute-force statement of the
    rule drafts, on random texts over 2-4 symbols with cached requests, rollbacks and a range of settings."""
    rng = random.Random(1000 + seed)
    drafted = 0
    for trial in range(25):
        alphabet = rng.randint(2, 4)
        cfg = SuffixConfig(max_draft_len=rng.choice((4, 8)), min_match=rng.choice((1, 2, 3)),
                           match_factor=rng.choice((0.5, 1.0, 3.0)), match_offset=rng.choice((0.0, 1.0)),
                           min_token_prob=rng.choice((0.0, 0.3)), branch=branch, candidates=10**9, cache_tokens=10**6,
                           recency_depth=10**9, count_depth=10**9)
        d = SuffixDrafter(cfg)
        docs = [[rng.randrange(alphabet) for _ in range(rng.randint(1, 30))] for _ in range(rng.randint(0, 2))]
        for doc in docs:
            d.prefill(torch.tensor([doc]), None)  # the next prefill moves it into the cache
        seq = [rng.randrange(alphabet) for _ in range(rng.randint(1, 10))]
        d.prefill(torch.tensor([seq]), None)
        for _ in range(30):
            if rng.random() < 0.15 and len(seq) > 1:
                seq = seq[: rng.randint(1, len(seq))]
                d.rollback(len(seq))
            else:
                seq.append(rng.randrange(alphabet))
            k = rng.choice((3, 8))
            p = d.peek(torch.tensor([seq]), k)
            want = brute_draft(seq, docs, k, cfg)
            assert (p.source, p.tokens) == want[:2] and p.score == pytest.approx(want[2]), (seed, trial, seq, docs)
            drafted += bool(p.tokens)
    assert drafted > 100


def test_branch_rules_differ_where_frequency_and_recency_disagree():
    """After "1 2": 3 followed twice, 4 once and last. frequent drafts 3 at probability 2/4 (the end's occurrence
    counts), recent drafts 4 at 1/4."""
    seq = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2]])
    got = {}
    for branch in ("frequent", "recent"):
        d = SuffixDrafter(SuffixConfig(min_match=2, branch=branch))
        d.prefill(seq, None)
        p = d.peek(seq, 1)
        got[branch] = (p.tokens, p.score)
    assert got == {"frequent": ([3], 0.5), "recent": ([4], 0.25)}


def test_draft_length_follows_the_match():
    cfg = SuffixConfig(max_draft_len=20, min_match=3, match_factor=1.0)
    assert [cfg.draft_len(n, 32) for n in (0, 2, 3, 7, 19, 20, 400)] == [0, 0, 3, 7, 19, 20, 20]
    assert cfg.draft_len(50, 5) == 5  # the loop's k caps it
    assert SuffixConfig(match_factor=0.5).draft_len(10, 32) == 5


def test_config_and_batch_are_checked():
    for bad in (dict(max_draft_len=0), dict(max_draft_len=33), dict(min_match=0), dict(match_factor=0.0),
                dict(cache_tokens=-1), dict(cache_requests=0), dict(recency_depth=0), dict(count_depth=0),
                dict(min_token_prob=1.5), dict(match_offset=float("nan")), dict(candidates=0), dict(branch="often")):
        with pytest.raises(SpecquantError):
            SuffixDrafter(SuffixConfig(**bad))
    d = SuffixDrafter()
    assert isinstance(d, Drafter) and d.target_layers == ()
    with pytest.raises(SpecquantError, match="batch 1"):
        d.setup(2, 100)
    with pytest.raises(SpecquantError, match="batch 1"):
        d.prefill(torch.zeros(2, 5, dtype=torch.long), None)


def test_drafter_rollback_forgets_rejected_tokens():
    """propose over a longer sequence, then a rollback below it: the drafter is as if it had only seen the
    shorter sequence, and drafts the same."""
    greedy = SamplingConfig()
    seq = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6] * 4 + [3, 1, 4, 7, 7, 7, 7, 7, 7]])
    d = SuffixDrafter(SuffixConfig(min_match=2))
    d.prefill(seq[:, :10], None)
    d.propose(seq, 20, greedy, None)
    d.rollback(30)
    fresh = SuffixDrafter(SuffixConfig(min_match=2))
    fresh.prefill(seq[:, :30], None)
    assert structure(d.doc) == structure(fresh.doc)
    a, b = d.propose(seq[:, :30], 20, greedy, None), fresh.propose(seq[:, :30], 20, greedy, None)
    assert a.tokens.tolist() == b.tokens.tolist() and a.tokens.shape[1] == 20 and a.probs is None
    # the draft continues the 8-token period: the prefix ends in "... 1 5 9", followed earlier by "2 6 3 1 4"
    assert a.tokens[0, :5].tolist() == [2, 6, 3, 1, 4]


def test_peek_picks_the_best_score_over_sources():
    """The cache's document drafts when its draft scores higher: there "20 21 22" was followed once in one
    occurrence (probability 1 per token), while in the request's own text its second occurrence is the sequence's
    end (probability 1/2). A match below min_match drafts nothing but is still reported (a hybrid rule reads it)."""
    d = SuffixDrafter(SuffixConfig(min_match=3, cache_tokens=1000))
    d.prefill(torch.tensor([list(range(10, 40))]), None)  # request 1: 30 distinct tokens
    d.prefill(torch.tensor([[20, 21, 22, 60, 61]]), None)  # request 2; request 1 is now cached
    p = d.peek(torch.tensor([[20, 21, 22, 60, 61, 14, 15, 16]]), 5)  # "14 15 16": only in request 1
    assert (p.source, p.match.length, p.tokens, p.score) == ("cache", 3, [17, 18, 19], 3.0)  # 3 matched -> 3
    d.rollback(5)  # committed tokens are final: another continuation needs a rollback first
    p = d.peek(torch.tensor([[20, 21, 22, 60, 61, 5, 20, 21, 22]]), 5)  # "20 21 22": 3 tokens in both
    assert (p.source, p.match.length, p.tokens, p.score) == ("cache", 3, [23, 24, 25], 3.0)
    own = SuffixDrafter(SuffixConfig(min_match=3))
    own.prefill(torch.tensor([[20, 21, 22, 60, 61]]), None)
    own = own.peek(torch.tensor([[20, 21, 22, 60, 61, 5, 20, 21, 22]]), 5)
    assert (own.source, own.tokens, own.score) == ("self", [60, 61, 5], 1.5)
    seq = torch.tensor([[20, 21, 22, 60, 61, 5, 20, 21, 22, 61]])  # "61": one token, own text only
    assert (d.peek(seq, 5).source, d.last.match.length, d.last.tokens) == ("none", 1, [])
    assert d.propose(seq, 5, SamplingConfig(), None).tokens.shape == (1, 0)


@pytest.fixture(scope="module")
def tiny():
    from specquant.loader import load_model
    from specquant.model.checkpoint import load_tokenizer

    return load_model("tiny-target"), load_tokenizer("tiny-target")


@needs_bundled("tiny-target")
@pytest.mark.parametrize("k", [1, 4, 20])
def test_greedy_suffix_decoding_equals_target_greedy(tiny, k):
    """Token for token equal to target-only greedy, on prompts with and without repetition; on the repeated one
    the drafter drafts and the target accepts some of it (so the comparison is not vacuous)."""
    target, tok = tiny
    # CUDA-graph steps (an eager stand-in on CPU) replay the variable-length verify blocks a suffix draft makes
    engine = SpecEngine(target, SuffixDrafter(SuffixConfig(max_draft_len=k)), SpecConfig(draft_len=k),
                        graphs=k == 20)
    for text, repeats in ((FILLER * 4, True), ("Once upon a time, in a small village by the sea", False)):
        prompt = torch.tensor([tok.encode(text)])
        ref = target_greedy(target, prompt, 48)
        out = engine.generate(prompt, 48, stop_on_eos=False)
        assert out.token_ids[0] == ref
        s = out.stats
        assert s["new_tokens"] == 1 + s["num_accepted_tokens"] + (s["target_forwards"] - 1)
        assert s["num_draft_tokens"] <= s["num_drafts"] * k
        if repeats:
            assert s["num_drafts"] > 0 and s["num_accepted_tokens"] > 0


@needs_bundled("tiny-target")
def test_cache_replays_an_earlier_request(tiny):
    """With the cache, a repeated prompt drafts the earlier request's output (greedy: the same tokens), so almost
    every token arrives as an accepted draft; without it the same request accepts far fewer. Output unchanged."""
    target, tok = tiny
    prompt = torch.tensor([tok.encode("Once upon a time, in a small village by the sea")])
    ref = generate(target, prompt, 60, stop_on_eos=False).token_ids[0]
    cached = SpecEngine(target, SuffixDrafter(SuffixConfig(cache_tokens=4096)), SpecConfig(draft_len=20))
    plain = SpecEngine(target, SuffixDrafter(), SpecConfig(draft_len=20))
    first = cached.generate(prompt, 60, stop_on_eos=False)
    other = cached.generate(torch.tensor([tok.encode(FILLER * 2)]), 20, stop_on_eos=False)  # a second document
    again = cached.generate(prompt, 60, stop_on_eos=False)
    alone = plain.generate(prompt, 60, stop_on_eos=False)
    assert first.token_ids[0] == again.token_ids[0] == alone.token_ids[0] == ref
    assert len(cached.drafter.cache) == 2 and other.token_ids[0]
    # the cached output lacks only its last token (never committed): the replay covers all but the last few
    assert again.stats["num_accepted_tokens"] >= 55
    assert again.stats["target_forwards"] <= 6
    assert alone.stats["num_accepted_tokens"] < again.stats["num_accepted_tokens"] - 20


class OneHotDraft:
    """The suffix drafter with each point-mass draft written as a one-hot distribution (drafted token probability
    1, every other 0) when `one_hot`; else its Draft as it is (probs None)."""

    target_layers = ()

    def __init__(self, inner: SuffixDrafter, vocab: int, one_hot: bool = True):
        self.inner, self.vocab, self.one_hot = inner, vocab, one_hot
        self.drafted = 0

    def setup(self, batch, max_len):
        self.inner.setup(batch, max_len)

    def prefill(self, prompt_ids, target_hidden):
        self.inner.prefill(prompt_ids, target_hidden)

    def propose(self, tokens, k, sampling, generator):
        d = self.inner.propose(tokens, k, sampling, generator)
        assert d.probs is None
        self.drafted += d.tokens.shape[1]
        return Draft(d.tokens, torch.nn.functional.one_hot(d.tokens, self.vocab).float()) if self.one_hot else d

    def accept(self, length, target_hidden):
        self.inner.accept(length, target_hidden)

    def rollback(self, length):
        self.inner.rollback(length)


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0  # nothing emitted where the law puts no mass
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("one_hot", [True, False])
def test_sampling_with_point_mass_drafts_keeps_the_target_law(one_hot):
    """Sampling on a small random target, from a fixed repetitive context the drafter always
    drafts on: the first emitted token ~ p(. | context), and the second, given the first was the drafted token,
    ~ p(. | context, draft). Chi-square over 8 tokens (7 dof): above 40 has probability < 1e-6 under the null;
    the seed is fixed, so the test is deterministic. An always-accepting or never-accepting rule gives a
    statistic in the thousands (asserted below from the counts of both outcomes)."""
    vocab, n_runs = 8, 1500
    torch.manual_seed(3)
    target = Transformer(ModelConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                     max_position_embeddings=128)).eval()
    # its tied N(0, 1) embedding makes logits of std ~10: a high temperature gives a law with mass everywhere
    sampling = SamplingConfig(temperature=12.0)

    def law(ids: list[int]) -> torch.Tensor:
        target.clear_cache()
        with torch.no_grad():
            return logits_to_probs(target(torch.tensor([ids]))[0, -1], sampling)

    # the context's period ends in a token X; pick the X the target finds neither near-certain nor unlikely
    def context(x):
        return [1, 2, 3, x] * 5 + [1, 2, 3]

    x = max(range(vocab), key=lambda t: -abs(float(law(context(t))[t]) - 0.5))
    ctx = context(x)
    p_first, p_second = law(ctx), law(ctx + [x])
    assert 0.2 < float(p_first[x]) < 0.8

    step = Stepper(target)
    step.setup(1, 64)
    drafter = OneHotDraft(SuffixDrafter(SuffixConfig(max_draft_len=4)), vocab, one_hot)
    with torch.no_grad():
        step.step(torch.tensor([ctx[:-1]]), 0, last_only=True)  # the cache holds all but the last token
    drafter.prefill(torch.tensor([ctx[:-1]]), None)
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(n_runs):
            seq = torch.zeros(1, 64, dtype=torch.long)
            seq[0, : len(ctx)] = torch.tensor(ctx)
            # the first verify step: the drafted token kept (then the bonus follows it) or a recovered token
            rows, _ = next(decode_steps(step, drafter, seq, len(ctx), 2, SpecConfig(draft_len=4), sampling, gen))
            out = rows[0]
            first[out[0]] += 1
            if out[0] == x:
                second[out[1]] += 1
            step.rollback(len(ctx) - 1)
            drafter.rollback(len(ctx) - 1)
    assert drafter.drafted >= n_runs  # every run drafted (the context repeats)
    assert 0.2 * n_runs < first[x] < 0.8 * n_runs  # both outcomes of the rule happened
    assert _chi2(first, p_first) < 40.0, (first, p_first)
    assert _chi2(second, p_second) < 40.0, (second, p_second)


@needs_bundled("tiny-target")
def test_comparison_benchmark_simulates_the_engine(tiny):
    """benchmarks/suffix_vs_arctic.py's simulation of a greedy stream counts what SpecEngine counts with the same
    drafter on the same prompt: target forwards (the prefill's included) and accepted tokens."""
    from conftest import load_benchmark

    mod = load_benchmark("suffix_vs_arctic.py")
    target, tok = tiny
    cfg = SuffixConfig(min_match=1, match_factor=3.0)
    for text in (FILLER * 3, "Once upon a time, in a small village by the sea"):
        prompt = tok.encode(text)
        out = SpecEngine(target, SuffixDrafter(cfg), SpecConfig(draft_len=20)).generate(
            torch.tensor([prompt]), 40, stop_on_eos=False)
        forwards, drafted, accepted, _ = mod.simulate(mod.Ours(cfg), prompt, out.token_ids[0])
        s = out.stats
        assert (forwards, drafted, accepted) == (s["target_forwards"], s["num_draft_tokens"],
                                                 s["num_accepted_tokens"])
        assert accepted > 0 or text != FILLER * 3
