"""Writing outputs safely: whole files or whole directories appear at their final path only once complete, and no
directory that specquant did not create is written into without permission.

Every `--out` writer goes through here: a file is written to a temporary name in the same directory and renamed
(atomic on POSIX), a checkpoint directory is built beside its destination and renamed into place, and an output
directory is claimed with `claim_out_dir` first.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from specquant.errors import SpecquantError

MARKER = ".specquant-out"  # written into every output directory specquant creates


def atomic_write(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write data to path via a temp file in the same directory and a rename: readers see the old file or the
    whole new one, never half of it; a failure leaves no temp file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def atomic_dir(out: str | os.PathLike, overwrite: bool = False):
    """Context: yields a temp dir beside `out`; on success it replaces `out`, on error it is removed. An existing
    non-empty `out` that specquant did not create is refused (check_out_dir) unless overwrite=True."""
    return _AtomicDir(Path(out), overwrite)


class _AtomicDir:
    def __init__(self, out: Path, overwrite: bool):
        self.out, self.overwrite = out, overwrite

    def __enter__(self) -> Path:
        check_out_dir(self.out, self.overwrite)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.tmp-", dir=self.out.parent))
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return False
        (self.tmp / MARKER).touch()
        # mkdtemp and some writers create owner-only files; outputs are ordinary readable data
        os.chmod(self.tmp, 0o755)
        for f in self.tmp.rglob("*"):
            os.chmod(f, 0o755 if f.is_dir() else 0o644)
        if self.out.exists():
            old = self.out.with_name(f".{self.out.name}.old-{os.getpid()}")
            self.out.rename(old)
            self.tmp.rename(self.out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            self.tmp.rename(self.out)
        return False


def check_out_dir(out: str | os.PathLike, overwrite: bool = False, flag: str = "--out") -> Path:
    """Check, without writing anything, that `out` may be used as an output directory (see claim_out_dir)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise SpecquantError(f"{flag} {str(out)!r} is a file; pass a directory (it is created if missing)")
    if out.is_dir() and not overwrite and not (out / MARKER).exists() and any(out.iterdir()):
        raise SpecquantError(f"{flag} {str(out)!r} is a non-empty directory specquant did not create; pass a new or "
                             "empty directory (or allow overwriting it)")
    return out


def claim_out_dir(out: str | os.PathLike, overwrite: bool = False, flag: str = "--out") -> Path:
    """Create `out` (or adopt it when empty) and mark it as specquant's; refuse a non-empty directory that
    specquant did not create unless overwrite=True. A directory it created earlier is reused (a rerun)."""
    out = check_out_dir(out, overwrite, flag)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).touch()
    return out
