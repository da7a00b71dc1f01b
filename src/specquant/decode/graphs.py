"""CUDA-graph steps over the static caches: the decode (1 token) and verify (k+1 tokens) forwards replayed whole.

A decode step of a 4B model launches ~700 small kernels; at batch 1 on a GPU their launch cost, not the weight
reads, sets the pace (eager transformers reached 5% of the HBM floor on an H200, see docs/GPU.md). A CUDA graph
replays them with one launch. It needs fixed shapes and fixed addresses, which the static cache provides
(`setup_cache(static=True)`: positions travel as a device tensor, attention spans the whole buffer under a mask),
so one graph per (T, last_only) serves every position.

`StepGraph` holds static input buffers (tokens [1, T], input_pos [T]) and a static output; a call copies the inputs
in and replays. The output is overwritten by the next call of the same graph: consume (or clone) it first. On a
device without CUDA graphs the same buffers are used and the forward runs eagerly where the replay would be, so CPU
tests cover everything except the capture itself (tests/test_graphs.py; the capture is checked on CUDA by
scripts/gpu_check.sh).

`GraphStepper` is a drop-in for decode.compiled.Stepper (same calls), plus `replay(tokens, input_pos, last_only)`
taking positions already on the device, so a loop that keeps its tokens on the GPU never waits for the host.
"""

from __future__ import annotations

from typing import Callable

import torch

from specquant.decode.compiled import COMPILED_MAX_T, _raise_recompile_limit
from specquant.model.decoder import Transformer


SEQ_ROUND = 128  # cache lengths are rounded up to this: the attention reads the whole static buffer each step


class StepGraph:
    """fn(*inputs) -> output (a tensor or a tuple of tensors), captured as a CUDA graph on its first inputs (eager
    stand-in off CUDA). Any forward with fixed shapes fits: a Transformer step, or a block drafter's block forward."""

    def __init__(self, fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], pool=None,
                 warmup: int = 2, capture: bool = True, state: tuple[torch.Tensor, ...] = ()):
        """state: tensors fn updates from their own values (a recurrent layer's state): put back after each
        warm-up run, so the step advances them once, in the replay that computes this call's output. Tensors fn
        only overwrites (K/V at these positions) need not be listed."""
        self.fn = fn
        self.inputs = tuple(t.clone() for t in inputs)
        self.graph = None
        if capture and self.inputs[0].device.type == "cuda":
            # warm-up on a side stream (lazy init, autotuning, compilation) as torch.cuda.graphs requires; the
            # forward writes K/V at these positions, and the replay below writes the same values again
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                warm_up(fn, self.inputs, warmup, state)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                self.output = fn(*self.inputs)
            self.graph.replay()  # capture launched nothing: compute this call's output
        else:  # static outputs as on CUDA, so callers see the same aliasing
            self.output = _map(torch.clone, fn(*self.inputs))

    def __call__(self, *inputs: torch.Tensor):
        """Copy inputs into the static buffers and run: -> the static output (a tensor or a tuple of them)."""
        for buf, x in zip(self.inputs, inputs):
            buf.copy_(x)
        if self.graph is not None:
            self.graph.replay()
        else:
            _map(lambda dst, src: dst.copy_(src), self.output, self.fn(*self.inputs))
        return self.output


def warm_up(fn: Callable[..., object], inputs: tuple[torch.Tensor, ...], runs: int, state: tuple[torch.Tensor, ...]):
    """Run fn(*inputs) `runs` times, putting the tensors in `state` back as they were after each run."""
    kept = tuple(t.clone() for t in state)
    for _ in range(runs):
        fn(*inputs)
        for t, k in zip(state, kept):
            t.copy_(k)


def _map(f, *outs):
    """f over a tensor output, or elementwise over a tuple of them (None entries stay None)."""
    if isinstance(outs[0], tuple):
        return tuple(None if o[0] is None else f(*o) for o in zip(*outs))
    return f(*outs)


