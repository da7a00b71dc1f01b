"""`specquant gate`: thresholds and the pass/fail decision, exit codes, bad input as one-line errors (before any slow
step), the output folder policy, and the kl gate end to end on the bundled target and its W4 twin."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

import pytest

from specquant.cli import main
from specquant.errors import SpecquantError
from specquant.gate.cli import add_parser
from specquant.gate.config import BackendConfig, GateConfig
from specquant.util.flags import config_from_args
from specquant.util.files import MARKER
from specquant.gate.thresholds import decide_kl, decide_score, exit_code, load_thresholds


def test_flag_defaults_come_from_gate_config():
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="verb"))
    args = parser.parse_args(["gate", "--model", "x"])
    assert config_from_args(GateConfig, args, tasks=GateConfig().tasks) == GateConfig()
    assert config_from_args(BackendConfig, args) == BackendConfig()
    assert args.tasks == ",".join(GateConfig().tasks)
    args = parser.parse_args(["gate", "--model", "x", "--limit", "3", "--gpqa-max-gen-toks", "4096", "--draft-len", "5"])
    cfg, backend = config_from_args(GateConfig, args), config_from_args(BackendConfig, args)
    assert (cfg.limit, cfg.gpqa_max_gen_toks, backend.draft_len) == (3, 4096, 5)


def test_default_thresholds_are_the_seed_ratios():
    rules = GateConfig().default_thresholds
    assert rules["mmlu_pro"] == {"ratio": 0.9} and rules["ifeval"] == {"ratio": 0.95}
    assert rules["gpqa_diamond"] == {"ratio": 0.9}
    # the seed's BF16 scores then give the seed's gates
    assert decide_score("mmlu_pro", rules["mmlu_pro"], 0.621, 0.690).passed
    assert not decide_score("mmlu_pro", rules["mmlu_pro"], 0.620, 0.690).passed
    assert decide_score("ifeval", rules["ifeval"], 0.8142, 0.857).passed
    assert not decide_score("ifeval", rules["ifeval"], 0.813, 0.857).passed


def test_absolute_and_ratio_thresholds_take_the_stricter():
    both = {"min": 0.5, "ratio": 0.9}
    assert decide_score("gpqa_diamond", both, 0.55, 0.5).passed  # bound max(0.5, 0.45) = 0.5
    assert not decide_score("gpqa_diamond", both, 0.55, 0.7).passed  # bound max(0.5, 0.63) = 0.63
    assert not decide_score("gpqa_diamond", {"min": 0.6}, 0.59, None).passed
    r = decide_score("ifeval", {"min": 0.3, "metric": "prompt_level_loose_acc,none"}, 0.4, None)
    assert r.passed and r.metric == "prompt_level_loose_acc,none"


def test_kl_bounds_and_exit_codes():
    stats = {"kl": 0.02, "ppl_ratio": 1.03, "ppl_ref": 200.0, "top1_agree": 0.9}
    rows = decide_kl({"max_kl": 0.05, "max_ppl_ratio": 1.05, "min_top1": 0.85}, stats)
    assert [r.passed for r in rows] == [True, True, True] and exit_code(rows) == 0
    rows = decide_kl({"max_kl": 0.01, "max_ppl_ratio": 1.05, "min_top1": 0.95}, stats)
    assert [r.passed for r in rows] == [False, True, False] and exit_code(rows) == 1
    assert exit_code([]) == 1  # no gate evaluated is not a pass


def test_thresholds_file_overrides_and_validation(tmp_path):
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"ifeval": {"min": 0.8}}))
    rules = load_thresholds(str(f), GateConfig().default_thresholds)
    assert rules["ifeval"] == {"min": 0.8} and rules["mmlu_pro"] == {"ratio": 0.9}
    for bad, msg in [({"hellaswag": {"min": 1}}, "unknown gate 'hellaswag'"), ({"ifeval": {"max": 1}}, "takes a"),
                     ({"kl": {"min": 1}}, "takes a"), ({"ifeval": {"min": "high"}}, "must be a finite number"),
                     ({"ifeval": {"min": float("nan")}}, "got nan"), ({"kl": {"max_kl": float("inf")}}, "got inf"),
                     ({"ifeval": {"ratio": True}}, "got True")]:
        f.write_text(json.dumps(bad))  # json.dumps writes NaN / Infinity, which json.loads reads back
        with pytest.raises(SpecquantError, match=msg):
            load_thresholds(str(f), GateConfig().default_thresholds)
    f.write_text("{not json")
    with pytest.raises(SpecquantError, match="not valid JSON"):
        load_thresholds(str(f), {})


def _one_line_error(capsys, argv, needle):
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("specquant gate: error:") and needle in err[0], err


def test_bad_input_is_one_line_error_before_anything_runs(tmp_path, capsys):
    out = tmp_path / "out"
    base = ["gate", "--model", "tiny-target", "--out", str(out)]
    _one_line_error(capsys, base + ["--tasks", "mmlu_pro,bogus"], "unknown gate 'bogus'")
    _one_line_error(capsys, base + ["--tasks", "ifeval"], "threshold {'ratio': 0.95} is a ratio: pass --baseline")
    _one_line_error(capsys, base + ["--tasks", "kl"], "the kl gate compares the model with its baseline")
    _one_line_error(capsys, ["gate", "--model", "/nope", "--out", str(out)], "does not exist")
    absolute = tmp_path / "abs.json"
    absolute.write_text(json.dumps({"ifeval": {"min": 0.5}, "gpqa_diamond": {"min": 0.5}}))
    base += ["--thresholds", str(absolute)]
    _one_line_error(capsys, base + ["--tasks", "ifeval", "--data-dir", str(tmp_path / "missing")],
                    "data directory")
    _one_line_error(capsys, base + ["--tasks", "gpqa_diamond", "--data-dir", str(tmp_path)],
                    f"needs {tmp_path / 'gpqa_diamond'}/")
    wrong = tmp_path / "gpqa_diamond" / "train.jsonl"
    wrong.parent.mkdir()
    wrong.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    _one_line_error(capsys, base + ["--tasks", "gpqa_diamond", "--data-dir", str(tmp_path)],
                    "lacks column(s) Question, Correct Answer")
    wrong.write_text("{broken json\n")
    _one_line_error(capsys, base + ["--tasks", "gpqa_diamond", "--data-dir", str(tmp_path)], "cannot read")
    _one_line_error(capsys, ["gate", "--server", "127.0.0.1:8000", "--model-name", "m", "--tasks", "ifeval"],
                    "not an http(s) URL")
    _one_line_error(capsys, ["gate", "--server", "http://127.0.0.1:9", "--tasks", "ifeval"], "--model-name")
    assert not out.exists()  # nothing written


def test_lm_eval_gates_without_lm_eval_installed_name_the_setup_step(tmp_path, capsys, monkeypatch):
    """The main job's setup leaves lm-eval out: an lm-eval gate says how to install it; the kl gate needs nothing."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a))
    out = tmp_path / "out"
    _one_line_error(capsys, ["gate", "--model", "tiny-target", "--baseline", "tiny-target", "--tasks", "kl,ifeval",
                             "--out", str(out)], "runs lm-eval, which is not installed")
    assert not out.exists()


