"""`specquant bench` / `demo`: the report agrees with its raw samples, every output file is written,
the prediction formula matches Leviathan et al.'s worked example, prompts hit their lengths exactly, and bad input
fails with exit code 2 before anything is written.

Models: a small random target and a noisy copy of it as the draft (weights + 10% noise: greedy acceptance lands
between 1 and k+1, so the acceptance bookkeeping is exercised), saved with the bundled tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
import re
import statistics

import pytest
import torch
from conftest import randomize_

from specquant.bench.ablation import rows_for
from specquant.bench.prepare import quantized_checkpoint
from specquant.bench.config import BenchConfig
from specquant.bench.predict import (StepCosts, alpha_from_mal, expected_tokens, leviathan_speedup, mean_accept_s,
                                     predict_row, predicted_speedup, tokens_per_step)
from specquant.bench.prompts import DEFAULT_PROMPTS, fit_lengths, load_prompts, read_jsonl
from specquant.bench.report import FILES
from specquant.cli import main
from specquant.errors import SpecquantError
from specquant.model.block_draft import BlockDraftConfig, BlockDraftModel
from specquant.model.checkpoint import save_block_drafter
from specquant.model.checkpoint import BUNDLED_DIR, save_model
from specquant.loader import load_model
from specquant.model.config import ModelConfig
from specquant.model.decoder import Transformer
from specquant.quant import QuantConfig, quantize, save_quantized
from specquant.spec_decode.config import SpecConfig
from specquant.spec_decode.metrics import SpecMetrics
from specquant.spec_decode.runtime import RuntimeConfig
from specquant.train.draft import init_block_drafter

TOKENIZER = BUNDLED_DIR / "tiny-target"
# smallest settings that still run every row on every category and content set
# (no warm-up round and 3 cost repetitions: what this file checks is the bookkeeping, not the times; the warm-up's
# rounds are checked by test_interleaved_rounds_limit_one_runner_and_time_each)
SMALL = ["--max-new-tokens", "8", "--runs", "1", "--warmup", "0", "--draft-window", "16", "--prompts-per-length", "1",
         "--prompts-per-set", "1", "--qad-steps", "2", "--qad-prompts", "4", "--qad-new-tokens", "8",
         "--cost-reps", "3"]
SMALL_CFG = dict(max_new_tokens=8, runs=1, warmup=1, spec=SpecConfig(draft_window=16), prompts_per_length=1,
                 prompts_per_set=1,
                 cost_reps=3, curve_fractions=(1 / 8, 1 / 2), qad_steps=2, qad_prompts=4, qad_new_tokens=8)


def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER), local_files_only=True)  # tiny-target may lack weights


def _config(layers: int) -> ModelConfig:
    # hidden 128 so the default group size (128) divides every Linear; context 256 shrinks the bench lengths
    return ModelConfig(vocab_size=8192, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                       tie_word_embeddings=False)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_models")
    target = randomize_(Transformer(_config(2)), seed=0).eval()
    draft = Transformer(_config(2)).eval()
    draft.load_state_dict(target.state_dict())
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.add_(0.1 * p.std() * torch.randn(p.shape, generator=g))
    paths = {"target": save_model(target, root / "target", tokenizer_from=TOKENIZER),
             "draft": save_model(draft, root / "draft", tokenizer_from=TOKENIZER)}
    block = BlockDraftModel(BlockDraftConfig.for_target(target.config, num_hidden_layers=1, block_size=8,
                                                        target_layer_ids=[0, 1], mask_token_id=3))
    init_block_drafter(block, target, seed=0, mode="target")  # the target's last layer: it agrees sometimes
    paths["block"] = save_block_drafter(block, root / "block", tokenizer_from=TOKENIZER)
    for role in ("target", "draft"):  # RTN: the quick way to hand bench ready-made quantized inputs
        m = load_model(paths[role])
        quantize(m, QuantConfig(method="rtn"))
        paths[f"q{role}"] = save_quantized(m, root / f"q{role}", tokenizer_from=TOKENIZER)
    from specquant.quant.prune_vocab import prune_checkpoint

    paths["pruned"] = prune_checkpoint(paths["target"], root / "pruned", 4096)  # row (v); an untied head
    return paths


@pytest.fixture(scope="module")
def hybrid_pair(tmp_path_factory):
    """The demo's hybrid section at a tiny size: a random 2-layer Qwen3.5 hybrid (DeltaNet + gated attention, no
    mtp.* tensors: the demo initialises an MTP layer), a noisy copy as its LM draft and a random block drafter."""
    from _quant_models import hybrid_checkpoint, noisy_copy

    root = tmp_path_factory.mktemp("demo_hybrid")
    target = hybrid_checkpoint(root / "target", layers=2, layer_types=["linear_attention", "full_attention"],
                               hidden_size=128, intermediate_size=256, linear_key_head_dim=32,
                               linear_value_head_dim=32, head_dim=32, max_position_embeddings=256, scale=0.05)
    t = load_model(target)
    block = BlockDraftModel(BlockDraftConfig.for_target(t.config, num_hidden_layers=1, block_size=8,
                                                        target_layer_ids=[0, 1], mask_token_id=3))
    init_block_drafter(block, t, seed=0, mode="random")
    return {"target": str(target), "draft": str(noisy_copy(target, root / "draft")),
            "block_draft": str(save_block_drafter(block, root / "block", tokenizer_from=target)), "mtp": "init"}


@pytest.fixture(scope="module")
def bench_run(pair, tmp_path_factory):
    """One `specquant bench --json` run with ready-made quantized inputs; (stdout lines, results, out dir)."""
    out = tmp_path_factory.mktemp("bench") / "out"
    argv = ["bench", "--target", str(pair["target"]), "--draft", str(pair["draft"]),
            "--quantized-target", str(pair["qtarget"]), "--quantized-draft", str(pair["qdraft"]),
            "--pruned-target", str(pair["pruned"]), "--out", str(out), "--json", *SMALL]
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(argv)
    assert rc == 0
    lines = buf.getvalue().strip().splitlines()
    return lines, json.loads((out / "results.json").read_text()), out


# --- the formula ----------------------------------------------------------------------------------------------


def test_leviathan_worked_example():
    # Leviathan et al. via REFERENCE.md: alpha 0.8, gamma 4 -> E 3.36; c 0.10 -> 2.40x; c 0.25 -> 1.68x
    assert expected_tokens(0.8, 4) == pytest.approx(3.3616, abs=1e-4)
    assert leviathan_speedup(0.8, 4, 0.10) == pytest.approx(2.40, abs=0.005)
    assert leviathan_speedup(0.8, 4, 0.25) == pytest.approx(1.68, abs=0.005)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.75, 0.95])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_alpha_from_mal_inverts_expected_tokens(alpha, k):
    assert alpha_from_mal(expected_tokens(alpha, k), k) == pytest.approx(alpha, abs=1e-9)


def _metrics(histogram: list[int], k: int) -> SpecMetrics:
    """The counters of steps that each drafted k tokens and accepted histogram's counts."""
    m = SpecMetrics()
    for accepted, steps in enumerate(histogram):
        for _ in range(steps):
            m.record_step(k, accepted)
    return m


