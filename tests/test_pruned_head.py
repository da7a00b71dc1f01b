"""Vocabulary-pruned draft heads (spec_decode/drafters/pruned_head.py): the pruned matmul against the full head's
kept columns, the map (selection, config.json round trip, `specquant distill prune-head`), lossless greedy decoding
with the LM and block drafters, and exact rejection sampling when the draft has no mass outside the kept ids."""

import json

import pytest
import torch

from conftest import needs_bundled, peaky_pair, small_block_draft
from specquant.cli import main
from specquant.decode.sampling import SamplingConfig, logits_to_probs
from specquant.errors import SpecquantError
from specquant.model.modules import Linear
from specquant.quant.head import CastLinear
from specquant.quant.linear import QuantLinear
from specquant.spec_decode.config import SpecConfig
from specquant.spec_decode.drafters.block import BlockDrafter
from specquant.spec_decode.drafters.lm import LMDrafter
from specquant.quant.prune_vocab import check_token_ids, most_frequent
from specquant.spec_decode.drafters.pruned_head import (ATTRIBUTE, PrunedHead, prune_lm_head, read_token_map,
                                                         reference_logits)
from specquant.spec_decode.engine import SpecEngine, generate
from specquant.spec_decode.verify import verify

VOCAB = 96


def test_pruned_rows_equal_the_full_heads_kept_columns():
    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([0, 3, 7, 8, 40, 63])
    dense = Linear(32, 64, bias=True)
    with torch.no_grad():
        dense.weight.copy_(torch.randn(64, 32, generator=g))
        dense.bias.copy_(torch.randn(64, generator=g))
    codes = torch.randint(-8, 8, (64, 128), generator=g, dtype=torch.int8)
    w4 = QuantLinear.from_codes(codes, torch.rand(64, 4, generator=g) + 0.1, None, 4, torch.randn(64, generator=g))
    w4.backend = "reference"  # the kernels' own rounding (bf16 activations) is theirs to test; here: the rows
    bf16 = CastLinear(torch.randn(64, 32, generator=g).to(torch.bfloat16))
    with torch.no_grad():
        for head, x in ((dense, torch.randn(3, 32, generator=g)), (w4, torch.randn(2, 128, generator=g)),
                        (bf16, torch.randn(3, 32, generator=g))):
            pruned = PrunedHead(head, ids)
            assert type(pruned.rows) is type(head)
            assert getattr(pruned.rows, "backend", None) == getattr(head, "backend", None)
            ref = reference_logits(head, ids, x)
            torch.testing.assert_close(pruned(x), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
            assert pruned(x).shape == (*x.shape[:-1], ids.numel())


def test_vocab_maps_and_probabilities_put_no_mass_outside_the_kept_ids():
    head = PrunedHead(Linear(8, 20, bias=False), torch.tensor([2, 5, 11, 19]))
    assert head.to_vocab(torch.tensor([0, 3, 1])).tolist() == [2, 19, 5]
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    full = head.to_vocab_probs(probs)
    assert full.shape == (1, 20) and torch.equal(full[0, [2, 5, 11, 19]], probs[0])
    assert float(full.sum()) == pytest.approx(1.0) and int((full > 0).sum()) == 4
    tokens, draft_probs = head.draft(torch.randn(3, 4), SamplingConfig(temperature=1.0),
                                     torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) <= {2, 5, 11, 19} and draft_probs.shape == (3, 20)
    assert all(float(draft_probs[i, t]) > 0 for i, t in enumerate(tokens.tolist()))


def test_most_frequent_keeps_specials_then_counts():
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 3])
    assert most_frequent(counts, 3).tolist() == [2, 3, 5]
    assert most_frequent(counts, 3, always=(6,)).tolist() == [2, 3, 6]  # 6 never seen, kept anyway
    assert most_frequent(counts, 4, always=(1, 99)).tolist() == [1, 2, 3, 5]  # ids past the vocab ignored
    for bad in (0, 9):
        with pytest.raises(SpecquantError, match="out of range"):
            most_frequent(counts, bad)
    with pytest.raises(SpecquantError, match="special"):
        most_frequent(counts, 1, always=(1, 4))


