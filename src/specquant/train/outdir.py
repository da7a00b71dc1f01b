"""A distill run's --out directory: the checks made before any work, and what --overwrite may remove.

Its own module (not train/cli.py) because the runs in qad.py and draft.py apply the same policy: they import it
from here, below the CLI, so the CLI stays the top of train/.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from specquant.errors import SpecquantError
from specquant.train.trainer import checkpoints
from specquant.util.files import MARKER, check_out_dir

OUR_OUTPUTS = ("checkpoints", "model", "log.jsonl", "lean")  # what a distill run writes into --out (and --overwrite clears)


def prepare_out(out: Path, resume: bool, overwrite: bool) -> bool:
    """Check --out before any work; returns True when a run there should resume. Changes nothing on disk."""
    check_out_dir(out, overwrite=True)  # not a file, writable; distill's stricter rule on existing contents follows
    if not out.exists() or not any(out.iterdir()):
        return False
    if resume and checkpoints(out):
        return True
    if overwrite:
        return False
    what = "holds no checkpoint to resume" if resume else "is not empty"
    raise SpecquantError(f"--out {str(out)!r} {what}; pass --overwrite to start over there, "
                         f"{'' if resume else '--resume to continue its run, '}or choose a new directory")


def check_stages_parent(out: Path, stages: list[str], overwrite: bool):
    """A two-stage run writes only out/<stage>/: refuse an `out` that holds anything else and that specquant did
    not create (a user's folder), unless overwrite; nothing there is removed either way."""
    check_out_dir(out, overwrite=True)  # not a file, writable
    if out.is_dir() and not overwrite and not (out / MARKER).exists():
        other = sorted(p.name for p in out.iterdir() if p.name not in stages)
        if other:
            raise SpecquantError(f"--out {str(out)!r} holds {other[0]!r}, which is not this run's; choose a new "
                                 "directory, or pass --overwrite to write stage1/ and stage2/ there anyway")


def clear_our_outputs(out: Path):
    """--overwrite: remove only what a distill run writes; other files in --out are left alone."""
    for name in OUR_OUTPUTS:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
