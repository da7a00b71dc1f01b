"""Serving engines we run and measure: ours, llama.cpp and vLLM, one file each plus a row in ENGINES.

An engine's file knows how to check it is installed (`check`: raises with the command that installs it), how to
serve a target and its drafter over an OpenAI-compatible HTTP API on loopback (`server`: the command line, run by
engines/process.py), and, where it can, how to run a prompt set greedily on rows of (target, drafter, k) and report
each row's tokens, per-prompt latencies and acceptance counters in the same `EngineRun` (`run_rows`; None where
the engine's bench has rows of its own: llama.cpp's, bench/llama_cpp.py). `specquant bench --engine`,
`specquant latency --engine` and the tests read this table.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from specquant.errors import SpecquantError


@dataclass(frozen=True)
class Engine:
    name: str
    module: str  # its file: check(), server(), run_rows (or None)
    about: str


ENGINES = (
    Engine("specquant", "specquant.engines.ours", "our engine (`specquant serve`, the ablation rows)"),
    Engine("llama.cpp", "specquant.engines.llama_cpp", "llama.cpp's tools on our GGUF export (llama-server)"),
    Engine("vllm", "specquant.engines.vllm", "vLLM's CPU build on our --for vllm export (.venv-vllm)"),
)
NAMES = tuple(e.name for e in ENGINES)


def engine(name: str) -> ModuleType:
    """The engine's module; raises naming the engines there are."""
    for e in ENGINES:
        if e.name == name:
            return importlib.import_module(e.module)
    raise SpecquantError(f"engine {name!r}: no such engine; the engines are {', '.join(NAMES)}")


@dataclass(frozen=True)
class RowPair:
    """One row an engine runs: a target checkpoint and its drafter (None: alone; a draft checkpoint; "mtp": the
    target's own MTP layer; "ngram" / "suffix": a model-free drafter) drafting k tokens per step."""

    id: str
    name: str
    target: Path
    draft: Path | str | None = None
    k: int = 3


@dataclass
class EngineRun:
    """What an engine did on one row: per prompt its greedy tokens and timed latencies (seconds, end to end), its
    acceptance counters in vLLM's names (over every round; None without a drafter), the dtype it ran in, the
    drafter it actually used, and why it did not run (skipped: the engine cannot on this machine; error: it
    failed)."""

    tokens: list[list[int]] = field(default_factory=list)
    latency_s: list[list[float]] = field(default_factory=list)
    counters: dict | None = None
    dtype: str = ""
    drafter: str = ""
    k: int = 0
    skipped: str | None = None
    error: str | None = None

    @property
    def ran(self) -> bool:
        return self.skipped is None and self.error is None


@dataclass(frozen=True)
class Server:
    """A server command line (engines/process.py runs it): argv, extra environment, what it serves."""

    argv: list[str]
    env: dict = field(default_factory=dict)
    label: str = ""