def test_measured_prediction_equals_closed_form_for_geometric_acceptance():
    # steps accepting exactly a of k: alpha^a (1 - alpha) for a < k, alpha^k for a = k (i.i.d. acceptance)
    alpha, k, c = 0.7, 4, 0.2
    probs = [alpha**a * (1 - alpha) for a in range(k)] + [alpha**k]
    m = _metrics([round(p * 10**5) for p in probs], k)
    e = tokens_per_step(m)
    assert e == m.mean_acceptance_length == pytest.approx(expected_tokens(alpha, k), rel=1e-4)
    # with a verify forward as cheap as one decode step, the measured form is Leviathan's formula
    assert predicted_speedup(e, k, c, 1.0) == pytest.approx(leviathan_speedup(alpha, k, c), rel=1e-4)
    assert predicted_speedup(e, k, c, 1.5) < predicted_speedup(e, k, c, 1.0)
    costs = StepCosts(target_step_s=10e-3, verify_s=10e-3, draft_step_s=2e-3, baseline_step_s=10e-3)
    p = predict_row(m, costs)  # an LM drafter: k forwards per step, no accept
    assert (p.k, p.draft_forwards_per_step, p.accept_ratio) == (k, k, 0.0) and p.expected_tokens == e
    assert p.speedup == pytest.approx(leviathan_speedup(alpha, k, c), rel=1e-4)
    assert p.alpha == pytest.approx(alpha_from_mal(m.mean_acceptance_length, k))
    # no step carried a draft: one token per target forward, no speedup to predict
    assert tokens_per_step(SpecMetrics()) == 1.0 and SpecMetrics().mean_acceptance_length == 0.0


def test_block_accept_cost_is_weighted_by_the_histogram_and_slows_the_prediction():
    # 10 steps: 4 accepted nothing (1 row projected), 6 accepted all 3 drafts (4 rows); 1 ms/row + 0.5 ms fixed
    histogram, accept_s = [4, 0, 0, 6], [1.5e-3, 2.5e-3, 3.5e-3, 4.5e-3]
    assert mean_accept_s(histogram, accept_s) == pytest.approx((4 * 1.5e-3 + 6 * 4.5e-3) / 10)
    costs = StepCosts(target_step_s=10e-3, verify_s=13e-3, draft_step_s=8e-3, baseline_step_s=10e-3,
                      draft_forwards_per_step=1)
    m = _metrics(histogram, 3)
    without = predict_row(m, costs)
    with_accept = predict_row(m, dataclasses.replace(costs, accept_s=tuple(accept_s)))
    e = m.mean_acceptance_length
    assert e == pytest.approx(2.8)
    assert without.accept_ratio == 0 and without.speedup == pytest.approx(e / (0.8 + 1.3))
    assert with_accept.accept_ratio == pytest.approx(0.33)
    assert with_accept.speedup == pytest.approx(e / (0.8 + 1.3 + 0.33))
    with pytest.raises(ValueError, match="accept times for 2"):  # a probe per accepted count, or no prediction
        mean_accept_s(histogram, accept_s[:2])


def test_forward_keys_name_the_results_json_costs():
    from specquant.bench.measure import ForwardKey

    names = {ForwardKey("target", "hp"): "target_hp_step_s",
             ForwardKey("target", "hp", alone=True): "target_hp_step_s_alone",
             ForwardKey("target", "qad", "verify"): "target_qad_verify_s",
             ForwardKey("target", "w4", "verify_block"): "target_w4_verify_block_s",
             ForwardKey("lm", "w4", window=True): "lm_w4_step_s_window",
             ForwardKey("block", "hp"): "block_hp_step_s",
             ForwardKey("block", "w4", "accept", 3, window=True): "block_w4_accept3_s_window"}
    assert [key.name for key in names] == list(names.values())


