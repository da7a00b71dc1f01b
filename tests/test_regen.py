"""`specquant regen`: batched rows equal one-at-a-time generation; a killed run resumes to the same file."""

import json

import pytest
import torch
from _qad_models import write_teacher

from specquant.cli import main
from specquant.spec_decode.engine import generate
from specquant.loader import load_model
from specquant.model.checkpoint import load_tokenizer
from specquant.train.config import RegenConfig
from specquant.train.regen import bundled_prompts, make_batches, regen

FLAGS = ["--max-new-tokens", "6", "--batch", "3", "--limit", "7", "--json"]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return write_teacher(tmp_path_factory.mktemp("regen") / "teacher")


def _lines(path):
    return [json.loads(ln) for ln in path.read_text().splitlines()]


def test_batched_greedy_rows_equal_single_row_generation(teacher, tmp_path):
    out = tmp_path / "greedy.jsonl"
    assert main(["regen", "--model", str(teacher), "--out", str(out), "--temperature", "0", *FLAGS]) == 0
    rows = _lines(out)
    assert len(rows) == 7 and len({r["id"] for r in rows}) == 7
    model = load_model(teacher)
    for r in rows:
        single = generate(model, torch.tensor([r["prompt_ids"]]), 6).token_ids[0]
        assert r["completion_ids"] == single, r["id"]
        assert r["sampling"]["temperature"] == 0 and len(r["model_sha256"]) == 64
    # speculative generation (lossless: greedy output is the target's own) writes the same completions
    spec = tmp_path / "spec.jsonl"
    assert main(["regen", "--model", str(teacher), "--out", str(spec), "--temperature", "0", "--draft",
                 "tiny-draft", *FLAGS[:-3], "--limit", "3", "--json"]) == 0
    assert [r["completion_ids"] for r in _lines(spec)] == [r["completion_ids"] for r in rows[:3]]


def test_resume_after_a_kill_reproduces_the_uninterrupted_file(teacher, tmp_path):
    full = tmp_path / "full.jsonl"
    assert main(["regen", "--model", str(teacher), "--out", str(full), *FLAGS]) == 0
    part = tmp_path / "part.jsonl"
    lines = full.read_text().splitlines(keepends=True)
    part.write_text("".join(lines[:4]) + lines[4][:20])  # a torn last line, as a SIGKILL mid-write leaves
    assert main(["regen", "--model", str(teacher), "--out", str(part), *FLAGS]) == 0
    assert sorted(part.read_text().splitlines()) == sorted(full.read_text().splitlines())


def test_other_settings_are_refused_on_resume(teacher, tmp_path, capsys):
    out = tmp_path / "a.jsonl"
    assert main(["regen", "--model", str(teacher), "--out", str(out), *FLAGS]) == 0
    before = out.read_text()
    assert main(["regen", "--model", str(teacher), "--out", str(out), *FLAGS, "--seed", "1"]) == 2
    assert "other sampling settings" in capsys.readouterr().err and out.read_text() == before


def test_bundled_prompts_come_from_calibration_text_only():
    tok = load_tokenizer("tiny-target")
    prompts = bundled_prompts(tok, RegenConfig().prompt_tokens)
    assert len(prompts) > 500 and all(len(p["prompt_ids"]) == 32 for p in prompts)
    assert all(p["id"].startswith("calib-") for p in prompts)
    from specquant.train.qad import BUNDLED_HELDOUT

    heldout = BUNDLED_HELDOUT.read_text()
    sample = [tok.decode(p["prompt_ids"]) for p in prompts[:50]]
    assert not any(s in heldout for s in sample if len(s) > 60)
    batches = make_batches([{"id": i, "prompt_ids": [0] * (1 + i % 2)} for i in range(5)], 2)
    assert [[p["id"] for p in b] for b in batches] == [[0, 2], [4], [1, 3]]
