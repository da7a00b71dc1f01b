"""The hybrid drafter (suffix draft on a long match, else a model drafter): lossless greedy output with either model
drafter, both sources chosen, the model drafter's state equal to a fresh one's whenever it drafts, the sampling law,
and the CLI's `suffix+DRAFT` parsing and k."""

import copy
import dataclasses

import pytest
import torch

from conftest import needs_bundled, peaky_pair, small_block_draft, target_greedy
from specquant.decode.compiled import Stepper
from specquant.decode.sampling import SamplingConfig, logits_to_probs
from specquant.errors import SpecquantError
from specquant.model.config import ModelConfig
from specquant.model.decoder import Transformer
from specquant.spec_decode.build import build_engine
from specquant.spec_decode.config import SpecConfig
from specquant.spec_decode.drafter import Draft
from specquant.spec_decode.drafters import parse_draft
from specquant.spec_decode.drafters.block import BlockDrafter
from specquant.spec_decode.drafters.hybrid import HybridConfig, HybridDrafter
from specquant.spec_decode.drafters.lm import LMDrafter
from specquant.spec_decode.engine import generate
from specquant.spec_decode.loop import decode_steps
from specquant.spec_decode.suffix_drafter import SuffixConfig, SuffixDrafter

VOCAB = 96


@pytest.fixture(scope="module")
def pair():
    return peaky_pair(VOCAB)


@pytest.fixture(scope="module")
def block_model(pair):
    target, _ = pair
    return small_block_draft(target)


def repeating(n_repeats: int, seed: int, tail: int) -> torch.Tensor:
    """A random 12-token phrase repeated, then a random tail of `tail` tokens."""
    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(0, VOCAB, (12,), generator=g)
    return torch.cat([phrase.repeat(n_repeats), torch.randint(0, VOCAB, (tail,), generator=g)])[None]


# ending inside a repeat (a long match at the first step), after one, and never repeating
PROMPTS = [repeating(4, 0, 0), repeating(2, 1, 5),
           torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(7))]


class Checked:
    """A model drafter whose every draft is compared with a fresh copy's, built from the committed sequence alone:
    what the hybrid left in its state (context cache, KV cache) must not change what it drafts."""

    def __init__(self, inner, fresh):
        self.inner, self.fresh = inner, fresh  # fresh(tokens [1, n], k) -> the draft a new drafter makes
        self.target_layers = inner.target_layers
        self.max_draft_len = getattr(inner, "max_draft_len", None)
        self.checked = 0

    def setup(self, batch, max_len):
        self.inner.setup(batch, max_len)

    def prefill(self, prompt_ids, target_hidden):
        self.inner.prefill(prompt_ids, target_hidden)

    def propose(self, tokens, k, sampling, generator):
        draft = self.inner.propose(tokens, k, sampling, generator)
        assert draft.tokens[0].tolist() == self.fresh(tokens, k), tokens.shape
        self.checked += 1
        return draft

    def accept(self, length, target_hidden):
        self.inner.accept(length, target_hidden)

    def rollback(self, length):
        self.inner.rollback(length)


def fresh_lm(draft):
    twin = copy.deepcopy(draft)

    def make(tokens, k):
        d = LMDrafter(twin, SpecConfig(draft_len=k))
        d.setup(1, tokens.shape[1] + k + 2)
        d.prefill(tokens, None)
        return d.propose(tokens, k, SamplingConfig(), None).tokens[0].tolist()

    return make


def fresh_block(target, block_model):
    twin_target, twin = copy.deepcopy(target), copy.deepcopy(block_model)

    def make(tokens, k):
        d = BlockDrafter(twin, twin_target, SpecConfig(draft_len=k))
        d.setup(1, tokens.shape[1] + 8)
        twin_target.clear_cache()
        with torch.no_grad():
            _, hidden = twin_target(tokens[:, :-1], hidden_layers=d.target_layers)
        d.prefill(tokens[:, :-1], hidden)
        return d.propose(tokens, k, SamplingConfig(), None).tokens[0].tolist()

    return make