def test_block_accept_probe_times_accept_on_its_own_copy(pair):
    from specquant.bench.measure import BlockAccept, BlockForward, Probe, forward_times
    from specquant.drafter_loader import load_block_draft

    target = load_model(pair["target"])
    block = load_block_draft(pair["block"]).attach_target(target)
    accept = BlockAccept(block)
    # its own context cache (forward_times sets up one per probed object), the target's modules shared
    assert accept.drafter is not block and accept.drafter.embed_tokens is block.embed_tokens
    # beside a BlockForward of the same drafter, with full attention: each probe needs context + its rows
    times = forward_times({"propose": Probe(BlockForward(block, 3)), "accept": Probe(accept, 4)}, 40, 2)
    assert set(times) == {"propose", "accept"} and all(t > 0 for t in times.values())
    accept.drafter.setup_cache(64, window=None)
    accept(torch.zeros(1, 40, dtype=torch.long), 0)
    accept(torch.zeros(1, 3, dtype=torch.long), 40)  # one timed call: the accept of 3 rows after 40 positions
    assert accept.drafter.context_len == 43


# --- prompts --------------------------------------------------------------------------------------------------


def test_packaged_prompts_hit_lengths_exactly_and_are_small():
    assert DEFAULT_PROMPTS.stat().st_size < 100_000
    tok = _tokenizer()
    cfg = BenchConfig()
    lengths = fit_lengths(cfg.lengths, 2048, cfg.max_new_tokens)
    assert lengths == cfg.lengths  # the bundled 2048-token context holds long (1024) + 128 new tokens
    prompts = load_prompts(tok, lengths, cfg.content_sets, 99, 99, cfg.content_max_tokens,
                           filler_sets=cfg.filler_sets)
    cats = {p.category for p in prompts}
    assert cats == set(cfg.lengths) | set(cfg.content_sets) | set(cfg.filler_sets)
    filler = [p for p in prompts if p.kind == "filler"]
    assert {p.category for p in filler} == {"filler"} and len(filler) == 2  # the latency prompt at 64 and 2048
    assert tok.decode(filler[0].ids).startswith("The quick brown fox jumps over the lazy dog. The quick")
    for p in prompts:
        if p.kind == "length":
            assert len(p.ids) == lengths[p.category]
        else:
            assert 0 < len(p.ids) <= cfg.content_max_tokens
    # a smaller context shrinks every length by one factor, leaving room for the new tokens
    small = fit_lengths(cfg.lengths, 512, 8)
    assert max(small.values()) + 8 <= 512 and small["short"] < small["medium"] < small["long"]


def test_a_packaged_length_category_left_out_is_not_read_as_a_content_set():
    """The demo's default runs short and long prompts only: the packaged medium prompts are left out, not taken
    for a content set."""
    prompts = load_prompts(_tokenizer(), {"short": 8, "long": 24}, ("prose", "code", "qa"), 1, 1, 16)
    assert {p.category for p in prompts} == {"short", "long", "prose", "code", "qa", "filler"}
    assert all(p.kind == "length" for p in prompts if p.category in ("short", "long"))


def test_content_prompts_keep_their_end(tmp_path):
    tok = _tokenizer()
    f = tmp_path / "p.jsonl"
    rows = [{"id": "L", "category": "short", "text": "one two three four five six seven eight nine ten"},
            {"id": "Q", "category": "qa", "text": "filler " * 50 + "Question: why?\nAnswer:"}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = load_prompts(tok, {"short": 4}, ("qa",), 1, 1, 12, f)
    q = next(p for p in prompts if p.id == "Q")
    assert len(q.ids) == 12 and tok.decode(q.ids).endswith("Question: why?\nAnswer:")
    assert next(p for p in prompts if p.id == "L").ids == tok.encode(rows[0]["text"], add_special_tokens=False)[:4]


@pytest.mark.parametrize("content, message", [
    ('{"id": "a", "category": "short", "text": "x"}\nnot json\n', ":2 is not valid JSON"),
    ('{"id": "a", "category": "short"}\n', 'needs a non-empty string "text"'),
    ('{"id": "a", "category": "short", "text": "x"}\n{"id": "a", "category": "long", "text": "y"}\n', "repeats"),
])
def test_bad_prompt_files_name_the_line(tmp_path, content, message):
    f = tmp_path / "p.jsonl"
    f.write_text(content)
    with pytest.raises(SpecquantError, match=message):
        read_jsonl(f)


def test_too_short_length_prompt_is_an_error(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"id": "tiny", "category": "long", "text": "too short"}) + "\n")
    with pytest.raises(SpecquantError, match="'tiny' has .* tokens, fewer than the 1024"):
        load_prompts(_tokenizer(), {"long": 1024}, (), 1, 1, 64, f)


# --- the report -----------------------------------------------------------------------------------------------


