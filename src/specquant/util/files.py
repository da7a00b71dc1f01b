"""Writing outputs safely: whole files or whole directories appear at their final path only once complete, and no
directory that specquant did not create is written into without permission.

Every `--out` writer goes through here: a file is written to a temporary name in the same directory and renamed
(atomic on POSIX), a checkpoint directory is built beside its destination and renamed into place, and an output
directory is claimed with `claim_out_dir` first.

The policy, one for every command (check_out_dir / check_out_file, called before any expensive work): an output
that exists and that specquant did not create (a directory without MARKER, a file its command does not recognise)
is never written into, replaced or deleted unless the user passes --overwrite; an --out that cannot be written
(under a regular file, on /proc, read-only) is refused with one line. Commands may be stricter (export never
replaces a directory it did not write; distill --overwrite removes only its own outputs).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from specquant.errors import SpecquantError

MARKER = ".specquant-out"  # written into every output directory specquant creates


def cache_root() -> Path:
    """specquant's own cache (built kernels, compiled graphs, llama.cpp, NLTK data): `${SPECQUANT_CACHE:-~/.cache/specquant}`;
    an empty SPECQUANT_CACHE means unset."""
    return Path(os.environ.get("SPECQUANT_CACHE") or Path.home() / ".cache" / "specquant")


def atomic_write(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write data to path via a temp file in the same directory and a rename: readers see the old file or the
    whole new one, never half of it; a failure (a full disk, say) leaves no temp file and is one SpecquantError."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except OSError as e:
        raise SpecquantError(f"cannot write {str(path)!r}: {e.strerror or e}") from e
    finally:
        if tmp.exists():  # (not unlink(missing_ok): under a regular file that raises NotADirectoryError)
            tmp.unlink()
    return path


def atomic_dir(out: str | os.PathLike, overwrite: bool = False, flag: str = "--out"):
    """Context: yields a temp dir beside `out`; on success it replaces `out`, on error it is removed. An existing
    non-empty `out` that specquant did not create is refused (check_out_dir) unless overwrite=True; an OSError
    while writing (a full disk, say) becomes one SpecquantError naming `out`."""
    return _AtomicDir(Path(out).expanduser(), overwrite, flag)


class _AtomicDir:
    def __init__(self, out: Path, overwrite: bool, flag: str):
        self.out, self.overwrite, self.flag = out, overwrite, flag

    def __enter__(self) -> Path:
        check_out_dir(self.out, self.overwrite, self.flag)
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.tmp-", dir=self.out.parent))
        except OSError as e:
            raise SpecquantError(f"{self.flag} {str(self.out)!r} cannot be created ({e.strerror}); choose a "
                                 "writable location") from e
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            try:
                self._publish()
                return False
            except OSError as e:
                exc_type, exc = type(e), e
        shutil.rmtree(self.tmp, ignore_errors=True)
        if issubclass(exc_type, OSError):
            raise SpecquantError(f"writing {self.flag} {str(self.out)!r} failed ({exc}); nothing was written "
                                 "there") from exc
        return False

    def _publish(self):
        (self.tmp / MARKER).touch()
        # mkdtemp and some writers create owner-only files; outputs are ordinary readable data
        os.chmod(self.tmp, 0o755)
        for f in self.tmp.rglob("*"):
            os.chmod(f, 0o755 if f.is_dir() else 0o644)
        if self.out.exists():
            old = self.out.with_name(f".{self.out.name}.old-{os.getpid()}")
            self.out.rename(old)
            try:
                self.tmp.rename(self.out)
            except OSError:
                old.rename(self.out)  # put the previous output back
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            self.tmp.rename(self.out)


def check_out_dir(out: str | os.PathLike, overwrite: bool = False, flag: str = "--out") -> Path:
    """The one --out policy, checked before any work: `out` is not a file, is not a non-empty directory specquant
    did not create (unless overwrite), and can be created and written. Leaves nothing behind."""
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise SpecquantError(f"{flag} {str(out)!r} is a file; pass a directory (it is created if missing)")
    if out.is_dir() and not overwrite and not (out / MARKER).exists() and any(out.iterdir()):
        raise SpecquantError(f"{flag} {str(out)!r} is a non-empty directory specquant did not create; pass a new or "
                             "empty directory, or --overwrite to replace it")
    check_writable(out.parent, flag, shown=out)  # where a replacement is built (atomic_dir) or out is created
    if out.is_dir():
        check_writable(out, flag)  # where claim_out_dir's commands write
    return out


def check_out_file(path: str | os.PathLike, overwrite: bool = False, flag: str = "--out", ours=None,
                   what: str = "file") -> Path:
    """The --out policy for a single output file: not a directory; an existing file is used only when `ours(path)`
    says specquant wrote it (or with overwrite); its directory can be created and written."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise SpecquantError(f"{flag} {str(path)!r} is a directory; pass a {what} path")
    if path.exists() and not overwrite and (ours is None or not ours(path)):
        raise SpecquantError(f"{flag} {str(path)!r} exists and is not a {what} specquant wrote; pass a new path, or "
                             "--overwrite to replace it")
    check_writable(path.parent, flag, shown=path)
    return path


def check_writable(path: Path, flag: str = "--out", shown: Path | None = None) -> None:
    """Refuse, with one line, a `path` that cannot be created or written: under a regular file, on a read-only or
    virtual file system (/proc, /sys), or without permission. Probes the nearest existing ancestor with a temporary
    directory, because permission bits alone do not tell (root ignores them; /proc refuses even root)."""
    shown = shown or path
    ancestor = path
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise SpecquantError(f"{flag} {str(shown)!r} is inside {str(ancestor)!r}, which is a file, not a directory; "
                             "choose a path in a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".specquant-probe-", dir=ancestor))
    except OSError as e:
        raise SpecquantError(f"{flag} {str(shown)!r} cannot be written: {str(ancestor)!r} refuses new entries "
                             f"({e.strerror}); choose a writable location") from None


def claim_out_dir(out: str | os.PathLike, overwrite: bool = False, flag: str = "--out") -> Path:
    """Create `out` (or adopt it when empty) and mark it as specquant's; refuse a non-empty directory that
    specquant did not create unless overwrite=True. A directory it created earlier is reused (a rerun)."""
    out = check_out_dir(out, overwrite, flag)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / MARKER).touch()
    except OSError as e:
        raise SpecquantError(f"{flag} {str(out)!r} cannot be created ({e.strerror}); choose a writable location") \
            from None
    return out
