"""Build and load the native kernel variants: probe the CPU, compile one .cpp with the system C++ compiler, load it
with ctypes. The one place that knows about compilers, CPU flags and the build cache; the families (w4_bf16.py,
w4a8.py) only list their variants.

Why ctypes and not a torch C++ extension: the kernels need no torch headers, so each compiles in about a second
with plain `g++` (a torch extension takes a minute and pins the build to one torch ABI), and CI builds them in
scripts/setup.sh with no network. The shared libraries link `libgomp.so.1`, the OpenMP runtime torch's CPU wheel
already loaded, so every kernel shares one thread pool.

A build lands in `${SPECQUANT_CACHE:-~/.cache/specquant}/kernels/<family>-<variant>-<hash>.so` (the hash covers the
source, every header in this folder and the flags), written to a temporary name and renamed, so concurrent
processes never load a half-written file. `SPECQUANT_NATIVE=off` (or `0`) disables every native kernel, so the
fallback backends can be run, and tested, on any machine. `SPECQUANT_NATIVE=avx2,portable` (variant names) keeps
only those variants, so a CPU with AVX-512 can run, test and time what an AVX2-only or an ARM machine would get.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from specquant.errors import SpecquantError
from specquant.util.cpu import cpu_flags
from specquant.util.files import cache_root

KERNEL_DIR = Path(__file__).resolve().parent
# no instruction-set flag here: those belong to each variant (a portable variant is built with none).
# -ffp-contract=off: every fused multiply-add is written out, so variants that promise the same bits get them
BASE_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off")
SWITCH = "SPECQUANT_NATIVE"
# the instruction-set flags every library's variants build with, and the /proc/cpuinfo flags they need; a variant
# adds its extension (avx512_bf16, avx512_vnni) to the AVX-512 base
AVX512_FLAGS, AVX512_CPU = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma"), ("avx512f", "avx512bw", "avx512vl")
AVX2_FLAGS, AVX2_CPU = ("-mavx2", "-mfma"), ("avx2", "fma")
OFF, ON = ("off", "0"), ("", "on", "1", "auto")


@dataclass(frozen=True)
class Variant:
    """One build of a family's kernel for one instruction set."""

    name: str  # e.g. "avx512_bf16"; unique within its family
    source: str  # file name in this folder
    flags: tuple[str, ...]  # compiler flags beyond BASE_FLAGS (the instruction set)
    cpu_flags: tuple[str, ...]  # /proc/cpuinfo flags it needs (none: portable)


def _switch() -> str:
    return os.environ.get(SWITCH, "").strip().lower()


def disabled() -> bool:
    """True when SPECQUANT_NATIVE says off."""
    return _switch() in OFF


def restriction(known: set[str]) -> frozenset[str] | None:
    """The variant names SPECQUANT_NATIVE keeps (None: every variant; empty: off). `known` is every family's
    variant names, so that a typo is one line naming the value and the choices instead of a silent fallback."""
    value = _switch()
    if value in OFF:
        return frozenset()
    if value in ON:
        return None
    names = frozenset(n.strip() for n in value.split(",") if n.strip())
    if not names or names - known:
        raise SpecquantError(f"{SWITCH}={value!r} is not understood; use off (or 0) to disable the native kernels, "
                             f"a comma-separated list of variants to keep ({', '.join(sorted(known))}), or unset it")
    return names


def cache_dir() -> Path:
    return cache_root() / "kernels"


def cpu_problem(needed: tuple[str, ...]) -> str | None:
    """Why this CPU cannot run a variant needing these flags, or None when it can."""
    if not needed:
        return None
    have = cpu_flags()
    if have is None:
        return "cannot read /proc/cpuinfo (not Linux?)"
    missing = [f for f in needed if f not in have]
    return f"CPU lacks {', '.join(missing)}" if missing else None


def build(family: str, variant: Variant) -> tuple[Path | None, str]:
    """Compile a variant unless its cached build exists; returns (path or None, reason)."""
    if disabled():
        return None, f"disabled by {SWITCH}={os.environ[SWITCH]}"
    problem = cpu_problem(variant.cpu_flags)
    if problem:
        return None, problem
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        return None, "no C++ compiler (g++/c++) on PATH; install g++ or set CXX"
    source, flags = KERNEL_DIR / variant.source, [*BASE_FLAGS, *variant.flags]
    headers = b"".join(h.read_bytes() for h in sorted(KERNEL_DIR.glob("*.h")))
    digest = hashlib.sha256(source.read_bytes() + headers + " ".join(flags).encode()).hexdigest()[:16]
    out = cache_dir() / f"{family}-{variant.name}-{digest}.so"
    if out.is_file():
        return out, "cached"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        # compiled to a temporary name beside the target, then renamed (atomic): the compiler writes the file itself,
        # so util.files.atomic_write (which takes bytes) does not apply
        fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
        os.close(fd)
        try:
            res = subprocess.run([cxx, *flags, str(source), "-o", tmp], capture_output=True, text=True,
                                 timeout=300)
            if res.returncode:
                first = (res.stderr.strip().splitlines() or ["?"])[0]
                return None, f"{Path(cxx).name} failed: {first[:200]}"
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"build failed: {e}"
    return out, "built"


def load(path: Path, functions: dict) -> tuple[ctypes.CDLL | None, str]:
    """dlopen a built variant and declare its C functions (all return int: 0 = ok); (library or None, reason)."""
    try:
        lib = ctypes.CDLL(str(path))
        for name, argtypes in functions.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = ctypes.c_int, argtypes
    except (OSError, AttributeError) as e:
        return None, f"cannot load {path} ({e})"
    return lib, "loaded"