def test_bench_cli_writes_every_file_and_json_last(bench_run):
    lines, results, out = bench_run
    for name in FILES:
        assert (out / name).stat().st_size > 0, name
    assert (out / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    last = json.loads(lines[-1])
    assert last["benchmark"] == "bench" and {r["id"] for r in last["rows"]} == {r["id"] for r in results["rows"]}
    by_id = {r["id"]: r for r in results["rows"]}
    assert by_id["q"]["name"] == "W4 + QAD target" and by_id["q"]["status"] == "ok"
    assert all(by_id[i]["target"] == "qad" for i in "cde")  # the draft rows run against the QAD target
    assert results["environment"]["torch"] == torch.__version__
    assert "| (a) baseline: target |" in (out / "report.md").read_text()


def test_report_agrees_with_its_raw_numbers(bench_run):
    _, results, _ = bench_run
    ids = [r["id"] for r in results["rows"]]
    assert ids == [r.id for r in rows_for(with_qad=True)] + ["v", "hf"]
    for r in results["rows"]:
        assert r["status"] == "ok" or r["reason"], r["id"]
    base = results["rows"][0]["categories"]
    for r in results["rows"]:
        if r["status"] != "ok":
            continue
        for cat, e in r["categories"].items():
            # recomputed from the raw samples: median over runs per prompt, mean over prompts, ratio to (a)
            per_prompt = [statistics.median(s["latency_s"] for s in ss) for ss in e["samples"].values()]
            assert e["latency_s"] == pytest.approx(sum(per_prompt) / len(per_prompt), rel=1e-12)
            assert e["speedup"] == pytest.approx(base[cat]["latency_s"] / e["latency_s"], rel=1e-12)
            assert all(n == results["config"]["max_new_tokens"] for n in e["new_tokens"])  # EOS ignored
        assert r["speedup_avg"] == pytest.approx(statistics.mean(e["speedup"] for e in r["categories"].values()))
        for name, acc in {**r.get("acceptance", {}), "all": r.get("acceptance_all"), **r.get("filler", {})}.items():
            if acc is None:
                continue
            # the suffix drafter drafts only where the committed text's end repeats: the random test target's 8 new
            # tokens may never repeat, even after the filler prompt
            if acc["num_drafts"] == 0 and r["drafter"] == "suffix":
                assert acc["mean_acceptance_length"] == 0.0 and sum(acc["histogram"]) == 0
                continue
            assert acc["num_drafts"] > 0, (r["id"], name)
            assert acc["mean_acceptance_length"] == pytest.approx(1 + acc["num_accepted_tokens"] / acc["num_drafts"])
            assert 1.0 <= acc["mean_acceptance_length"] <= r["draft_len"] + 1  # the suffix row's own k: 20
            assert sum(acc["histogram"]) == acc["num_drafts"]
            assert sum(a * n for a, n in enumerate(acc["histogram"])) == acc["num_accepted_tokens"]
    spec = [r for r in results["rows"] if r["id"] in "cde"]
    assert all(set(r["acceptance"]) == {"prose", "code", "qa"} for r in spec)
    # the filler prompt is its own set, kept out of the content sets' merged acceptance
    suffix = next(r for r in results["rows"] if r["id"] == "s")
    assert all(set(r["filler"]) == {"filler"} for r in spec + [suffix])
    for r in spec + [suffix]:
        merged = sum(a["num_drafts"] for a in r["acceptance"].values())
        assert r["acceptance_all"]["num_drafts"] == merged
    # the noisy-copy draft is neither always right nor always wrong
    assert any(1.0 < r["acceptance_all"]["mean_acceptance_length"] < 5.0 for r in spec)


def test_pruned_target_row_is_lossy_with_its_kl_and_never_compared(bench_run, pair):
    _, results, out = bench_run
    v = next(r for r in results["rows"] if r["id"] == "v")
    assert v["status"] == "ok" and v["target"] == "pruned"
    assert all("same_tokens_as" not in e for e in v["categories"].values())  # no greedy-identity claim
    q = v["lossy"]
    assert q["baseline"] == str(pair["target"]) and q["lost_mass"] > 0 and q["rows"]
    report = (out / "report.md").read_text()
    assert "## Lossy rows" in report and f"lost mass {q['lost_mass']:.4f}" in report


def test_bench_refuses_a_pruned_target_as_the_w4_or_a_foreign_pruned_target(pair, tmp_path):
    from specquant.bench.prepare import check_inputs, check_pruned_target

    with pytest.raises(SpecquantError, match="pruned vocabulary .*--pruned-target"):
        check_inputs(pair["pruned"], pair["draft"])
    paths = check_inputs(pair["target"], pair["draft"])
    assert check_pruned_target(paths, pair["pruned"]) == pair["pruned"]
    with pytest.raises(SpecquantError, match="no pruned_vocab map"):
        check_pruned_target(paths, pair["qtarget"])


def test_demo_quick_quantizes_benches_and_reuses_its_cache(pair, hybrid_pair, tmp_path):
    from specquant.bench.demo import HYBRID_DIR, NOT_RUN, run_demo

    logged = []
    tiny_quant = {"calib_samples": 2, "seq_len": 32, "awq": {"grid": 2, "clip": False}}
    block_quant = {"method": "gptq", "bits": 4, "group_size": 128, "calib_samples": 2, "seq_len": 32}
    results = run_demo(str(tmp_path / "demo"), "quick", target=str(pair["target"]), draft=str(pair["draft"]),
                       log=logged.append, hf_compare=False, quant_overrides=tiny_quant,
                       block_draft=str(pair["block"]), block_draft_quant=block_quant, block_draft_len=3,
                       hybrid=hybrid_pair, hybrid_overrides={"lengths": {"short": 8, "medium": 16, "long": 24},
                                                             "content_max_tokens": 24},
                       **SMALL_CFG)
    for name in FILES:
        assert (tmp_path / "demo" / name).exists()
    assert all(any(name in line and "not run by the demo" in line and "specquant distill draft" in line
                   for line in logged) for name in NOT_RUN)
    # the block drafter rows, against the QAD target like the LM rows, with the same metrics
    rows = {r["id"]: r for r in results["rows"]}
    for rid in ("f", "g", "h"):
        r = rows[rid]
        assert r["status"] == "ok" and r["drafter"] == "block" and r["target"] == "qad" and r["draft_len"] == 3
        for e in r["categories"].values():
            assert e["same_tokens_as"] == {"row": "q", "match": True}  # greedy: the QAD target's own tokens
            assert e["predicted"]["draft_forwards_per_step"] == 1 and e["acceptance"]["num_drafts"] > 0
        # k = block_size - 1 = 7, cut to what is left of the 8 new tokens: more positions than the timed k = 3
        assert 3 < len(r["acceptance_whole_block"]["acceptance_rate_per_pos"]) <= 7
        assert r["acceptance_all"]["mean_acceptance_length"] >= 1
    assert rows["h"]["draft_window"] == 16 and rows["f"]["draft_window"] is None
    # the prediction counts the block drafter's accept (weighted by the row's own histogram) and rescales by the
    # baseline's step timed alone (row (a) decodes with nothing between its steps)
    for rid, drafter, window in (("f", "hp", ""), ("g", "w4", ""), ("h", "w4", "_window")):
        for cat, e in rows[rid]["categories"].items():
            p, c, hist = e["predicted"], results["costs"][cat], e["acceptance"]["histogram"]
            accept = [c[f"block_{drafter}_accept{n}_s{window}"] for n in range(1, 5)]
            assert p["accept_ratio"] > 0
            assert p["accept_ratio"] == pytest.approx(
                sum(n * t for n, t in zip(hist, accept)) / sum(hist) / c["target_qad_step_s"], rel=1e-9)
            assert p["speedup"] == pytest.approx(
                p["speedup_vs_own_target"] * c["target_hp_step_s_alone"] / c["target_qad_step_s"], rel=1e-9)
    for cat, e in rows["q"]["categories"].items():
        c = results["costs"][cat]
        assert e["predicted"]["speedup"] == pytest.approx(c["target_hp_step_s_alone"] / c["target_qad_step_s_alone"])
    assert results["quantized"]["quantized_block_draft"]["produced"]
    report = (tmp_path / "demo" / "report.md").read_text()
    assert "### Which drafter wins" in report and "### Block drafter, whole block verified" in report
    # the levers' rows: lossless against the QAD target, no prediction; the hybrid's steps split by source
    for rid in ("s", "u", "p"):
        assert rows[rid]["status"] == "ok" and rows[rid]["target"] == "qad"
        for e in rows[rid]["categories"].values():
            assert e["same_tokens_as"] == {"row": "q", "match": True} and "predicted" not in e
    for run, acc in (("content", rows["u"]["acceptance_all"]), ("filler", rows["u"]["filler"]["filler"])):
        sources = rows["u"]["by_source"][run]
        assert set(sources) == {"suffix", "model", "none"}  # none: undrafted steps (the model gate), no tokens
        drafted = (sources["suffix"], sources["model"])
        assert sum(m["num_drafts"] for m in drafted) == acc["num_drafts"]
        assert sum(m["num_accepted_tokens"] for m in sources.values()) == acc["num_accepted_tokens"]
        assert sources["none"]["num_draft_tokens"] == sources["none"]["num_accepted_tokens"] == 0
    assert rows["p"]["acceptance_all"]["num_drafts"] > 0
    assert "### Hybrid drafter: which drafter drafted" in report and "### Filler prompt (filler)" in report
    gate = results["quality_gate"]  # the kl gate: W4 target against its fp32 source, quick preset's 4 x 128 tokens
    assert gate["kl"]["tokens"] == 4 * 128 and gate["kl"]["kl"] > 0 and len(gate["gates"]) == 3
    assert any(line == f"quality gate: {'PASS' if gate['passed'] else 'FAIL'}" for line in logged)
    assert results["quantized"]["quantized_target"]["produced"] and results["quantized"]["quantized_target"][
        "method"] == "awq"
    assert results["quantized"]["quantized_draft"]["method"] == "gptq"
    hf = next(r for r in results["rows"] if r["id"] == "hf")
    assert hf["status"] == "skipped" and "disabled" in hf["reason"]
    cache = tmp_path / "demo" / "cache"
    draft_quant = BenchConfig(quant_overrides=tiny_quant).quant_overrides_for("draft")
    assert draft_quant["ignore"] == ["embed_tokens"]  # the draft's lm_head is quantized too
    written = json.loads((cache / "draft" / "config.json").read_text())["quantization_config"]["specquant"]
    assert written["ignore"] == ["embed_tokens"]
    _, info = quantized_checkpoint(pair["draft"], "draft", "gptq", draft_quant, cache)
    assert not info["produced"]  # same source, same QuantConfig: reused
    _, info = quantized_checkpoint(pair["draft"], "draft", "gptq", {**draft_quant, "calib_samples": 3}, cache)
    assert info["produced"]  # another QuantConfig: quantized again
    assert json.loads((cache / "draft" / "config.json").read_text())["quantization_config"]["specquant"][
        "calib_samples"] == 3
    # the hybrid section: its own bench in out/hybrid, rows (a), (b), (q), the block and the MTP rows against the QAD
    # target, lossless, with the same metrics; one report with a section and a verdict per architecture
    hyb = {r["id"]: r for r in results["hybrid"]["rows"]}
    assert "m" not in rows and "n" not in rows  # tiny-target's pair has no MTP layer
    for rid in ("a", "b", "q", "f", "g", "h", "m", "n"):
        assert hyb[rid]["status"] == "ok", (rid, hyb[rid].get("reason"))
        for e in hyb[rid]["categories"].values():
            if rid not in "abq":
                assert e["same_tokens_as"] == {"row": "q", "match": True}, rid
            if rid in "mn":
                assert e["predicted"]["draft_forwards_per_step"] == hyb[rid]["draft_len"]
                assert e["acceptance"]["num_drafts"] > 0
        if rid in "mn":
            assert hyb[rid]["drafter"] == "mtp" and hyb[rid]["target"] == "qad"
            assert len(hyb[rid]["acceptance_all"]["acceptance_rate_per_pos"]) == hyb[rid]["draft_len"]
    assert results["hybrid"]["quantized"]["quantized_mtp_draft"]["produced"]
    assert "UNTRAINED" in results["hybrid"]["quantized"]["mtp_draft"]["method"]
    for name in FILES:
        assert (tmp_path / "demo" / HYBRID_DIR / name).exists()
    assert report.startswith("# specquant demo") and "## Qwen3 pair" in report and "## Qwen3.5 hybrid pair" in report
    verdicts = report.split("## Which drafter wins, per architecture", 1)[1].split("\n## ", 1)[0]
    assert [line.split(":")[0] for line in verdicts.strip().splitlines()] == ["- Qwen3 pair", "- Qwen3.5 hybrid pair"]
    assert all("wins in this run" in line for line in verdicts.strip().splitlines())
    assert report.count("### Which drafter wins") == 2 and f"`{HYBRID_DIR}/speedup.png`" in report
    # wall time: the demo's parts in its report, each bench's stages and rows in its results.json and section
    assert "## Wall time" in report and "| Qwen3 pair: bench |" in report and "| hybrid pair: bench |" in report
    assert report.count("### Wall time") == 2
    for res in (results, results["hybrid"]):
        stages = [e["stage"] for e in res["stages"]]
        for first in ("W4 target: AWQ", "W4 draft: GPTQ", "regen:", "QAD:", "W4 block drafter: GPTQ",
                      "latency runs:", "acceptance, content:", "forward costs:"):
            assert any(name.startswith(first) for name in stages), (first, stages)
        for r in res["rows"]:
            if r["status"] != "ok":
                continue
            timed = sum(s["latency_s"] for e in r["categories"].values() for ss in e["samples"].values() for s in ss)
            # its timed runs, plus its warm-up and acceptance passes; results.json rounds seconds to 0.01 s
            assert r["seconds"] + 0.005 >= timed > 0


def test_rows_keep_what_they_need_and_carry_their_interval(pair, tmp_path):
    """BenchConfig.rows: only the rows asked for, plus row (a) and the target-only row each kept draft row is
    checked against; every speedup carries its 95% interval (bench/spread.py), recomputed here from results.json's
    runs; a row id that does not exist, or whose inputs were not given, is refused before anything is written."""
    from specquant.bench.ablation import run_bench
    from specquant.bench.spread import intervals

    cfg = dataclasses.replace(BenchConfig(), out=str(tmp_path / "out"), rows=["e", "s"], qad=False,
                              hf_compare=False, lengths={"short": 8, "medium": 16, "long": 24}, content_max_tokens=24,
                              **{**SMALL_CFG, "runs": 2, "warmup": 0, "curve_fractions": (1 / 2,)})
    logged = []
    results, _ = run_bench(cfg, pair["target"], pair["draft"], pair["qtarget"], pair["qdraft"], log=logged.append)
    data = results.to_json()
    assert [r["id"] for r in data["rows"]] == ["a", "b", "e", "s"]  # (b): (e) and (s) draft against the W4 target
    runs = {r["id"]: {cat: {pid: [s["latency_s"] for s in ss] for pid, ss in e["samples"].items()}
                      for cat, e in r["categories"].items()} for r in data["rows"]}
    for r in data["rows"]:
        want = intervals(runs["a"], runs[r["id"]])
        assert r["speedup_avg_interval"] == pytest.approx(list(want["avg"]))
        assert r["speedup_avg_interval"][0] <= r["speedup_avg"] <= r["speedup_avg_interval"][1]
        for cat, e in r["categories"].items():
            assert e["speedup_interval"] == pytest.approx(list(want[cat]))
    # a line per row once the latency runs end, with its tok/s and interval, before the acceptance passes
    row_lines = [i for i, line in enumerate(logged) if re.match(r" +\([abes]\) .*: [\d.]+ tok/s, [\d.]+x row \(a\) "
                                                               r"\(95% interval [\d.]+-[\d.]+\)$", line)]
    assert len(row_lines) == 4
    assert row_lines[-1] < next(i for i, line in enumerate(logged) if "acceptance, content" in line)
    report = (tmp_path / "out" / "report.md").read_text()
    assert "Rows by average speedup" in report and "| (e) W4 target + W4 draft + window |" in report
    assert "| (d)" not in report  # not asked for
    for rows, message in ((["e", "zz"], "rows zz: no such row"), (["g"], "rows g need inputs")):
        bad = dataclasses.replace(cfg, out=str(tmp_path / "bad"), rows=rows)
        with pytest.raises(SpecquantError, match=message):
            run_bench(bad, pair["target"], pair["draft"], pair["qtarget"], pair["qdraft"], log=logged.append)
        assert not (tmp_path / "bad").exists()


def test_demo_default_rows_tell_each_story_on_both_pairs():
    """The default preset's rows exist on both pairs and are the stories the demo tells: W4 target, W4 + QAD, the
    W4 LM drafter without and with its window, the W4 block drafter, the suffix drafter, the W4 MTP layer."""
    from specquant.bench.ablation import rows_for, select_rows
    from specquant.bench.demo import demo_config, hybrid_config

    for cfg, mtp in ((demo_config("x"), False), (hybrid_config("x", "default", {}), True)):
        kept = {r.id: r for r in select_rows(rows_for(True, True, mtp), cfg.rows)}
        assert set(kept) == {"a", "b", "q", "d", "e", "g", "s"} | ({"n"} if mtp else set())
        assert (kept["d"].draft, kept["d"].window, kept["e"].window) == ("w4", False, True)
        assert kept["g"].drafter == "block" and kept["g"].draft == "w4" and kept["s"].drafter == "suffix"
        assert all(r.target == "qad" for r in kept.values() if r.draft is not None)
        assert not cfg.hf_compare and not cfg.whole_block_pass and cfg.runs >= 3  # 3 runs: a bootstrap to read
    assert kept["n"].drafter == "mtp" and kept["n"].draft == "w4"
    assert demo_config("x", "full").rows == []  # --full: every row


def test_interleaved_rounds_limit_one_runner_and_time_each():
    """rounds={name: n}: that runner runs in the first n rounds only (warm-up included); seconds adds up each
    runner's calls."""
    from specquant.engines.timing import interleaved, sample_from
    from specquant.bench.prompts import Prompt

    calls = {"a": 0, "hf": 0}

    def runner(name):
        def run(ids):
            calls[name] += 1
            return sample_from(0.01, 0.001, 2, [1, 2])
        return run

    prompts = [Prompt(f"p{i}", "short", "length", [1, 2, 3]) for i in range(3)]
    seconds = {}
    out = interleaved({"a": runner("a"), "hf": runner("hf")}, prompts, 4, 1, torch.device("cpu"), seconds=seconds,
                      rounds={"hf": 2})
    assert calls == {"a": 4 * 3, "hf": 2 * 3}
    assert all(len(ss) == 3 for ss in out["a"].values()) and all(len(ss) == 1 for ss in out["hf"].values())
    assert set(seconds) == {"a", "hf"} and seconds["a"] > 0 and seconds["hf"] > 0
    # warmup_prompts=1: the warm-up round runs the first prompt only; the timed rounds run every prompt
    calls.update(a=0, hf=0)
    out = interleaved({"a": runner("a"), "hf": runner("hf")}, prompts, 3, 1, torch.device("cpu"), warmup_prompts=1,
                      rounds={"hf": 2})
    assert calls == {"a": 1 + 2 * 3, "hf": 1 + 3}
    assert all(len(ss) == 2 for ss in out["a"].values()) and all(len(ss) == 1 for ss in out["hf"].values())


def test_demo_shares_the_w4_draft_only_when_checkpoint_and_settings_match(pair, tmp_path):
    from specquant.bench.demo import _shared_draft, demo_config, hybrid_config

    cfg, hcfg = demo_config(str(tmp_path), "quick"), hybrid_config(str(tmp_path), "quick", {})
    w4 = {"path": str(tmp_path / "cache" / "draft"), "method": "gptq", "produced": True}
    d = str(pair["draft"])
    assert _shared_draft(cfg, hcfg, d, d, w4, print) == tmp_path / "cache" / "draft"
    assert _shared_draft(cfg, hcfg, d, str(pair["target"]), w4, print) is None  # another checkpoint
    other = dataclasses.replace(hcfg, quant_overrides={**hcfg.quant_overrides, "calib_samples": 3})
    assert _shared_draft(cfg, other, d, d, w4, print) is None  # other GPTQ settings
    assert _shared_draft(cfg, dataclasses.replace(hcfg, draft_method="rtn"), d, d, w4, print) is None


# --- bad input ------------------------------------------------------------------------------------------------


@pytest.fixture
def bad_cases(pair, tmp_path):
    not_a_dir = tmp_path / "file.txt"
    not_a_dir.write_text("x")
    t, d = str(pair["target"]), str(pair["draft"])
    return {
        "missing target": (["--target", str(tmp_path / "nope"), "--draft", d], "does not exist"),
        "missing prompts": (["--target", t, "--draft", d, "--prompts", str(tmp_path / "p.jsonl")], "prompts file"),
        "zero runs": (["--target", t, "--draft", d, "--runs", "0"], "runs 0 must be at least 1"),
        "zero window": (["--target", t, "--draft", d, "--draft-window", "0"], "draft window 0"),
        "out is a file": (["--target", t, "--draft", d, "--out", str(not_a_dir)], "is a file"),
        "unquantized W4 input": (["--target", t, "--draft", d, "--quantized-target", t], "no quantization_config"),
        "quantized baseline": (["--target", str(pair["qtarget"]), "--draft", d], "already quantized"),
    }


@pytest.mark.parametrize("case", ["missing target", "missing prompts", "zero runs", "zero window", "out is a file",
                                  "unquantized W4 input", "quantized baseline"])
def test_bad_input_is_one_error_line_and_writes_nothing(bad_cases, tmp_path, capsys, case):
    argv, message = bad_cases[case]
    out = tmp_path / "out"
    if "--out" not in argv:
        argv = [*argv, "--out", str(out)]
    rc = main(["bench", *argv])
    _, err = capsys.readouterr()
    assert rc == 2
    assert err.startswith("specquant bench: error:") and message in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_unknown_option_exits_2_and_writes_nothing(pair, tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        main(["bench", "--target", str(pair["target"]), "--draft", str(pair["draft"]), "--out", str(out),
              "--no-such-flag"])
    assert e.value.code == 2 and "--no-such-flag" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["demo", "--out", str(out), "--fast"])
    assert e.value.code == 2 and not out.exists()


def test_cli_flag_defaults_come_from_bench_config():
    from specquant.cli import build_parser
    from specquant.util.flags import config_from_args

    parser, _ = build_parser()
    args = parser.parse_args(["bench", "--target", "x", "--draft", "y"])
    assert config_from_args(BenchConfig, args) == BenchConfig()
    # every flag that maps to a config field (nested SpecConfig / SamplingConfig ones included) has its default
    defaults = BenchConfig()
    flags = {k: v for k, v in vars(args).items() if k.split(".")[0] in {f.name for f in dataclasses.fields(BenchConfig)}}
    assert {"spec.draft_len", "spec.draft_window", "sampling.temperature", "runs"} <= set(flags)
    for key, value in flags.items():
        obj = defaults
        for part in key.split("."):
            obj = getattr(obj, part)
        assert obj == value, key
    args = parser.parse_args(["bench", "--target", "x", "--draft", "y", "--draft-len", "5", "--temperature", "0.5"])
    cfg = config_from_args(BenchConfig, args)
    assert (cfg.spec.draft_len, cfg.spec.draft_window, cfg.sampling.temperature) == (5, 128, 0.5)
    # the drafter kinds' flags (BenchConfig.drafters, flat: dests "suffix.x" as generate's) and results.json's keys
    args = parser.parse_args(["bench", "--target", "x", "--draft", "y", "--suffix-min-match", "5",
                              "--hybrid-min-match", "7"])
    cfg = config_from_args(BenchConfig, args).validate()
    assert (cfg.drafters["suffix"].min_match, cfg.drafters["hybrid"].min_match) == (5, 7)
    data = cfg.to_json()
    keys = list(data)
    assert keys[keys.index("block_draft_quant") + 1:keys.index("pruned_head_fraction")] == ["suffix", "hybrid"]
    assert "drafters" not in data and data["suffix"]["min_match"] == 5 and data["hybrid"]["min_match"] == 7


def test_cost_probes_cover_every_cost_model():
    """Each DrafterKind.cost the registry allows has the probes that time it (a new kind of a known cost is a
    file and a row; the bench predicts its rows)."""
    from specquant.bench.ablation import COST_PROBES, predicted
    from specquant.spec_decode.drafter import COST_MODELS
    from specquant.spec_decode.drafters import KINDS

    assert set(COST_PROBES) == set(COST_MODELS)
    assert [k for k in KINDS if predicted(k)] == ["block", "mtp", "lm"]


def test_w4_activations_flag_reaches_the_config_and_bad_values_are_refused():
    from specquant.cli import build_parser
    from specquant.util.flags import config_from_args

    parser, _ = build_parser()
    args = parser.parse_args(["bench", "--target", "x", "--draft", "y", "--w4-activations", "int8"])
    assert config_from_args(BenchConfig, args).validate().runtime.w4_activations == "int8"
    with pytest.raises(SpecquantError, match="w4-activations 'int4' is not supported; use one of auto, float, int8"):
        BenchConfig(runtime=RuntimeConfig(w4_activations="int4")).validate()


def test_the_response_cache_runs_in_its_own_replay_row_only():
    """--suffix-cache-tokens > 0 adds row (r), the suffix drafter with the cache, labelled replay; rows (s) and
    (u) keep drafting without it (a bench repeats its prompts)."""
    import dataclasses

    from specquant.bench.ablation import SUFFIX_REPLAY_ROW, SUFFIX_ROW, _engine
    from specquant.loader import load_model
    from specquant.spec_decode.runtime import RuntimeConfig

    assert "r" not in [r.id for r in rows_for(with_qad=False)]
    table = rows_for(with_qad=True, with_replay=True)
    replay = [r for r in table if r.id == "r"]
    assert len(replay) == 1 and replay[0].replay and "replay" in replay[0].name and replay[0].target == "qad"
    cfg = BenchConfig()
    cfg = dataclasses.replace(cfg, drafters=dataclasses.replace(cfg.drafters, suffix=dataclasses.replace(
        cfg.drafters["suffix"], cache_tokens=4096)))
    models = {("target", "w4"): load_model("tiny-target")}
    for row, cached in ((SUFFIX_ROW, False), (SUFFIX_REPLAY_ROW, True)):
        drafter = _engine(cfg, RuntimeConfig(), row, models, None, None).drafter
        assert (drafter.cache is not None) == cached and drafter.config.max_draft_len == cfg.drafters["suffix"].max_draft_len
    assert cfg.drafters["suffix"].cache_tokens == 4096  # row (s) went without it on a copy