def test_token_map_is_checked():
    assert read_token_map({}, 10) is None
    assert read_token_map({"draft_vocab": {"token_ids": [1, 4]}}, 10).tolist() == [1, 4]
    for bad in ({"draft_vocab": [1, 2]}, {"draft_vocab": {"token_ids": [3, 1]}},
                {"draft_vocab": {"token_ids": [1, 10]}}, {"draft_vocab": {"token_ids": []}}):
        with pytest.raises(SpecquantError):
            read_token_map(bad, 10)
    with pytest.raises(SpecquantError, match="ascending"):
        check_token_ids([2, 2], 10)


@pytest.fixture(scope="module")
def pair():
    return peaky_pair(VOCAB)


def kept_ids(target, prompts, n: int) -> torch.Tensor:
    """The n ids the target emits most on these prompts (a stand-in for counting on regen text)."""
    counts = torch.zeros(VOCAB, dtype=torch.long)
    for p in prompts:
        for t in generate(target, p, 40, stop_on_eos=False).token_ids[0]:
            counts[t] += 1
    return most_frequent(counts, n)


PROMPTS = [torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(n)) for n in (3, 17, 40)]


def block_model(target, seed=2):
    return small_block_draft(target, seed=seed)


def drafter(kind, target, draft, ids, spec):
    """The LM or block drafter, with its head pruned to ids (None: the full head)."""
    import copy

    if kind == "lm":
        model = copy.deepcopy(draft)
        if ids is not None:
            prune_lm_head(model, ids)
        return LMDrafter(model, spec)
    model = block_model(target)
    if ids is not None:
        setattr(model, ATTRIBUTE, ids)
    return BlockDrafter(model, target, spec)


class Spy:
    """Records every drafted token of the wrapped drafter."""

    def __init__(self, inner):
        self.inner, self.drafted = inner, []
        self.target_layers = inner.target_layers
        self.max_draft_len = getattr(inner, "max_draft_len", None)

    def setup(self, b, n):
        self.inner.setup(b, n)

    def prefill(self, ids, hidden):
        self.inner.prefill(ids, hidden)

    def propose(self, tokens, k, sampling, generator):
        d = self.inner.propose(tokens, k, sampling, generator)
        self.drafted += d.tokens[0].tolist()
        return d

    def accept(self, n, hidden):
        self.inner.accept(n, hidden)

    def rollback(self, n):
        self.inner.rollback(n)


@pytest.mark.parametrize("kind", ["lm", "block"])
def test_greedy_with_a_pruned_head_equals_target_greedy(pair, kind):
    """Output equal to target-only greedy with the head pruned to a third of the vocabulary; drafts only from the
    kept ids; and with every id kept, exactly the unpruned drafter's acceptance (the map is the identity)."""
    target, draft = pair
    spec = SpecConfig(draft_len=3)
    ids = kept_ids(target, PROMPTS, 32)
    pruned = Spy(drafter(kind, target, draft, ids, spec))
    whole = SpecEngine(target, drafter(kind, target, draft, None, spec), spec)
    identity = SpecEngine(target, drafter(kind, target, draft, torch.arange(VOCAB), spec), spec)
    engine = SpecEngine(target, pruned, spec)
    for prompt in PROMPTS:
        ref = generate(target, prompt, 40, stop_on_eos=False).token_ids[0]
        out = engine.generate(prompt, 40, stop_on_eos=False)
        assert out.token_ids[0] == ref
        full, same = whole.generate(prompt, 40, stop_on_eos=False), identity.generate(prompt, 40, stop_on_eos=False)
        assert same.token_ids[0] == ref and same.stats["num_accepted_tokens"] == full.stats["num_accepted_tokens"]
    assert pruned.drafted and set(pruned.drafted) <= set(ids.tolist())
    assert engine.metrics.num_accepted_tokens > 0


