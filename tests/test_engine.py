"""One engine, one loop: SpecEngine.stream against generate, target-only decoding as the none drafter (against a
plain cache-free reference), the drafter registry and build_engine, and a model-free point-mass drafter."""

from __future__ import annotations


import pytest
import torch

from conftest import assert_follows_target_law, needs_bundled, peaky_model, peaky_pair, target_law
from specquant.cli import main
from specquant.errors import SpecquantError
from specquant.model.checkpoint import BUNDLED_DIR, read_hf_config
from specquant.model.decoder import Transformer
from specquant.spec_decode import Draft, SpecConfig, SpecEngine, generate
from specquant.spec_decode.build import build_engine
from specquant.spec_decode.runtime import RuntimeConfig
from specquant.spec_decode.drafters import KINDS, kind_named, kind_of, parse_draft

VOCAB = 96


def _model(layers: int, seed: int, eos: int | None = None) -> Transformer:
    return peaky_model(layers, seed, VOCAB, eos)


@pytest.fixture(scope="module")
def pair():
    return peaky_pair(VOCAB)


PROMPT = torch.randint(0, VOCAB, (1, 19), generator=torch.Generator().manual_seed(19))


@torch.no_grad()
def _reference_greedy(model: Transformer, prompt: torch.Tensor, n: int) -> list[list[int]]:
    """Target-only greedy written plainly: a cache-free forward over the whole sequence per token."""
    seq = prompt.clone()
    for _ in range(n):
        model.clear_cache()
        nxt = model(seq)[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
    return seq[:, prompt.shape[1]:].tolist()


def test_target_only_is_the_none_drafter_and_matches_a_plain_reference(pair):
    target, _ = pair
    prompts = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(3))
    out = generate(target, prompts, 20, stop_on_eos=False)
    assert out.token_ids == _reference_greedy(target, prompts, 20)
    assert out.spec is None and "num_drafts" not in out.stats  # target-only stats, as before
    assert out.stats["new_tokens"] == 20 and out.stats["target_forwards"] == 20
    engine = SpecEngine(target)
    assert engine.drafter.max_draft_len == 0 and not engine.speculative
    assert engine.generate(prompts[1:2], 20, stop_on_eos=False).token_ids == [out.token_ids[1]]  # rows independent


def test_target_only_step_is_one_one_token_forward(pair, monkeypatch):
    """No verify block, no extra forward: after the prefill, every forward takes one token per row and returns
    the last position only."""
    target, _ = pair
    calls = []
    forward = Transformer.forward

    def counting(self, tokens, start_pos=0, last_only=False, *args, **kwargs):
        calls.append((tokens.shape[1], last_only))
        return forward(self, tokens, start_pos, last_only, *args, **kwargs)

    monkeypatch.setattr(Transformer, "forward", counting)
    generate(target, PROMPT, 12, stop_on_eos=False)
    assert calls == [(PROMPT.shape[1], True)] + [(1, True)] * 11


@pytest.mark.parametrize("draft_len", [1, 3])
def test_stream_yields_what_generate_returns(pair, draft_len):
    target, draft = pair
    cfg = SpecConfig(draft_len=draft_len)
    result = SpecEngine(target, draft, cfg).generate(PROMPT, 30, stop_on_eos=False)
    engine = SpecEngine(target, draft, cfg)
    steps = list(engine.stream(PROMPT, 30, stop_on_eos=False))
    assert [t for s in steps for t in s.token_ids[0]] == result.token_ids[0]
    assert steps[0].metrics.proposed == 0 and len(steps[0].token_ids[0]) == 1  # the prefill's token
    assert all(len(s.token_ids[0]) == s.metrics.accepted + 1 for s in steps[1:])
    assert sum(s.metrics.accepted for s in steps) == result.spec.num_accepted_tokens
    assert sum(1 for s in steps if s.metrics.proposed) == result.spec.num_drafts
    assert result.stats["target_forwards"] == len(steps)
    assert engine.metrics == result.spec  # the engine's counters saw the same steps


def test_stream_checks_before_running_and_counts_only_consumed_steps(pair):
    target, draft = pair
    engine = SpecEngine(target, draft)
    with pytest.raises(SpecquantError, match="exceeds"):  # raised by the call, not by the first step
        engine.stream(PROMPT, 10_000)
    it = engine.stream(PROMPT, 30, stop_on_eos=False)
    taken = [next(it), next(it)]
    it.close()
    assert engine.metrics.num_drafts == 1 and engine.metrics.num_accepted_tokens == taken[1].metrics.accepted


