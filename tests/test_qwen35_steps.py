"""The fast steps on a Qwen3.5 hybrid: torch.compile, AOTInductor packages and CUDA-graph steps against the eager
reference, with the Gated DeltaNet state driven through the static cache (begin_step before, rollback after).

The target is a random two-layer hybrid (gated attention, then Gated DeltaNet) so each compilation stays short;
the LM drafter is a noised copy of it, so drafts are accepted in part and rollbacks land inside verified blocks and
across the drafter's own several forwards. On CPU the CUDA-graph steps run their eager stand-in over the same static
buffers (decode/graphs.py); the capture itself is checked on CUDA by scripts/gpu_check.sh.
"""

from __future__ import annotations

import pytest
import torch
from _qwen35_models import VOCAB, hf_model
from conftest import own_cache

from specquant.decode.compiled import Stepper
from specquant.decode.graphs import GraphStepper, warm_up
from specquant.model.config import ModelConfig
from specquant.model.decoder import Transformer
from specquant.spec_decode.config import SpecConfig
from specquant.spec_decode.engine import SpecEngine, generate
from specquant.model.layers import layer_kinds


def ours(theirs) -> Transformer:
    model = Transformer(ModelConfig.from_hf(theirs.config.to_dict()))
    model.load_state_dict(theirs.state_dict(), strict=False)
    return model.eval()


def _pair():
    target = ours(hf_model("mha", 2, seed=11, scale=0.35))
    draft = ours(hf_model("mha", 2, seed=11, scale=0.35))
    with torch.no_grad():
        torch.manual_seed(12)
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.03)  # accepts 0..3 of 3 drafts at different steps
    assert layer_kinds(target.config) == ("gated_attention", "linear_attention")
    return target, draft


PROMPT = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
CFG = SpecConfig(draft_len=3)


def _spec_matches(eager, fast):
    assert fast.token_ids == eager.token_ids
    assert fast.stats["num_accepted_tokens"] == eager.stats["num_accepted_tokens"]
    assert 0 < eager.stats["num_accepted_tokens"] < eager.stats["num_draft_tokens"]  # accepted and rejected drafts


def test_compiled_steps_on_a_hybrid_match_eager():
    """torch.compile of the decode step and of the 4-token verify step: greedy tokens identical to eager, target
    only and speculative, two graphs in all; a request of another length at other positions reuses them (the
    DeltaNet record's offset is a device tensor and its counters stay outside the graph: nothing recompiles per
    position; the steps get a contiguous copy of the tokens and the cache a size bucket: nor per request length)."""
    target, draft = _pair()
    eager = generate(target, PROMPT, 24, stop_on_eos=False).token_ids
    spec_eager = SpecEngine(target, draft, CFG).generate(PROMPT, 24, stop_on_eos=False)
    assert spec_eager.token_ids == eager
    # another prompt and request length (9 + 24 above, 12 + 15 here: another token-buffer stride), within the
    # caches' size; eager first, as the eager runs give the model eager caches, and the compiled ones static
    other = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))
    other_eager = SpecEngine(target, draft, CFG).generate(other, 15, stop_on_eos=False)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    stepper = Stepper(target, compile=True, compile_shapes=(1, 4))
    # target-only first, then speculative, which needs more positions (the draft's room): the same size bucket
    assert generate(stepper, PROMPT, 24, stop_on_eos=False).token_ids == eager
    _spec_matches(spec_eager, SpecEngine(stepper, draft, CFG).generate(PROMPT, 24, stop_on_eos=False))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs == 2
    _spec_matches(other_eager, SpecEngine(stepper, draft, CFG).generate(other, 15, stop_on_eos=False))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_aot_packages_on_a_hybrid_bind_and_match_eager(tmp_path, monkeypatch):
    """The target's verify step and the LM drafter's decode step as AOTInductor packages (both hybrids: the chunked
    and the one-token rule), bound to the models' own DeltaNet state buffers: the same tokens and acceptance as
    the eager engine; a second engine in "cached" mode loads the packages instead of building them."""
    from specquant.decode import aot

    monkeypatch.setenv("SPECQUANT_CACHE", str(own_cache(tmp_path)))
    target, draft = _pair()
    spec_eager = SpecEngine(target, draft, CFG).generate(PROMPT, 24, stop_on_eos=False)
    engine = SpecEngine(target, draft, CFG, aot="build")
    _spec_matches(spec_eager, engine.generate(PROMPT, 24, stop_on_eos=False))
    assert set(engine.target_step.aot_steps) == {(4, False)} and set(engine.drafter.step.aot_steps) == {(1, True)}
    packages = sorted((tmp_path / "compile" / "aot").glob("*.pt2"))
    assert len(packages) == 2
    for step in (*engine.target_step.aot_steps.values(), *engine.drafter.step.aot_steps.values()):
        # every weight, however small (A_log, dt_bias: inductor inlines tiny constants unless told not to), and
        # the DeltaNet cache's buffers are the model's own tensors, bound, not baked in or copied
        bound = {n[len(aot.PREFIX):] for n in step.loader.get_constant_fqns()}
        assert {n for n, _ in target.named_parameters()} <= bound  # the draft has the same architecture
        assert {"model.layers.1.linear_attn.cache.state", "model.layers.1.linear_attn.cache.offset"} <= bound
    state = next(c for c in target.caches() if c is not None and c.kind == "deltanet").state
    step = engine.target_step.aot_steps[(4, False)]
    assert state.data_ptr() == step.model_tensors["model.layers.1.linear_attn.cache.state"].data_ptr()
    cached = SpecEngine(target, draft, CFG, aot="cached")
    _spec_matches(spec_eager, cached.generate(PROMPT, 24, stop_on_eos=False))
    assert cached.target_step.aot_steps and sorted((tmp_path / "compile" / "aot").glob("*.pt2")) == packages
    assert aot.MIN_CAPACITY == target.cache_capacity()