@pytest.mark.parametrize("kind", ["lm", "block"])
@pytest.mark.parametrize("min_match", [4, 9])
def test_greedy_hybrid_equals_target_greedy_and_both_sources_draft(pair, block_model, kind, min_match):
    target, draft = pair
    spec = SpecConfig(draft_len=3)
    if kind == "lm":
        model = Checked(LMDrafter(draft, spec), fresh_lm(draft))
    else:
        model = Checked(BlockDrafter(block_model, target, spec), fresh_block(target, block_model))
    hybrid = HybridDrafter(SuffixDrafter(SuffixConfig(max_draft_len=12)), model, spec, HybridConfig(min_match))
    engine = build_engine(target, hybrid, spec=spec)
    assert engine.longest == 12  # the suffix drafter's own k, not draft_len 3
    used = {"suffix": 0, "model": 0}
    for prompt in PROMPTS:
        ref = target_greedy(target, prompt, 40)
        out = engine.generate(prompt, 40, stop_on_eos=False)
        assert out.token_ids[0] == ref
        s = out.stats
        assert s["new_tokens"] == 1 + s["num_accepted_tokens"] + (s["target_forwards"] - 1)
        counts = hybrid.choices
        # every verify step is one source's: the per-source counters add up to the request's
        assert counts["suffix"].num_drafts + counts["model"].num_drafts == s["num_drafts"]
        assert counts["suffix"].num_accepted_tokens + counts["model"].num_accepted_tokens == s["num_accepted_tokens"]
        assert max(counts["model"].num_accepted_tokens_per_pos, default=0) <= counts["model"].num_drafts
        assert counts["model"].mean_draft_len <= 3
        for source in used:
            used[source] += counts[source].num_drafts
    assert used["suffix"] > 0 and used["model"] > 0  # the rule chose both, so both paths were compared
    assert model.checked == used["model"]
    assert hybrid.totals["suffix"].num_drafts == used["suffix"]


class Wrong:
    """A model drafter whose k tokens repeat one id chosen from the last token, not from the target, so its steps
    accept next to nothing: what a drafter that does not pay looks like to the hybrid's gate."""

    target_layers = ()

    def __init__(self):
        self.proposed = 0

    def setup(self, batch, max_len):
        pass

    def prefill(self, prompt_ids, target_hidden):
        pass

    def propose(self, tokens, k, sampling, generator):
        self.proposed += 1
        wrong = torch.full((1, k), int(tokens[0, -1]) % 7 + 1, dtype=torch.long)
        return Draft(wrong)

    def accept(self, length, target_hidden):
        pass

    def rollback(self, length):
        pass


@pytest.mark.parametrize("min_accept", [1.0, 0.0])
def test_a_model_drafter_that_does_not_pay_is_gated_off_and_retried(pair, min_accept):
    """With model steps accepting ~nothing, the steps without a long suffix match run undrafted ("none") after the
    first model steps, with a model step every PROBE_EVERY of them; min_accept 0 keeps the model on every such
    step. Greedy output equals the target's either way."""
    from specquant.spec_decode.drafters.hybrid import PROBE_EVERY

    target, _ = pair
    spec = SpecConfig(draft_len=3)
    model = Wrong()
    hybrid = HybridDrafter(SuffixDrafter(SuffixConfig(max_draft_len=12)), model, spec,
                           HybridConfig(1000, model_min_accept=min_accept))  # no suffix step: the gate alone
    engine = build_engine(target, hybrid, spec=spec)
    ref = generate(target, PROMPTS[0], 60, stop_on_eos=False).token_ids[0]
    out = engine.generate(PROMPTS[0], 60, stop_on_eos=False)
    assert out.token_ids[0] == ref
    c = hybrid.choices
    steps = c["model"].num_drafts + c["none"].num_drafts
    # every step after the prefill (the last one may end the request before the drafter hears of it)
    assert c["suffix"].num_drafts == 0 and out.stats["target_forwards"] - 2 <= steps <= out.stats["target_forwards"] - 1
    if min_accept:
        rejected = c["model"].num_drafts - c["model"].num_accepted_tokens  # model steps that accepted nothing
        assert c["none"].num_drafts >= steps * PROBE_EVERY // (PROBE_EVERY + 1) - PROBE_EVERY and rejected >= 1
        assert c["model"].num_drafts <= steps // PROBE_EVERY + 2
    else:
        assert c["none"].num_drafts == 0 and c["model"].num_drafts == steps
    assert model.proposed == c["model"].num_drafts


