"""Where compiled code lives across processes: `${SPECQUANT_CACHE:-~/.cache/specquant}/compile`, for torch.compile's
inductor caches (decode.compiled) and AOTInductor packages (decode.aot). Its own module so that neither of those
imports the other for it."""

from __future__ import annotations

import os
from pathlib import Path

from specquant.util.files import cache_root


def compile_cache_dir() -> Path:
    """Where compiled graphs are kept across processes."""
    return cache_root() / "compile"


def use_compile_cache() -> None:
    """Point inductor's on-disk caches at compile_cache_dir(), unless the user chose a directory. Inductor reads
    TORCHINDUCTOR_CACHE_DIR on every lookup; it writes its /tmp default there on first use, which is replaced."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(compile_cache_dir())