class GraphStepper:
    """`stepper(tokens [1, T], start, last_only) -> logits` with steps of T <= max_t tokens as CUDA graphs.

    compile: torch.compile the steps of compile_shapes tokens first (kernel fusion; the graph then removes the
    launches). Each shape is its own compilation (a minute or more for a 4B model), so by default only the decode
    step, as gpt-fast does; the engine compiles its verify shape instead. Longer inputs (prompts) run eagerly through the same
    static cache.
    """

    def __init__(self, model: Transformer, compile: bool = False, capture: bool = True, max_t: int = COMPILED_MAX_T,
                 compile_shapes: tuple[int, ...] = (1,)):
        self.model, self.capture, self.max_t = model, capture, max_t
        self.compile_shapes = set(compile_shapes) if compile else set()
        if compile:
            _raise_recompile_limit()
        self.compiled = torch.compile(model, dynamic=False) if compile else None
        self.graphs: dict[tuple[int, bool, tuple[int, ...]], StepGraph] = {}
        self.pool = None
        self._key, self._bufs = None, None

    def setup(self, batch: int, max_seq_len: int, **kw):
        """Static cache for a request. The same layout as this stepper's last request, with the buffers still in
        place: keep them (and the graphs recorded on their addresses), only marking every slot empty; otherwise
        allocate anew and drop the graphs. max_seq_len is rounded up to a multiple of SEQ_ROUND so requests of
        similar length share them."""
        max_seq_len = -(-max_seq_len // SEQ_ROUND) * SEQ_ROUND
        key = (batch, max_seq_len, tuple(sorted(kw.items())))
        bufs = self._current_bufs()
        if key == self._key and len(bufs) == len(self._bufs) and all(x is y for x, y in zip(self._bufs, bufs)):
            self.model.reset_cache()
            return
        self.model.setup_cache(batch, max_seq_len, static=True, **kw)
        self.graphs.clear()
        self._key, self._bufs = key, self._current_bufs()

    def _current_bufs(self) -> tuple:
        """What the graphs read by address: every cache buffer and the RoPE tables (held, so a freed tensor's id
        is never reused)."""
        caches = [c for c in self.model.caches() if c is not None]
        return (*(b for c in caches for b in c.buffers()), self.model.rope_cos, self.model.rope_sin)

    def replay(self, tokens: torch.Tensor, input_pos: torch.Tensor, last_only: bool,
               hidden_layers: tuple[int, ...] = (), start: int | None = None):
        """tokens [1, T], input_pos [T] on the model's device -> logits [1, T or 1, vocab] (a static buffer), or
        (logits, hidden [1, T, len(hidden_layers), hidden_size]) when hidden_layers is not empty. start: input_pos's
        first position as an int, when the caller has it (None: where the caches are, with no rollback before)."""
        t = tokens.shape[1]
        self.model.begin_step(start, t)  # the caches' Python half of the step (a graph replays tensor work only)
        kw = {"hidden_layers": hidden_layers} if hidden_layers else {}
        if t > self.max_t:
            return self.model(tokens, 0, last_only, input_pos, **kw)
        key = (t, last_only, hidden_layers)
        graph = self.graphs.get(key)
        if graph is None:
            if self.pool is None and tokens.device.type == "cuda":
                self.pool = torch.cuda.graph_pool_handle()  # one memory pool shared by every captured shape
            fn = self.compiled if t in self.compile_shapes else self.model
            graph = self.graphs[key] = StepGraph(
                lambda tok, pos: fn(tok, 0, last_only, pos, **kw), (tokens, input_pos), self.pool,
                capture=self.capture, state=self._current_bufs()[:-2])
            return graph.output
        return graph(tokens, input_pos)

    def __call__(self, tokens: torch.Tensor, start: int, last_only: bool, hidden_layers: tuple[int, ...] = ()):
        pos = torch.arange(start, start + tokens.shape[1], device=tokens.device)  # on the device: no host sync
        return self.replay(tokens, pos, last_only, hidden_layers, start)

    def step(self, tokens: torch.Tensor, start: int, last_only: bool, hidden_layers: tuple[int, ...] = ()):
        """(logits, hidden or None), as decode.compiled.Stepper.step."""
        out = self(tokens, start, last_only, hidden_layers)
        return out if hidden_layers else (out, None)

    def rollback(self, length: int):
        self.model.rollback(length)
