"""decode/graphs.py: captured steps against the eager forward over the same static cache.

On CPU the capture falls back to the eager stand-in (same static buffers, same aliasing); on a CUDA machine
(scripts/gpu_check.sh) the same tests replay real CUDA graphs, also over a torch.compile'd model.
"""

import pytest
import torch

from specquant.decode.graphs import SEQ_ROUND, GraphStepper, StepGraph
from specquant.model.config import ModelConfig
from specquant.model.decoder import Transformer

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _model(device, window=None, dtype=torch.float32, seed=0, layers=2):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=80, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      sliding_window=window)
    return Transformer(cfg).eval().to(device, dtype)


# (start, T, last_only): prefill, decode steps, a verify block, a rollback by 3 that overwrites, more decode
SCHEDULE = ([(0, 20, True)] + [(i, 1, True) for i in range(20, 26)] + [(26, 5, False), (28, 5, False)]
            + [(i, 1, True) for i in range(33, 40)] + [(40, 5, False)])


def _run(call, tokens):
    return [call(tokens[:, s : s + t], s, last).clone() for s, t, last in SCHEDULE]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [None, 12])
@pytest.mark.parametrize("compile", [False, True])
def test_graph_steps_match_eager(device, window, compile):
    if compile and (device == "cpu" or window is not None):
        # CPU: torch.compile is covered by tests/test_compiled.py; CUDA: one compilation keeps the GPU check short
        pytest.skip("compiled + graphs: CUDA, full attention only")
    model = _model(device, window)
    tokens = torch.randint(0, 80, (1, 48), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        model.setup_cache(1, 256, max_block=16, static=True)
        eager = _run(lambda tok, s, last: model(tok, s, last), tokens)
        stepper = GraphStepper(model, compile=compile)
        stepper.setup(1, 256, max_block=16)
        graphed = _run(stepper, tokens)
        assert {t for _, t, _ in SCHEDULE if t <= stepper.max_t} == {t for t, _, _ in stepper.graphs}
        captured = dict(stepper.graphs)
        stepper.setup(1, 256, max_block=16)  # a second request of the same shape reuses buffers and graphs
        assert stepper.graphs == captured
        again = _run(stepper, tokens)
    tol = {} if device == "cpu" and not compile else {"atol": 1e-4, "rtol": 1e-4}
    for i, (e, g, a) in enumerate(zip(eager, graphed, again)):
        if tol:
            torch.testing.assert_close(g, e, **tol, msg=f"step {i} {SCHEDULE[i]}")
        else:
            assert torch.equal(g, e) and torch.equal(a, e), f"step {i} {SCHEDULE[i]}"
        torch.testing.assert_close(a, g, atol=0, rtol=0)  # replays are deterministic


@pytest.mark.parametrize("device", DEVICES)
def test_step_output_is_a_static_buffer(device):
    """The contract callers rely on: the next call of the same shape overwrites the returned logits."""
    model = _model(device)
    with torch.no_grad():
        stepper = GraphStepper(model)
        stepper.setup(1, 100)
        assert model.rope_cos.shape[0] >= SEQ_ROUND and model.cache_capacity() == SEQ_ROUND
        tok = torch.tensor([[3, 4]], device=device)
        stepper(tok, 0, False)
        first = stepper(tok[:, :1], 2, True)
        kept = first.clone()
        second = stepper(tok[:, 1:], 3, True)
        assert second is first and not torch.equal(first, kept)


def test_step_graph_copies_inputs_into_static_buffers():
    calls = []

    def fn(a, b):
        calls.append((a.data_ptr(), b.data_ptr()))
        return a * 2 + b

    x, y = torch.ones(3), torch.zeros(3)
    g = StepGraph(fn, (x, y))
    assert torch.equal(g.output, 2 * x)
    out = g(torch.full((3,), 5.0), torch.ones(3))
    assert torch.equal(out, torch.full((3,), 11.0)) and out is g.output
    assert len(set(calls)) == 1  # always the same static input buffers, never the caller's tensors
    assert calls[0][0] not in (x.data_ptr(),)


def test_step_graph_tuple_outputs():
    """Tuple outputs (logits plus hidden states, for drafters that read the target's layers) stay static too."""
    g = StepGraph(lambda a: (a + 1, None, a * 3), (torch.ones(2),))
    first = g.output
    out = g(torch.full((2,), 2.0))
    assert out[1] is None and out[0] is first[0] and torch.equal(out[0], torch.full((2,), 3.0))
    assert torch.equal(out[2], torch.full((2,), 6.0))


def _engines(device, window):
    from specquant.spec_decode.config import SpecConfig
    from specquant.spec_decode.engine import SpecEngine

    target, draft = _model(device, seed=0, layers=2), _model(device, seed=1, layers=1)
    with torch.no_grad():  # a draft that agrees with the target often enough for accepted counts of 0..k
        draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
    cfg = SpecConfig(draft_len=3, draft_window=window)
    return SpecEngine(target, draft, cfg), SpecEngine(target, draft, cfg, graphs=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [None, 12])
@pytest.mark.parametrize("greedy", [True, False])
def test_engine_with_graphs_matches_eager(device, window, greedy):
    """The speculative engine with captured steps (target verify, LM drafter) emits what the eager engine emits,
    with the same acceptance, greedy and sampled; a second request reuses the graphs."""
    from specquant.decode.sampling import SamplingConfig

    eager, graphed = _engines(device, window)
    sampling = SamplingConfig() if greedy else SamplingConfig(temperature=0.8, seed=3)
    prompts = [torch.randint(0, 80, (1, n), generator=torch.Generator().manual_seed(n)).to(device) for n in (9, 40)]
    for prompt in prompts:
        a = eager.generate(prompt, 30, sampling, stop_on_eos=False)
        b = graphed.generate(prompt, 30, sampling, stop_on_eos=False)
        assert a.token_ids == b.token_ids
        assert a.spec.histogram == b.spec.histogram and a.spec.num_drafts == b.spec.num_drafts > 0
    graphs = dict(graphed.target_step.graphs)
    assert graphs and {t for t, _, _ in graphs} >= {4}  # the k+1 = 4 verify step was captured
    graphed.generate(prompts[1], 30, sampling, stop_on_eos=False)  # same shapes: no recapture
    assert graphed.target_step.graphs == graphs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs are a CUDA matter")
def test_speculative_step_syncs_once_on_cuda():
    """Greedy, graphs on: per verify step the host waits once (the accepted count and the next token, one read)."""
    import warnings

    _, graphed = _engines("cuda", None)
    prompt = torch.randint(0, 80, (1, 12), generator=torch.Generator().manual_seed(0)).cuda()
    graphed.generate(prompt, 40, stop_on_eos=False)  # captures every shape first
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res = graphed.generate(prompt, 40, stop_on_eos=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    steps = res.stats["target_forwards"] - 1
    assert len(syncs) <= steps + 1, f"{len(syncs)} syncs for {steps} verify steps (+1 for the prefill)"
