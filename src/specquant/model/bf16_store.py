"""Store a decoding model's fp32 dense weights that hold bf16 values as bf16: the same outputs, half the bytes.

Every Qwen3 / Qwen3.5 release and the bundled models ship bf16 weights, so loaded into fp32 each dense matrix holds
only bf16 values and half of its bytes are zeros that a decode step streams anyway. model.modules.dense_linear
computes an fp32 input against a bf16 weight widened exactly (the native linear widens it in registers and sums
exactly as its fp32 call; every other path multiplies by weight.float(), the same matrix), so storing such a
weight as bf16 changes no output bit and halves what the step reads: at real vocabularies the lm_head is the
largest matrix of a step, and a dense fp32 model's layers halve too. Measured in docs/BENCH.md ("Quantization
quality", the bf16 head).

For decoding only (loader.load_model(fuse=True), whose models are neither saved nor trained): model.modules.Linear
layers only (their forward is dense_linear), on CPU, and only where the native library runs (elsewhere the widened
copy each call would cost more than it saves). A tied lm_head gets its own bf16 copy; the embedding keeps the fp32
matrix for its lookups.
"""

from __future__ import annotations

import torch
from torch import nn

from specquant.kernels import ops
from specquant.model.modules import Linear


def store_bf16(model: nn.Module) -> int:
    """Store every CPU fp32 Linear weight of model whose values are all bf16 values as bf16, in place; returns how
    many. Nothing changes without the native library."""
    if ops.LIBRARY.library() is None:
        return 0
    n = 0
    for mod in model.modules():
        if type(mod) is not Linear:  # QuantLinear, a quantized head's module and plain nn.Linear keep theirs
            continue
        w = mod.weight.detach()
        if w.dtype != torch.float32 or not w.is_cpu:
            continue
        half = w.to(torch.bfloat16)
        if torch.equal(half.float(), w):
            mod.weight = nn.Parameter(half, requires_grad=False)  # a tied head's own copy: the embedding keeps its
            n += 1
    return n
