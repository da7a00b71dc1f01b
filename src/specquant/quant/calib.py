"""Calibration data and layer-by-layer activation capture.

Tokens: the calibration text is split into documents at "\\n\\n\\n", each document is tokenized without special
tokens, documents are joined with EOS, and `calib_samples` windows of `seq_len` tokens are taken at evenly
spaced offsets over the whole stream (deterministic; windows overlap only when the text is shorter than
samples × seq_len).

Capture: sequential, one decoder layer at a time (as GPTQ and llm-awq do). The residual stream for all
samples, hidden [samples, seq_len, hidden], is kept in memory; for layer i we run it through layer i with
forward pre-hooks on the targeted Linears and keep their inputs, flattened to [tokens, in_features]. Linears
that receive the same tensor (q/k/v, gate/up) share one captured tensor, so memory per layer is
samples·seq_len·(3·hidden + intermediate) activations (≈0.9 GB fp32 at 64×256 tokens for a 1B Llama, 50 MB
for tiny-target) instead of one copy per Linear. After the method has quantized layer i, the residual stream
is pushed through the *quantized* layer, so layer i+1 calibrates on what it will see at inference.
Whole-model capture would need every layer's inputs at once (N× the memory) and would calibrate each layer on
full-precision predecessors; the sequential form is both smaller and better.
Each layer is called with the arguments the model's own forward gives it (RoPE rows of the kind's width, the
step's attention plan, positions), recorded by `layer_calls` from one cache-free forward, so calibration knows
nothing of how a layer kind is called and a hybrid's kinds (Gated DeltaNet beside attention) calibrate as they run.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from specquant.errors import SpecquantError


def calibration_tokens(tokenizer, path, samples: int, seq_len: int) -> torch.Tensor:
    """Token blocks [samples, seq_len] (int64) from a text file; raises if it has fewer than seq_len tokens."""
    text = open(path, encoding="utf-8").read()
    docs = [d.strip() for d in text.split("\n\n\n") if d.strip()]
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    for doc in docs:
        stream.extend(tokenizer.encode(doc, add_special_tokens=False, verbose=False))  # long docs are cut below
        if eos is not None:
            stream.append(eos)
    if len(stream) < seq_len:
        raise SpecquantError(
            f"calibration file {str(path)!r} has {len(stream)} tokens, fewer than seq_len={seq_len}; "
            "use a longer file (--calib) or a smaller --seq-len"
        )
    ids = torch.tensor(stream, dtype=torch.long)
    starts = torch.linspace(0, len(stream) - seq_len, samples).round().long()
    return torch.stack([ids[s : s + seq_len] for s in starts.tolist()])


class LinearInputs:
    """Context manager: forward pre-hooks that record the inputs of `linears` ({name: module}) as [tokens, in]."""

    def __init__(self, linears: dict[str, nn.Module]):
        self.linears = linears
        self.chunks: dict[str, list[torch.Tensor]] = {n: [] for n in linears}
        self.shared_with: dict[str, str] = {}

    def __enter__(self):
        # id(input tensor) -> (first name that recorded it, the tensor), within one batch. Holding the tensor
        # object keeps its id from being reused by a later, different input in the same batch.
        self._seen: dict[int, tuple[str, torch.Tensor]] = {}
        self.handles = [m.register_forward_pre_hook(self._hook(n)) for n, m in self.linears.items()]
        return self

    def _hook(self, name):
        def hook(module, args):
            x = args[0]
            seen = self._seen.get(id(x))
            if seen is not None:  # same tensor object as another Linear's input (q/k/v, gate/up)
                self.shared_with[name] = seen[0]
                return
            self._seen[id(x)] = (name, x)
            self.chunks[name].append(x.detach().reshape(-1, x.shape[-1]))

        return hook

    def next_batch(self):
        self._seen = {}

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    def result(self) -> dict[str, torch.Tensor]:
        out = {n: torch.cat(c) for n, c in self.chunks.items() if c}
        for name, first in self.shared_with.items():
            out[name] = out[first]  # the same tensor object: an in-place AWQ rescale applies to every sharer
        return out


@torch.no_grad()
def layer_calls(model, tokens: torch.Tensor) -> list[tuple[tuple, dict]]:
    """The arguments after the hidden state, (args, kwargs), that the model's forward passes each decoder layer
    for tokens [1, T] (cache-free). They depend on T, the dtype and the device, not on the batch or the values, so
    one short forward gives the calls every calibration batch of T tokens makes."""
    layers = list(model.model.layers)
    calls: list[tuple[tuple, dict] | None] = [None] * len(layers)

    def hook(i):
        def record(module, args, kwargs):
            calls[i] = (tuple(args[1:]), dict(kwargs))

        return record

    handles = [layer.register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        model(tokens)  # one sequence, so its cost is small beside the calibration passes
    finally:
        for h in handles:
            h.remove()
    assert all(c is not None for c in calls), "the model's forward did not call every decoder layer"
    return calls


@torch.no_grad()
def run_sequential(model, tokens: torch.Tensor, per_layer: Callable, batch_size: int = 8,
                   progress: Iterable | None = None):
    """Embed tokens [N, L], then for each decoder layer i call per_layer(i, layer, capture, call) and propagate.

    `call` = (args, kwargs): what follows the hidden state in the model's own call of layer i (layer_calls); a
    method that runs a part of the layer itself (AWQ's block loss runs the mixer) passes the same arguments.
    `capture(linears)` runs the layer on the current residual stream with LinearInputs hooks and returns the
    captured inputs; per_layer may replace the layer's Linears before the stream is pushed through it, and may
    return a function, called once the stream has gone through the layer (to swap in modules that are slower to
    run than the float stand-ins the stream went through).
    """
    model.clear_cache()
    emb = model.model.embed_tokens
    tokens = tokens.to(emb.weight.device)
    calls = layer_calls(model, tokens[:1])
    hidden = [emb(tokens[i : i + batch_size]) for i in range(0, len(tokens), batch_size)]
    for i, (layer, (args, kwargs)) in enumerate(zip(model.model.layers, calls)):

        def capture(linears: dict[str, nn.Module], layer=layer, args=args, kwargs=kwargs) -> dict[str, torch.Tensor]:
            with LinearInputs(linears) as rec:
                for h in hidden:
                    rec.next_batch()
                    layer(h, *args, **kwargs)
            return rec.result()

        after = per_layer(i, layer, capture, (args, kwargs))
        hidden = [layer(h, *args, **kwargs) for h in hidden]
        if after is not None:
            after()
        if progress is not None:
            progress.update(1)
    return hidden


@torch.no_grad()
def gram(x: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """XᵀX / n in float32 for x [n, in]: the second moment that makes ‖x·ΔWᵀ‖² a quadratic form in ΔW."""
    n, d = x.shape
    h = torch.zeros(d, d, dtype=torch.float32, device=x.device)
    for i in range(0, n, chunk):
        xc = x[i : i + chunk].float()
        h.addmm_(xc.t(), xc)
    return h.div_(n)


@torch.no_grad()
def abs_mean(x: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """Mean |x| per input channel (float32) for x [n, in], without a full float32 copy."""
    total = torch.zeros(x.shape[1], dtype=torch.float32, device=x.device)
    for i in range(0, x.shape[0], chunk):
        total += x[i : i + chunk].float().abs().sum(0)
    return total / x.shape[0]


def subsample(x: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """At most n rows of x [tokens, in] as float32, chosen with a fixed seed (all rows when n >= tokens)."""
    if x.shape[0] <= n:
        return x.float()
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(x.shape[0], generator=g)[:n].to(x.device)
    return x.index_select(0, idx).float()
