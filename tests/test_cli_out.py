"""Bad input and data safety for every command that writes (issue 15, item 7), through `specquant.cli.main`.

For each command with --out: a user's non-empty folder (or, for regen, a file it did not write) survives byte for
byte and is refused with one stderr line and exit code 2, BEFORE the command's first expensive step (that step is
replaced by a function that fails the test if it is reached); an --out under a regular file or on /proc (which
refuse root too, unlike permission bits) is refused the same way and creates nothing; --overwrite is what lets a
command replace a folder it did not create. Every float flag of every command refuses NaN and infinities on one line.
"""

from __future__ import annotations

import argparse
import errno
import json
from pathlib import Path

import pytest
from conftest import save_tiny_checkpoint

from specquant.cli import build_parser, main
from specquant.errors import SpecquantError
from specquant.util.files import MARKER, atomic_dir, atomic_write, check_out_dir, check_out_file, claim_out_dir

# command -> (argv without --out, the first expensive step "module:attribute" that must not run when --out is bad)
COMMANDS = {
    "quantize": (["quantize", "--model", "tiny-target", "--method", "rtn"], "specquant.model.checkpoint:load_dense"),
    "distill target": (["distill", "target", "--teacher", "tiny-target", "--student", "tiny-target"],
                       "specquant.train.qad:load_pair"),
    "distill draft": (["distill", "draft", "--kind", "block", "--target", "tiny-target"],
                      "specquant.loader:load_model"),
    "distill draft 2 stages": (["distill", "draft", "--kind", "block", "--target", "tiny-target",
                                "--stage1-target", "tiny-target"], "specquant.loader:load_model"),
    "export vllm": (["export", "--target", "tiny-target", "--for", "vllm"], "specquant.export.vllm:read_hf_config"),
    "export llama.cpp": (["export", "--target", "tiny-target", "--for", "llama.cpp"],
                         "specquant.export.llama_cpp:source_from_checkpoint"),
    "gate": (["gate", "--model", "tiny-target", "--baseline", "tiny-target", "--tasks", "kl"],
             "specquant.gate.run:kl_gate"),
    "bench": (["bench", "--target", "tiny-target", "--draft", "tiny-draft"],
              "specquant.bench.prepare:prepare_quantized"),
    "demo": (["demo", "--quick"], "specquant.bench.prepare:prepare_quantized"),
}


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under root (the root's own entries included) -> its bytes (None for a folder)."""
    return {str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes()) for p in sorted(root.rglob("*"))}


@pytest.fixture
def forbid(monkeypatch):
    """forbid("module:attr"): make that function fail the test if anything calls it."""
    import importlib

    def install(target: str):
        module, attr = target.split(":")

        def reached(*args, **kwargs):
            raise AssertionError(f"{target} ran although --out was bad: the check must come before the work")

        monkeypatch.setattr(importlib.import_module(module), attr, reached)

    return install


def run(capsys, argv) -> tuple[int, str]:
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, err


def one_error_line(err: str, *needles: str):
    assert len(err.strip().splitlines()) == 1, err
    assert "error:" in err and "Traceback" not in err
    for n in needles:
        assert n in err, (n, err)


def user_folder(root: Path) -> Path:
    """A folder as a user leaves it: files, a subfolder, a dotfile."""
    folder = root / "mine"
    (folder / "sub").mkdir(parents=True)
    (folder / "notes.txt").write_text("my notes\n")
    (folder / "sub" / "data.bin").write_bytes(bytes(range(256)) * 3)
    (folder / ".hidden").write_text("x")
    return folder