def test_stream_stops_after_eos_in_every_row():
    free = _model(3, 0)
    reference = generate(free, PROMPT, 30, stop_on_eos=False).token_ids[0]
    eos = reference[5]
    stopping = _model(3, 0, eos=eos)
    cut = reference[: reference.index(eos) + 1]
    steps = list(SpecEngine(stopping).stream(PROMPT, 30))
    assert [t for s in steps for t in s.token_ids[0]] == cut
    assert generate(stopping, PROMPT, 30).token_ids[0] == cut
    # batch: a row that stopped yields nothing while the other goes on
    both = torch.cat([PROMPT, torch.randint(0, VOCAB, (1, 19), generator=torch.Generator().manual_seed(5))])
    rows = generate(stopping, both, 30).token_ids
    assert rows[0] == cut and rows[1] == generate(stopping, both[1:], 30).token_ids[0]


def test_speculative_engine_refuses_batches_target_only_takes_them(pair):
    target, draft = pair
    two = PROMPT.repeat(2, 1)
    with pytest.raises(SpecquantError, match="batch 1"):
        SpecEngine(target, draft).generate(two, 5)
    assert len(SpecEngine(target).generate(two, 5).token_ids) == 2


# --- the registry ------------------------------------------------------------------------------------------------


def test_registry_kinds_costs_and_detection():
    assert list(KINDS) == ["block", "mtp", "lm", "none", "suffix", "hybrid"]
    assert KINDS["hybrid"].vllm_method is None and not KINDS["hybrid"].detect(read_hf_config(BUNDLED_DIR / "tiny-draft"))
    assert [KINDS[k].forwards_per_step(4) for k in ("lm", "block", "mtp", "none", "suffix")] == [4, 1, 4, 0, 0]
    assert kind_of(read_hf_config(BUNDLED_DIR / "tiny-draft")).name == "lm"
    assert kind_of(read_hf_config(BUNDLED_DIR / "tiny-block-draft")).name == "block"
    assert (KINDS["lm"].vllm_method, KINDS["block"].vllm_method, KINDS["none"].vllm_method) == \
        ("draft_model", "dflash", None)
    assert not KINDS["suffix"].detect(read_hf_config(BUNDLED_DIR / "tiny-draft"))
    with pytest.raises(SpecquantError, match="none of the drafter kinds"):
        kind_of({"model_type": "gpt2"})


def test_drafter_options_by_kind():
    """One settings object per kind that has settings, keyed by kind name and made from the rows; build_engine
    takes some kinds' and completes the rest with defaults, refusing unknown names and wrong types."""
    from specquant.spec_decode.drafter import DrafterKind
    from specquant.spec_decode.drafters import DrafterOptions, drafter_options
    from specquant.spec_decode.drafters.hybrid import HybridConfig
    from specquant.spec_decode.suffix_drafter import SuffixConfig

    assert list(DrafterOptions()) == [name for name, kind in KINDS.items() if kind.options] == ["suffix", "hybrid"]
    assert {name: kind.cost for name, kind in KINDS.items()} == {
        "block": "block", "mtp": "head", "lm": "decoder", "none": None, "suffix": None, "hybrid": None}
    options = drafter_options({"suffix": SuffixConfig(max_draft_len=7)})
    assert options["suffix"].max_draft_len == 7 and options["hybrid"] == HybridConfig() and "none" not in options
    assert KINDS["suffix"].options_in(None) == SuffixConfig() and KINDS["suffix"].options_in(options) is \
        options["suffix"]
    with pytest.raises(SpecquantError, match="'ngram': no drafter kind with settings is called that; use suffix, "
                                             "hybrid"):
        drafter_options({"ngram": SuffixConfig()})
    with pytest.raises(SpecquantError, match="for 'suffix' are a HybridConfig; pass a SuffixConfig"):
        build_engine("tiny-target", "suffix", draft_options={"suffix": HybridConfig()})
    with pytest.raises(SpecquantError, match="hybrid min_match 0 must be at least 1"):
        build_engine("tiny-target", "suffix", draft_options={"hybrid": HybridConfig(min_match=0)})
    with pytest.raises(SpecquantError, match="serve_options is a HybridConfig; give an instance of its options "
                                             r"class \(SuffixConfig\)"):
        DrafterKind(name="x", title="x", detect=lambda hf: False, load=None, build=None,
                    forwards_per_step=lambda k: k, options=SuffixConfig, serve_options=HybridConfig())
    with pytest.raises(SpecquantError, match="cost 'gpu' is unknown; use one of decoder, block, head"):
        DrafterKind(name="x", title="x", detect=lambda hf: False, load=None, build=None,
                    forwards_per_step=lambda k: k, cost="gpu")