def test_out_refuses_a_foreign_non_empty_folder(tmp_path, capsys):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("user data")
    argv = ["gate", "--model", "tiny-target", "--baseline", "tiny-target", "--tasks", "kl", "--out", str(foreign)]
    _one_line_error(capsys, argv, "did not create")
    assert (foreign / "keep.txt").read_text() == "user data" and not (foreign / MARKER).exists()
    (tmp_path / "file").write_text("")
    _one_line_error(capsys, argv[:-1] + [str(tmp_path / "file")], "is a file")


def test_kl_gate_end_to_end(tmp_path, capsys):
    """The target against itself: KL 0, every bound passes (exit 0). The bundled draft (same tokenizer, a different,
    smaller model) against the target: far apart, the default bounds fail (exit 1). Outputs: results.json,
    gates.md, the marker; a rerun into the same --out is allowed. (The W4 target's numbers: docs/GATES.md.)"""
    out = tmp_path / "gate"
    small = ["--kl-samples", "4", "--kl-seq-len", "64", "--json"]
    assert main(["gate", "--model", "tiny-target", "--baseline", "tiny-target", "--tasks", "kl", "--out", str(out),
                 *small]) == 0
    same = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert same["kl"]["kl"] == pytest.approx(0.0, abs=1e-6) and same["kl"]["top1_agree"] == 1.0
    assert json.loads((out / "results.json").read_text())["passed"] is True
    assert main(["gate", "--model", "tiny-draft", "--baseline", "tiny-target", "--tasks", "kl", "--out", str(out),
                 *small]) == 1
    far = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert far["kl"]["kl"] > 0.1 and not far["passed"]
    assert [g["metric"] for g in far["gates"]] == ["kl", "ppl_ratio", "top1_agree"]
    assert "FAIL" in (out / "gates.md").read_text() and (out / MARKER).exists()  # rerun into its own --out


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs root and util-linux unshare")
def test_gate_runs_without_network(tmp_path):
    """In a network namespace with no interfaces up, with no HF_*_OFFLINE set by the caller: lm-eval, datasets and
    IFEval's NLTK data all come from local files (specquant sets the offline switches itself)."""
    thresholds = tmp_path / "thr.json"
    thresholds.write_text(json.dumps({"ifeval": {"min": 0.0}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    cmd = ["unshare", "-n", sys.executable, "-m", "specquant.cli", "gate", "--model", "tiny-target", "--tasks",
           "ifeval", "--limit", "1", "--ifeval-max-gen-toks", "8", "--thresholds", str(thresholds), "--out",
           str(tmp_path / "out"), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["gates"][0]["gate"] == "ifeval" and summary["passed"]