def test_model_drafter_adapts_on_its_own_steps_only(pair):
    target, draft = pair
    spec = SpecConfig(draft_len=2, adaptive=True, max_draft_len=6)
    hybrid = HybridDrafter(SuffixDrafter(SuffixConfig(max_draft_len=16)), LMDrafter(draft, spec), spec,
                           HybridConfig(4))
    engine = build_engine(target, hybrid, spec=spec)
    assert engine.config.adaptive is False and engine.longest == 16
    ref = generate(target, PROMPTS[0], 48, stop_on_eos=False).token_ids[0]
    assert engine.generate(PROMPTS[0], 48, stop_on_eos=False).token_ids[0] == ref
    m = hybrid.choices["model"]
    assert m.num_drafts and len(m.num_accepted_tokens_per_pos) <= 6  # never past the adaptive ceiling
    assert hybrid.choices["suffix"].num_drafts and len(hybrid.choices["suffix"].num_accepted_tokens_per_pos) > 6


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0  # nothing emitted where the law puts no mass
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("source", ["suffix", "model"])
def test_hybrid_sampling_keeps_the_target_law(source):
    """From a fixed repetitive context, the first verify step's first emitted token ~ p(. | context), whichever
    source drafted it: the suffix drafter (a point mass on the repeat's next token; min_match 6 < the match) or
    the LM drafter (its own distribution; min_match above any match). Chi-square over 8 tokens (7 dof): above 40
    has probability < 1e-6 under the null; the seed is fixed, so the test is deterministic. An always-accepting
    rule would put the drafted token's count far off (asserted: both outcomes happen)."""
    vocab, n_runs = 8, 1500
    torch.manual_seed(3)
    cfg = ModelConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128)
    target, draft = Transformer(cfg).eval(), Transformer(dataclasses.replace(cfg, num_hidden_layers=1)).eval()
    sampling = SamplingConfig(temperature=12.0)  # logits of std ~10 (tied N(0, 1) embeddings): mass everywhere

    def law(ids: list[int]) -> torch.Tensor:
        target.clear_cache()
        with torch.no_grad():
            return logits_to_probs(target(torch.tensor([ids]))[0, -1], sampling)

    def context(x):
        return [1, 2, 3, x] * 5 + [1, 2, 3]

    x = max(range(vocab), key=lambda t: -abs(float(law(context(t))[t]) - 0.5))
    ctx = context(x)
    p_first = law(ctx)
    step = Stepper(target)
    step.setup(1, 64)
    spec = SpecConfig(draft_len=3)
    hybrid = HybridDrafter(SuffixDrafter(SuffixConfig(max_draft_len=4)), LMDrafter(draft, spec), spec,
                           HybridConfig(6 if source == "suffix" else 1000, model_min_accept=0.0))
    hybrid.setup(1, 64)
    with torch.no_grad():
        step.step(torch.tensor([ctx[:-1]]), 0, last_only=True)
    hybrid.prefill(torch.tensor([ctx[:-1]]), None)
    first = torch.zeros(vocab)
    gen = torch.Generator().manual_seed(0)
    loop = SpecConfig(draft_len=hybrid.own_draft_len)
    with torch.no_grad():
        for _ in range(n_runs):
            seq = torch.zeros(1, 64, dtype=torch.long)
            seq[0, : len(ctx)] = torch.tensor(ctx)
            rows, _ = next(decode_steps(step, hybrid, seq, len(ctx), 2, loop, sampling, gen))
            first[rows[0][0]] += 1
            step.rollback(len(ctx) - 1)
            hybrid.rollback(len(ctx) - 1)
    drafted = hybrid.totals[source]
    assert drafted.num_drafts == n_runs and hybrid.totals["model" if source == "suffix" else "suffix"].num_drafts == 0
    assert 0 < drafted.num_accepted_tokens_per_pos[0] < n_runs  # the first draft token kept in some runs only
    assert _chi2(first, p_first) < 40.0, (first, p_first)


@needs_bundled("tiny-block-draft")
def test_draft_flag_builds_the_hybrid_with_its_own_k():
    kind, inner = parse_draft("suffix+tiny-block-draft")
    assert (kind.name, inner) == ("hybrid", "tiny-block-draft")
    engine = build_engine("tiny-target", "suffix+tiny-block-draft", spec=SpecConfig(draft_len=3),
                          draft_options={"suffix": SuffixConfig(max_draft_len=20), "hybrid": HybridConfig(5)})
    assert isinstance(engine.drafter, HybridDrafter) and isinstance(engine.drafter.model, BlockDrafter)
    assert engine.longest == 20 and engine.drafter.config.min_match == 5 and engine.drafter.model_k == 3
    suffix_only = build_engine("tiny-target", "suffix", spec=SpecConfig(draft_len=3),
                               draft_options={"suffix": SuffixConfig(max_draft_len=17)})
    assert suffix_only.longest == 17 and suffix_only.config.draft_len == 17


@pytest.mark.parametrize("value", ["suffix+", "suffix+none", "suffix+suffix", "suffix+/no/such/dir"])
def test_bad_hybrid_drafts_are_refused(value):
    with pytest.raises(SpecquantError):
        build_engine("tiny-target", value)


@needs_bundled("tiny-block-draft")
def test_generate_cli_drafts_past_draft_len_and_reports_sources(capsys):
    """`generate --draft suffix` drafts up to --suffix-max-draft-len, not --draft-len; `suffix+DRAFT` reports its
    steps per source, and they add up to the request's."""
    import json

    from specquant.cli import main

    prompt = "The quick brown fox jumps over the lazy dog. " * 6
    base = ["generate", "--prompt", prompt, "--max-new-tokens", "40", "--ignore-eos", "--json", "--draft-len", "2"]
    assert main([*base, "--draft", "suffix", "--suffix-max-draft-len", "9"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    s = out["stats"]
    assert s["num_drafts"] and 2 < len(s["num_accepted_tokens_per_pos"]) <= 9  # drafts longer than --draft-len
    assert main([*base, "--draft", "suffix+tiny-block-draft", "--hybrid-min-match", "4"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    by = out["drafted_by"]
    assert set(by) == {"suffix", "model", "none"}  # "none": the undrafted steps, not drafts
    assert by["suffix"]["num_drafts"] + by["model"]["num_drafts"] == out["stats"]["num_drafts"]