# --- every command ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", list(COMMANDS))
def test_user_folder_is_refused_before_work_and_kept(command, tmp_path, capsys, forbid):
    argv, expensive = COMMANDS[command]
    forbid(expensive)
    folder = user_folder(tmp_path)
    before, around = snapshot(folder), sorted(p.name for p in tmp_path.iterdir())
    rc, err = run(capsys, [*argv, "--out", str(folder)])
    assert rc == 2
    one_error_line(err, str(folder), "--overwrite")
    assert snapshot(folder) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == around  # no temp folder left beside it


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("where", ["under a file", "/proc"])
def test_impossible_out_is_one_line_and_creates_nothing(command, where, tmp_path, capsys, forbid):
    argv, expensive = COMMANDS[command]
    forbid(expensive)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder\n")
    out = blocker / "out" if where == "under a file" else Path("/proc/specquant-test/out")
    rc, err = run(capsys, [*argv, "--out", str(out)])
    assert rc == 2
    one_error_line(err, str(out))
    assert blocker.read_text() == "not a folder\n" and not Path("/proc/specquant-test").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["a-file"]


def test_regen_refuses_a_file_it_did_not_write_before_loading(tmp_path, capsys, forbid):
    forbid("specquant.loader:load_model")
    forbid("specquant.model.checkpoint:load_tokenizer")
    for content in (b"my notes\nsecond line without newline", b"{\"id\": 1}\n", b"partial"):
        path = tmp_path / "data.jsonl"
        path.write_bytes(content)
        rc, err = run(capsys, ["regen", "--model", "tiny-target", "--out", str(path)])
        assert rc == 2
        one_error_line(err, str(path), "--overwrite")
        assert path.read_bytes() == content  # the torn-line repair never touches a file that is not regen output
    for out in (tmp_path, tmp_path / "data.jsonl" / "x", Path("/proc/specquant-test/x.jsonl")):
        rc, err = run(capsys, ["regen", "--model", "tiny-target", "--out", str(out)])
        assert rc == 2
        one_error_line(err, str(out))


# --- NaN and infinities -------------------------------------------------------------------------------------------


def float_flags() -> list[tuple[list[str], str]]:
    """(subcommand path, option) for every float-typed option of every command, found by walking the parser."""
    parser, _ = build_parser()
    found = []

    def walk(p, path):
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, [*path, name])
            elif action.option_strings and getattr(action.type, "__name__", "") == "float":
                found.append((path, action.option_strings[0]))

    walk(parser, [])
    return found


def test_every_float_flag_is_found():
    flags = {(" ".join(path), flag) for path, flag in float_flags()}
    assert {("quantize", "--gptq-damp"), ("generate", "--temperature"), ("distill target", "--lr"),
            ("distill draft", "--gamma"), ("bench", "--top-p"), ("regen", "--temperature")} <= flags
    assert len(flags) >= 25