def test_rejection_sampling_with_a_pruned_draft_keeps_the_target_law():
    """One drafted token from a draft law with zero mass outside 4 kept ids of 10; the emitted token (the kept
    draft, else the recovered one) ~ the target's law, including on the 6 ids the draft can never propose.
    Chi-square over 10 tokens (9 dof): above 45 has probability < 1e-6 under the null (fixed seeds: deterministic).
    The draft law is far from the target's, so a rule that always accepts scores in the thousands (asserted)."""
    vocab, n = 10, 20000
    g = torch.Generator().manual_seed(0)
    sampling = SamplingConfig(temperature=1.0)
    target_logits = torch.randn(2, vocab, generator=g)
    target_probs = logits_to_probs(target_logits[0], sampling)
    head = PrunedHead(Linear(4, vocab, bias=False), torch.tensor([1, 4, 6, 9]))
    draft_kept = torch.tensor([0.55, 0.05, 0.3, 0.1])
    draft_probs = head.to_vocab_probs(draft_kept)  # [vocab], zero on the 6 pruned ids
    counts, accepted_counts = torch.zeros(vocab), torch.zeros(vocab)
    for _ in range(n):
        x = head.to_vocab(torch.multinomial(draft_kept, 1, generator=g))  # [1] full id
        accepted, token = verify(x, draft_probs[None], target_logits, sampling, g)
        emitted = int(x) if accepted else token
        counts[emitted] += 1
        accepted_counts[int(x)] += accepted
    expected = target_probs * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 45.0, (counts, expected)
    assert counts[[0, 2, 3, 5, 7, 8]].sum() > 0  # the pruned ids are reached through recovery
    always = torch.zeros(vocab).index_add_(0, torch.tensor([1, 4, 6, 9]), draft_kept * n)
    assert float(((always - expected) ** 2 / expected).sum()) > 1000.0


@pytest.mark.parametrize("kind", ["lm", "block"])
def test_speculative_sampling_with_a_pruned_head_follows_the_target_law(pair, kind):
    """End to end: the first verified position follows the target's law with a pruned draft head (conftest's
    assert_follows_target_law states the odds)."""
    from conftest import assert_follows_target_law, target_law

    target, draft = pair
    prompt = PROMPTS[0]
    spec = SpecConfig(draft_len=3)
    law = target_law(target, prompt)
    ids = most_frequent(law[1] + law[3], 24)  # the likely tokens of both positions: drafts get accepted
    engine = SpecEngine(target, drafter(kind, target, draft, ids, spec), spec)
    assert_follows_target_law(engine, prompt, law, n=500, tv_bound=0.35)
    assert engine.metrics.num_accepted_tokens > 0


@needs_bundled("tiny-draft")
def test_prune_head_cli_writes_a_map_the_lm_drafter_loads(capsys, tmp_path):
    out = tmp_path / "pruned"
    rc = main(["distill", "prune-head", "--draft", "tiny-draft", "--keep", "1024", "--out", str(out), "--json"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and result["kept"] == 1024 and 0.5 < result["coverage"] <= 1.0
    hf = json.loads((out / "config.json").read_text())
    ids = read_token_map(hf, hf["vocab_size"])
    assert ids.numel() == 1024 and hf["eos_token_id"] in ids.tolist()
    from specquant.spec_decode.drafters import KINDS
    from specquant.spec_decode.runtime import RuntimeConfig

    model = KINDS["lm"].load(str(out), RuntimeConfig())
    assert isinstance(model.lm_head, PrunedHead) and torch.equal(model.lm_head.token_ids, ids)
    rc = main(["distill", "prune-head", "--draft", "tiny-draft", "--keep", "0", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert rc == 2 and "keep 0" in err and len(err.strip().splitlines()) == 1
