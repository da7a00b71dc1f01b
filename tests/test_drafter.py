"""The Drafter seam: target hidden states reach a drafter exactly as a cache-free target forward computes them,
any Drafter plugs into SpecEngine, and the confidence stop and profiling wrapper keep the output lossless."""

import pytest
import torch

from conftest import peaky_pair
from specquant.spec_decode.engine import generate
from specquant.spec_decode import Drafter, LMDrafter, SpecConfig, SpecEngine
from specquant.errors import SpecquantError

VOCAB = 96


@pytest.fixture(scope="module")
def pair():
    return peaky_pair(VOCAB)


PROMPT = torch.randint(0, VOCAB, (1, 23), generator=torch.Generator().manual_seed(23))


class HiddenRecordingDrafter:
    """An LM drafter that also declares target layers, as a block drafter would, and keeps what it is handed:
    context[p] = the target hidden states of sequence position p."""

    def __init__(self, inner: LMDrafter, layers: tuple[int, ...]):
        self.inner, self.target_layers, self.context = inner, layers, []

    def setup(self, batch, max_len):
        self.inner.setup(batch, max_len)
        self.context = []

    def prefill(self, prompt_ids, target_hidden):
        assert target_hidden.shape[:3] == (1, prompt_ids.shape[1], len(self.target_layers))
        self.context = list(target_hidden[0].clone())  # a view of the target's buffers: copy what is kept
        self.inner.prefill(prompt_ids, None)

    def propose(self, tokens, k, sampling, generator):
        assert len(self.context) == tokens.shape[1] - 1  # every committed position but the last
        return self.inner.propose(tokens, k, sampling, generator)

    def accept(self, length, target_hidden):
        self.rollback(length - target_hidden.shape[1])
        self.context += list(target_hidden[0].clone())
        assert len(self.context) == length
        self.inner.accept(length, None)

    def rollback(self, length):
        del self.context[length:]
        self.inner.rollback(length)


def test_hidden_layers_cost_nothing_and_end_in_the_logits(pair):
    target, _ = pair
    target.clear_cache()
    with torch.no_grad():
        logits = target(PROMPT)
        logits2, hidden = target(PROMPT, hidden_layers=(2, 0))
    assert torch.equal(logits, logits2)
    assert hidden.shape == (1, PROMPT.shape[1], 2, 64)
    with torch.no_grad():  # the last layer's output, normed and projected, is the logits
        torch.testing.assert_close(target.lm_head(target.model.norm(hidden[:, :, 0])), logits)


@pytest.mark.parametrize("graphs", [False, True])
def test_drafter_receives_exactly_the_targets_hidden_states(pair, graphs):
    """Also with graphs=True (decode/graphs.py): the target's captured steps return hidden states too."""
    target, draft = pair
    cfg = SpecConfig(draft_len=3)
    drafter = HiddenRecordingDrafter(LMDrafter(draft, cfg, graphs=graphs), (0, 2))
    assert isinstance(drafter, Drafter)
    out = SpecEngine(target, drafter, cfg, graphs=graphs).generate(PROMPT, 30, stop_on_eos=False)
    assert out.token_ids[0] == generate(target, PROMPT, 30, stop_on_eos=False).token_ids[0]  # still lossless
    assert out.spec.num_drafts > 0 and 0 < out.spec.num_accepted_tokens < out.spec.num_draft_tokens
    seq = torch.cat([PROMPT, torch.tensor([out.token_ids[0]])], 1)
    target.clear_cache()
    with torch.no_grad():
        _, reference = target(seq, hidden_layers=(0, 2))  # cache-free, all positions at once
    got = torch.stack(drafter.context)  # the positions the target verified: all but the last emitted token
    assert got.shape[0] == seq.shape[1] - 1
    # other summation orders than the cache-free forward's SDPA: graphs run the static cache (attention over the
    # whole buffer under a mask), eager fp32 CPU steps the native few-query attention and norms (kernels/ops.py;
    # 3.5e-4 measured on a 1e-4 tolerance); both ~1e-6 relative per op against float64, compounded over the layers
    tol = 1e-3
    torch.testing.assert_close(got, reference[0, : got.shape[0]], rtol=tol, atol=tol)


def test_drafter_layers_are_checked(pair):
    target, draft = pair
    with pytest.raises(SpecquantError, match=r"target layers \[3\]"):
        SpecEngine(target, HiddenRecordingDrafter(LMDrafter(draft, SpecConfig()), (0, 3)))


def test_confidence_stop_without_adaptive_is_lossless_and_stops(pair):
    target, draft = pair
    ref = generate(target, PROMPT, 40, stop_on_eos=False).token_ids[0]
    k = 4
    out = SpecEngine(target, draft, SpecConfig(draft_len=k, draft_confidence=0.5)).generate(PROMPT, 40,
                                                                                             stop_on_eos=False)
    assert out.token_ids[0] == ref
    assert out.spec.num_draft_tokens < k * out.spec.num_drafts  # some drafts ended early


def test_profile_adds_component_times_and_changes_nothing(pair):
    target, draft = pair
    plain = SpecEngine(target, draft).generate(PROMPT, 20, stop_on_eos=False)
    profiled = SpecEngine(target, draft, profile=True).generate(PROMPT, 20, stop_on_eos=False)
    assert profiled.token_ids == plain.token_ids and profiled.spec == plain.spec
    s = profiled.stats
    assert s["target_calls"] == s["target_forwards"] and s["target_s"] > 0 and s["draft_s"] > 0
    assert s["draft_calls"] == 1 + plain.spec.num_drafts  # prefill + one propose per draft
    assert "draft_s" not in plain.stats
