"""The CPU's feature flags, read once: the native kernels' variant choice (kernels/build.py) and the llama.cpp
build's options (export/llama_cpp_build.py) both read them here."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags from /proc/cpuinfo, or None where it cannot be read (not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    # x86 says "flags", ARM "Features"
    line = next((ln for ln in text.splitlines() if ln.split(":")[0].strip() in ("flags", "Features")), "")
    return frozenset(line.split(":", 1)[1].split()) if ":" in line else frozenset()
