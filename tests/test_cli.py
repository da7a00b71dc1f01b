"""The `specquant` command line: the models listing, generate's JSON contract, errors as one stderr line with exit
code 2, and the installed console script.

The JSON contract runs on a temporary random checkpoint that carries the bundled tokenizer (so it does not wait for
tiny-target to finish training) and again on tiny-target itself once it is built.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
from conftest import needs_bundled, save_tiny_checkpoint

from specquant.cli import main
from specquant.decode.compiled import Stepper
from specquant.spec_decode.engine import generate
from specquant.model.checkpoint import BUNDLED_DIR, load_tokenizer
from specquant.loader import load_model

NEW_TOKENS = 8
GENERATE_JSON = ["--json", "--draft", "none", "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos"]


@pytest.fixture(scope="module")
def random_checkpoint(tmp_path_factory) -> Path:
    """A tiny random Qwen3 with the bundled tokenizer's 8192-token vocabulary, saved with its tokenizer files."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("cli") / "random")


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_models_json_lists_every_bundled(capsys):
    rc, out, err = run_cli(capsys, "models", "--json")
    assert rc == 0 and err == ""
    assert len(out.splitlines()) == 1
    rows = json.loads(out)["models"]
    assert [r["name"] for r in rows] == ["tiny-target", "tiny-draft", "tiny-block-draft", "tiny-hybrid",
                                         "tiny-hybrid-block-draft"]
    for r in rows:
        assert Path(r["path"]) == BUNDLED_DIR / r["name"]
        assert r["available"] == (Path(r["path"]) / "config.json").exists()
        if r["available"]:
            assert r["parameters"] > 0 and r["layers"] > 0


def test_generate_missing_target_is_one_error_line(capsys, tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    rc, out, err = run_cli(capsys, "generate", "--target", str(missing), "--draft", "none")
    assert rc == 2 and out == ""
    assert len(err.splitlines()) == 1
    assert err.startswith("specquant generate: error:") and str(missing) in err


def test_generate_negative_temperature_is_one_error_line(capsys):
    rc, out, err = run_cli(capsys, "generate", "--temperature", "-1")
    assert rc == 2 and out == ""
    assert len(err.splitlines()) == 1
    assert "temperature -1.0 is negative" in err


def check_generate_json(out: str) -> dict:
    lines = out.splitlines()
    assert len(lines) == 1, out
    obj = json.loads(lines[0])
    assert set(obj) == {"text", "token_ids", "stats"}
    assert {"new_tokens", "prefill_s", "decode_s", "tokens_per_s"} <= set(obj["stats"])
    assert obj["stats"]["new_tokens"] == NEW_TOKENS == len(obj["token_ids"])
    assert isinstance(obj["text"], str) and all(isinstance(t, int) for t in obj["token_ids"])
    assert obj["stats"]["tokens_per_s"] > 0
    return obj


def test_generate_json_random_checkpoint(capsys, random_checkpoint):
    rc, out, err = run_cli(capsys, "generate", "--target", str(random_checkpoint), *GENERATE_JSON)
    assert rc == 0, err
    obj = check_generate_json(out)
    # the CLI prints what the engine generates (greedy by default) and decodes it with the checkpoint's tokenizer
    tokenizer = load_tokenizer(random_checkpoint)
    prompt = torch.tensor([tokenizer.encode("The meaning of the word", add_special_tokens=False)])
    expected = generate(load_model(random_checkpoint), prompt, NEW_TOKENS, stop_on_eos=False).token_ids[0]
    assert obj["token_ids"] == expected
    assert obj["text"] == tokenizer.decode(expected, skip_special_tokens=True)


def test_generate_compile_flag_reaches_the_stepper(capsys, random_checkpoint, monkeypatch):
    """--compile hands the decode step to torch.compile (recorded here, run eagerly: tests/test_compiled.py checks
    compiled against eager) and prints the same tokens."""
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: compiled.append(model) or model)
    monkeypatch.setenv("SPECQUANT_CACHE", str(random_checkpoint.parent / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    outs = []
    for flag in ([], ["--compile"]):
        rc, out, err = run_cli(capsys, "generate", "--target", str(random_checkpoint), *GENERATE_JSON, *flag)
        assert rc == 0, err
        outs.append(json.loads(out)["token_ids"])
    assert len(compiled) == 1 and outs[0] == outs[1]
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(random_checkpoint.parent / "cache" / "compile")


def test_generate_aot_flag_reaches_the_stepper(capsys, random_checkpoint, monkeypatch):
    """--aot picks the packaged-step mode (default 'cached', from AotConfig; recorded here and run eagerly:
    tests/test_aot.py checks packages against eager); --compile replaces it, and with --aot build is refused."""
    import specquant.spec_decode.engine as engine

    modes = []

    def stepper(model, compile=False, compile_shapes=(1,), aot="off", aot_shapes=((1, True),)):
        modes.append(aot)
        return Stepper(model, compile, compile_shapes)

    monkeypatch.setattr(engine, "Stepper", stepper)
    monkeypatch.setattr(torch, "compile", lambda model, **kw: model)
    monkeypatch.setenv("SPECQUANT_CACHE", str(random_checkpoint.parent / "cache"))
    for flag in ([], ["--aot", "build"], ["--aot", "off"], ["--compile"]):
        rc, out, err = run_cli(capsys, "generate", "--target", str(random_checkpoint), *GENERATE_JSON, *flag)
        assert rc == 0, err
    assert modes == ["cached", "build", "off", "off"]
    rc, out, err = run_cli(capsys, "generate", "--target", str(random_checkpoint), *GENERATE_JSON, "--compile",
                           "--aot", "build")
    assert rc == 2 and out == "" and len(err.splitlines()) == 1 and "pick one" in err


@needs_bundled("tiny-target")
def test_generate_json_tiny_target(capsys):
    rc, out, err = run_cli(capsys, "generate", "--target", "tiny-target", *GENERATE_JSON)
    assert rc == 0, err
    check_generate_json(out)


def test_console_script_is_registered():
    (ep,) = [ep for ep in entry_points(group="console_scripts") if ep.name == "specquant"]
    assert ep.value == "specquant.cli:main"


def test_console_script_generate(random_checkpoint):
    """The installed entry point end to end, in a fresh process."""
    script = Path(sys.executable).parent / "specquant"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(script), "generate", "--target", str(random_checkpoint), *GENERATE_JSON],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    check_generate_json(proc.stdout)


def test_generate_suffix_draft_is_greedy_identical_to_none(capsys):
    """`--draft suffix` (model-free, no checkpoint) drafts from the prompt's repeats; greedy verification keeps
    exactly the target's tokens, so its output equals target-only decoding's, and it did draft."""
    prompt = ["--target", "tiny-target", "--prompt", "one two three one two three one two three one two",
              "--json", "--max-new-tokens", "24", "--ignore-eos"]
    outs = {}
    for draft in ("none", "suffix"):
        rc, out, err = run_cli(capsys, "generate", *prompt, "--draft", draft)
        assert rc == 0, err
        outs[draft] = json.loads(out)
    assert outs["suffix"]["token_ids"] == outs["none"]["token_ids"]
    assert outs["suffix"]["stats"]["new_tokens"] == 24
    assert outs["suffix"]["stats"].get("num_accepted_tokens", 0) > 0