@pytest.mark.parametrize("greedy", [True, False])
def test_graph_steps_on_a_hybrid_match_eager(greedy):
    """GraphStepper for the target's verify and the LM drafter's steps (eager stand-in on CPU): the same tokens
    and acceptance as the eager engine, greedy and sampled, over two requests that reuse the steps."""
    from specquant.decode.sampling import SamplingConfig

    target, draft = _pair()
    sampling = SamplingConfig() if greedy else SamplingConfig(temperature=0.8, seed=3)
    eager = SpecEngine(target, draft, CFG)
    graphed = SpecEngine(target, draft, CFG, graphs=True)
    assert isinstance(graphed.target_step, GraphStepper)
    for prompt in (PROMPT, torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(4))):
        a = eager.generate(prompt, 30, sampling, stop_on_eos=False)
        b = graphed.generate(prompt, 30, sampling, stop_on_eos=False)
        assert a.token_ids == b.token_ids
        assert a.spec.histogram == b.spec.histogram and a.spec.num_drafts > 0
    assert {t for t, _, _ in graphed.target_step.graphs} >= {4}


def test_graph_steps_on_a_hybrid_decode_matches_eager():
    """Target-only decoding through GraphStepper.replay with positions on the device and no start (the caches
    continue where they are), against the eager steps."""
    target, _ = _pair()
    eager = generate(target, PROMPT, 16, stop_on_eos=False).token_ids
    stepper = GraphStepper(target)
    with torch.no_grad():
        stepper.setup(1, 64)
        tok = stepper(PROMPT, 0, True)[:, -1].argmax(-1)
        out = [int(tok)]
        for i in range(15):
            pos = torch.tensor([PROMPT.shape[1] + i])
            tok = stepper.replay(tok[:, None], pos, True)[:, -1].argmax(-1)
            out.append(int(tok))
    assert [out] == eager


def test_warm_up_leaves_the_state_as_it_found_it():
    """A CUDA graph's warm-up runs the step before capture; a recurrent state updated from itself must not advance
    there (the capture's replay is the one real step). The helper is device-free, so it is checked here."""
    state, overwritten = torch.zeros(3), torch.zeros(2)
    runs = []

    def step(x):
        runs.append(1)
        state.add_(x)  # from its own value: would advance once per run
        overwritten.fill_(7.0)

    warm_up(step, (torch.ones(3),), 2, (state,))
    assert len(runs) == 2 and not state.any() and torch.equal(overwritten, torch.full((2,), 7.0))


def test_generate_cli_runs_a_random_hybrid_with_its_defaults(tmp_path, monkeypatch, capsys):
    """`specquant generate --target <random qwen3_5_text dir>` with no step flags (AOT "cached": no package on disk,
    so the eager steps) prints what the engine generates; it used to refuse the hybrid."""
    import json

    from specquant.cli import main
    from specquant.loader import load_model
    from specquant.model.checkpoint import BUNDLED_DIR, load_tokenizer, save_model

    monkeypatch.setenv("SPECQUANT_CACHE", str(own_cache(tmp_path / "cache")))
    model = ours(hf_model("gva", 4, seed=3, vocab_size=8192))  # the bundled tokenizer's vocabulary
    path = save_model(model, tmp_path / "hybrid", tokenizer_from=BUNDLED_DIR / "tiny-target")
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen3_5_text"
    rc = main(["generate", "--target", str(path), "--json", "--draft", "none", "--max-new-tokens", "8",
               "--ignore-eos", "--prompt", "The meaning of the word"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    tokenizer = load_tokenizer(path)
    prompt = torch.tensor([tokenizer.encode("The meaning of the word", add_special_tokens=False)])
    assert json.loads(out)["token_ids"] == generate(load_model(path), prompt, 8, stop_on_eos=False).token_ids[0]