@pytest.mark.parametrize("path,flag", float_flags(), ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_nan_and_infinite_floats_are_refused_on_one_line(path, flag, capsys):
    for text in ("nan", "inf", "-inf", "NaN", "1e999"):
        rc, err = run(capsys, [*path, f"{flag}={text}"])  # `--x -inf` would read -inf as an option
        assert rc == 2
        one_error_line(err, flag, repr(text), "not finite", "pass a finite number")
    rc, err = run(capsys, [*path, flag, "abc"])
    assert rc == 2
    one_error_line(err, flag, "'abc' is not a number")


# --- the policy itself (util/files.py) ------------------------------------------------------------------------------


def test_check_out_dir_policy(tmp_path):
    folder = user_folder(tmp_path)
    with pytest.raises(SpecquantError, match="did not create"):
        check_out_dir(folder)
    assert check_out_dir(folder, overwrite=True) == folder
    (tmp_path / "empty").mkdir()
    check_out_dir(tmp_path / "empty")  # empty: nothing to lose
    ours = claim_out_dir(tmp_path / "ours")
    (ours / "report.md").write_text("an earlier run")
    check_out_dir(ours)  # specquant's own folder: a rerun may replace it
    assert (ours / MARKER).exists()
    check_out_dir(tmp_path / "new" / "deeper")
    assert not (tmp_path / "new").exists()  # checking creates nothing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "mine", "ours"]
    with pytest.raises(SpecquantError, match="which is a file"):
        check_out_dir(folder / "notes.txt" / "x")
    with pytest.raises(SpecquantError, match="is a file"):
        check_out_dir(folder / "notes.txt")
    with pytest.raises(SpecquantError, match="cannot be written"):
        check_out_dir("/proc/specquant-test")
    with pytest.raises(SpecquantError, match="exists and is not"):
        check_out_file(folder / "notes.txt")
    assert check_out_file(folder / "notes.txt", ours=lambda p: True) == folder / "notes.txt"
    with pytest.raises(SpecquantError, match="is a directory"):
        check_out_file(folder / "sub")


def test_atomic_dir_leaves_nothing_on_error_and_replaces_only_with_overwrite(tmp_path):
    folder = user_folder(tmp_path)
    before = snapshot(folder)
    with pytest.raises(SpecquantError, match="did not create"):
        with atomic_dir(folder) as tmp:
            raise AssertionError("never entered")
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with atomic_dir(out) as tmp:
            (tmp / "half.bin").write_bytes(b"12")
            raise RuntimeError("the writer failed half way")
    with pytest.raises(SpecquantError, match="No space left"):  # an OSError while writing is one clean error
        with atomic_dir(out) as tmp:
            (tmp / "half.bin").write_bytes(b"12")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert not out.exists() and snapshot(folder) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]
    with atomic_dir(folder, overwrite=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(snapshot(folder)) == [MARKER, "new.txt"]
    with pytest.raises(SpecquantError, match="cannot write"):
        atomic_write(tmp_path / "mine" / "new.txt" / "x", "data")


# --- the real commands on tiny models -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A 2-layer random Qwen3 with the bundled tokenizer (quantizes and generates in well under a second)."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("out") / "tiny")


def test_quantize_overwrite_replaces_a_user_folder_and_reruns_need_no_flag(tiny_model, tmp_path, capsys):
    folder = user_folder(tmp_path)
    argv = ["quantize", "--model", str(tiny_model), "--method", "rtn", "--group-size", "32", "--json",
            "--report-samples", "0"]
    assert run(capsys, [*argv, "--out", str(folder)])[0] == 2
    rc, err = run(capsys, [*argv, "--out", str(folder), "--overwrite"])
    assert rc == 0, err
    assert {"config.json", "model.safetensors", MARKER} <= set(snapshot(folder)) and "notes.txt" not in snapshot(folder)
    assert run(capsys, [*argv, "--out", str(folder)])[0] == 0  # now specquant's own: a rerun replaces it
    rc, err = run(capsys, [*argv, "--out", str(tiny_model.parent), "--overwrite"])  # would delete the input
    assert rc == 2 and "input checkpoint" in err and (tiny_model / "model.safetensors").exists()


def test_quantize_disk_full_while_saving_leaves_nothing(tiny_model, tmp_path, capsys, monkeypatch):
    import specquant.model.checkpoint as checkpoint

    def full(*args, **kwargs):
        Path(args[1]).write_bytes(b"half a file")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_file", full)
    out = tmp_path / "q"
    rc, err = run(capsys, ["quantize", "--model", str(tiny_model), "--method", "rtn", "--group-size", "32",
                           "--report-samples", "0", "--json", "--out", str(out)])
    assert rc == 2
    one_error_line(err, str(out), "No space left")
    assert list(tmp_path.iterdir()) == []


def test_regen_overwrite_starts_a_foreign_file_over(tiny_model, tmp_path, capsys):
    path = tmp_path / "data.jsonl"
    path.write_text("my notes\n")
    argv = ["regen", "--model", str(tiny_model), "--out", str(path), "--limit", "2", "--max-new-tokens", "4",
            "--json"]
    assert run(capsys, argv)[0] == 2 and path.read_text() == "my notes\n"
    rc, err = run(capsys, [*argv, "--overwrite"])
    assert rc == 0, err
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 2 and all(len(r["completion_ids"]) == 4 for r in rows)
    assert main(argv) == 0 and capsys.readouterr()  # its own file now: a rerun resumes (nothing left to write)
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows
