"""The --out policy (util/files.py, tests/test_cli_out.py) in the benchmark scripts that write their own folder.

Each script is run in-process on a user's non-empty folder: it must exit 2 with one stderr line, leave the folder
byte for byte, and stop BEFORE its first expensive step (replaced by a function that fails the test if reached);
with --overwrite it goes on to that step. gpu.py also writes into a folder it created, as a rerun does.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import load_benchmark

from specquant.util.files import MARKER

# script -> (argv before the output folder, how the folder is passed, the first expensive step, the folder written)
SCRIPTS = {
    "gpu.py": (["--device", "cpu", "--tiny"], "--out", "environment", lambda d: d),
    "llama_cpp_quality.py": ([], "--out", "write_gguf", lambda d: d),
    "qad.py": ([], "--run-dir", "load_model", lambda d: d),
    "shapes_gguf.py": ([], None, "make", lambda d: d / "shapes"),  # positional DIR; writes DIR/shapes
}


class Reached(Exception):
    pass


def _run(script: str, root: Path, monkeypatch, extra=()) -> tuple[object, int | None]:
    """Run the script's main on `root` with its first expensive step replaced; returns (module, exit code or
    None when that step was reached)."""
    before, flag, step, _ = SCRIPTS[script]
    mod = load_benchmark(script)

    def reached(*args, **kwargs):
        raise Reached(step)

    monkeypatch.setattr(mod, step, reached)
    argv = [*before, *((flag, str(root)) if flag else (str(root),)), *extra]
    monkeypatch.setattr(sys, "argv", [script, *argv])
    try:
        return mod, mod.main(argv) if script in ("gpu.py", "llama_cpp_quality.py") else mod.main()
    except Reached:
        return mod, None


@pytest.mark.parametrize("script", SCRIPTS)
def test_user_folder_is_refused_before_work_and_kept(script, tmp_path, capsys, monkeypatch):
    folder = SCRIPTS[script][3](tmp_path / "mine")
    folder.mkdir(parents=True)
    (folder / "notes.txt").write_text("my notes")
    _, rc = _run(script, tmp_path / "mine", monkeypatch)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error:") and "--overwrite" in err, err
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]
    assert (folder / "notes.txt").read_text() == "my notes"
    # --overwrite: the same folder is taken (marked as specquant's) and the work starts
    _, rc = _run(script, tmp_path / "mine", monkeypatch, ["--overwrite"])
    assert rc is None and (folder / MARKER).exists() and (folder / "notes.txt").read_text() == "my notes"


@pytest.mark.parametrize("script", SCRIPTS)
def test_out_under_a_file_is_one_line(script, tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("x")
    _, rc = _run(script, tmp_path / "file" / "out", monkeypatch)
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "is a file" in err, err
    assert (tmp_path / "file").read_text() == "x"


def test_gpu_reruns_into_its_own_folder_and_saves_as_it_goes(tmp_path, monkeypatch):
    """A rerun into the folder gpu.py created needs no flag; gpu.json (atomic_write) holds the first section's
    numbers once it is measured, and no temporary file is left beside it."""
    import json

    out = tmp_path / "gpu"
    mod = load_benchmark("gpu.py")
    mod.claim_out_dir(out)  # as a first run leaves it
    (out / "gpu.json").write_text("{}")
    monkeypatch.setattr(mod, "copy_bandwidth", lambda *a: 1.5)
    monkeypatch.setattr(mod, "build", lambda *a, **k: (_ for _ in ()).throw(Reached("build")))
    args = mod.argparse.Namespace(device="cpu", out=str(out), overwrite=False, tiny=True, compile=False)
    with pytest.raises(Reached):
        mod.run(args)
    assert json.loads((out / "gpu.json").read_text())["copy_gbps"] == 1.5
    assert sorted(p.name for p in out.iterdir()) == sorted([MARKER, "gpu.json"])
