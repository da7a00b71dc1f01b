"""Forward calls for decoding: the eager reference, or torch.compile on the small fixed decode/verify shapes.

Compiled steps need a shape-static cache (`setup_cache(static=True)`): positions travel as a tensor, attention spans
the whole buffer under a mask, so one graph serves every position. Prompts (long, variable T) run eagerly through
the same static cache. tests/test_compiled.py checks compiled against eager.

Compiled graphs persist across processes: inductor's FX-graph cache and AOTAutograd cache (both on by default in
torch >= 2.5) are pointed at `${SPECQUANT_CACHE:-~/.cache/specquant}/compile` (unless TORCHINDUCTOR_CACHE_DIR is set),
so a second process skips inductor's code generation and C++ build. Staleness: those caches key every entry on the
torch version, the traced graph (so any change to the model code that changes the graph), input shapes, dtypes and
strides, and the inductor config; dynamo re-traces the Python code in every process, so a cached graph is only ever
looked up under the key of the code that runs now.
"""

from __future__ import annotations

import torch

from specquant.decode import aot as aot_packages  # (`aot` is the mode's name here)
from specquant.decode.compile_cache import use_compile_cache
from specquant.errors import SpecquantError
from specquant.model.decoder import Transformer

COMPILED_MAX_T = 34  # verify shapes up to k+1 with k <= 32, plus the 2-token draft catch-up


def _raise_recompile_limit(n: int = 64):
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name) and getattr(cfg, name) < n:
            setattr(cfg, name, n)


def _dense(tokens: torch.Tensor) -> torch.Tensor:
    """A compiled step's tokens: a contiguous copy. The caller's are a slice of the request's token buffer, their row
    stride that buffer's length; a graph compiled with dynamic=False guards on strides, so passed as they were, every
    new request length recompiled the step; and an AOT package was compiled for a [batch, T] tensor's own strides.
    (clone, not .contiguous(): a one-row slice counts as contiguous whatever its row stride.)"""
    return tokens.clone(memory_format=torch.contiguous_format)


class Stepper:
    """`stepper(tokens [batch, T], start, last_only) -> logits`; compiled for T in compile_shapes when enabled.

    Each token count is its own compilation (seconds from the disk cache, 15-45 s cold), so only the shapes a loop
    repeats are compiled: the one-token decode step by default; None compiles every T <= COMPILED_MAX_T. Other
    inputs (prompts) run eagerly through the same static cache.
    aot: AOTInductor packages (decode.aot) for the (T, last_only) steps in aot_shapes instead of torch.compile:
    "cached" uses them when every one is on disk for the request's cache layout and runs eagerly otherwise;
    "build" compiles the missing ones first (~25 s each on one core); "off" never.
    `step` also returns the hidden states of `hidden_layers` (None when empty), for drafters that read them."""

    def __init__(self, model: Transformer, compile: bool = False, compile_shapes: tuple[int, ...] | None = (1,),
                 aot: str = "off", aot_shapes: tuple[tuple[int, bool], ...] = ((1, True),)):
        if aot not in aot_packages.AOT_MODES:
            raise SpecquantError(f"aot mode {aot!r} is not one of {', '.join(aot_packages.AOT_MODES)}")
        if aot != "off" and compile:
            raise SpecquantError("torch.compile and AOT packages are two ways to compile the same steps; pick one")
        self.model = model
        self.compile = compile
        self.compile_shapes = None if compile_shapes is None else set(compile_shapes)
        self.compiled = None
        self.aot, self.aot_shapes = aot, tuple(aot_shapes)
        self.aot_loaded = {}  # package file name -> decode.aot.AotStep, loaded once per process
        self.aot_keys = {}  # request cache layout -> package paths, worked out once per process (decode.aot.prepare)
        self.aot_steps = {}  # (T, last_only) -> the AotStep this request uses (empty: eager)
        if compile:
            _raise_recompile_limit()
            use_compile_cache()
            self.compiled = torch.compile(model, dynamic=False)

    def setup(self, batch: int, max_seq_len: int, **kw):
        self.aot_steps = {}
        if self.aot != "off":
            self.aot_steps = aot_packages.prepare(self.model, self.aot_shapes, batch, max_seq_len, kw,
                                                  build=self.aot == "build", loaded=self.aot_loaded,
                                                  keys=self.aot_keys)
        if not self.aot_steps:  # no packages: the eager reference (or torch.compile's static cache)
            capacity = max_seq_len
            if self.compile:
                # the graphs are specialized to the cache's size: the AOT packages' buckets (powers of two from 256),
                # so a longer request recompiles only when it outgrows its bucket, not whenever it is the longest yet
                capacity = aot_packages.capacity_for(max_seq_len, self.model.config.max_position_embeddings)
            self.model.setup_cache(batch, capacity, static=self.compile, **kw)

    def __call__(self, tokens: torch.Tensor, start: int, last_only: bool, hidden_layers: tuple[int, ...] = ()):
        t = tokens.shape[1]
        packaged = self.aot_steps.get((t, last_only)) if not hidden_layers else None
        if packaged is not None:
            self.model.begin_step(start, t)  # the caches' Python half of the step, which the package cannot run
            return packaged(_dense(tokens), torch.arange(start, start + t, device=tokens.device))
        if self.compiled is None or t > COMPILED_MAX_T or (self.compile_shapes is not None
                                                          and t not in self.compile_shapes):
            return self.model(tokens, start, last_only, hidden_layers=hidden_layers)
        self.model.begin_step(start, t)  # eager, outside the graph: dynamo never sees the caches' counters
        pos = torch.arange(start, start + t, device=tokens.device)
        return self.compiled(_dense(tokens), 0, last_only, pos, hidden_layers=hidden_layers)

    def step(self, tokens: torch.Tensor, start: int, last_only: bool,
             hidden_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits [batch, T or 1, vocab], hidden [batch, T, len(hidden_layers), hidden_size] or None)."""
        out = self(tokens, start, last_only, hidden_layers)
        return out if hidden_layers else (out, None)

    def step_tree(self, tokens: torch.Tensor, start: int, tree, hidden_layers: tuple[int, ...] = ()
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A tree forward (model/tree.py; eager: tokens [batch, N] are the nodes of tree at start) -> as step."""
        out = self.model(tokens, start, hidden_layers=hidden_layers, tree=tree)
        return out if hidden_layers else (out, None)

    def commit_tree(self, start: int, path: list[int]):
        self.model.commit_tree(start, path)

    def rollback(self, length: int):
        self.model.rollback(length)