def test_draft_names_kinds_and_directories():
    assert parse_draft(None)[0].name == "none" and parse_draft("None") == (KINDS["none"], None)
    assert parse_draft("tiny-draft") == (KINDS["lm"], "tiny-draft")
    assert parse_draft(str(BUNDLED_DIR / "tiny-block-draft"))[0].name == "block"
    with pytest.raises(SpecquantError, match="needs a checkpoint"):
        parse_draft("lm")
    assert parse_draft("suffix") == (KINDS["suffix"], None)
    assert parse_draft("suffix+tiny-draft") == (KINDS["hybrid"], "tiny-draft")
    with pytest.raises(SpecquantError, match=r"drafter kind \(mtp, none, suffix\)"):
        parse_draft("ngram")  # not a kind: one line that names the kinds there are
    with pytest.raises(SpecquantError, match="block, mtp, lm, none, suffix"):
        kind_named("ngram")


def test_generate_cli_unknown_draft_is_one_error_line(capsys):
    rc = main(["generate", "--draft", "ngram", "--max-new-tokens", "2"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and "drafter kind" in err


def test_runtime_config_is_checked():
    with pytest.raises(SpecquantError, match="pick one"):
        RuntimeConfig(compile=True, aot="build").validate()
    with pytest.raises(SpecquantError, match="dtype 'float8'"):
        RuntimeConfig(dtype="float8").validate()
    assert RuntimeConfig(device="cuda:1").validate().device == "cuda:1"


@needs_bundled("tiny-target")
@pytest.mark.parametrize("draft", ["none", "tiny-draft", "tiny-block-draft"])
def test_build_engine_from_names_is_lossless(draft):
    engine = build_engine("tiny-target", draft)
    prompt = torch.tensor([[5, 17, 99, 3, 250, 41]])
    assert engine.generate(prompt, 24, stop_on_eos=False).token_ids == \
        generate(engine.target, prompt, 24, stop_on_eos=False).token_ids
    assert engine.speculative == (draft != "none")


# --- a model-free drafter: point-mass drafts ---------------------------------------------------------------------


class FixedDrafter:
    """Model-free: proposes `token` k times, as point masses (Draft.probs None) also when sampling."""

    target_layers: tuple[int, ...] = ()

    def __init__(self, token: int):
        self.token = token

    def setup(self, batch, max_len):
        pass

    def prefill(self, prompt_ids, target_hidden):
        pass

    def propose(self, tokens, k, sampling, generator):
        return Draft(torch.full((1, k), self.token, dtype=torch.long))

    def accept(self, length, target_hidden):
        pass

    def rollback(self, length):
        pass


def test_point_mass_drafter_is_lossless_greedy(pair):
    target, _ = pair
    ref = generate(target, PROMPT, 30, stop_on_eos=False).token_ids[0]
    out = SpecEngine(target, FixedDrafter(ref[3]), SpecConfig(draft_len=2)).generate(PROMPT, 30, stop_on_eos=False)
    assert out.token_ids[0] == ref


def test_point_mass_drafter_samples_the_target_law(pair):
    """End to end in sampling mode: the token after the prefill's is the first verified position; given the first
    token, it follows the target's law although the drafter always proposes one fixed token. Binomial z-test on the
    first token: |z| > 4.5 has probability < 1e-5; the second token's total variation bound sits far above the
    sampling noise of a few hundred draws (expected TV ~ sqrt(vocab / hits) / 2 ~ 0.25)."""
    target, _ = pair
    prompt = PROMPT
    law = target_law(target, prompt)
    drafted = int(law[3].argmax())
    assert 0.05 < float(law[3][drafted]) < 0.95  # the drafted token is neither certain nor impossible
    engine = SpecEngine(target, FixedDrafter(drafted), SpecConfig(draft_len=2))
    assert_follows_target_law(engine, prompt, law, n=500, tv_bound=0.35)
    assert 0 < engine.metrics.num_accepted_tokens < engine.metrics.num_draft_tokens  # accepted and rejected both
