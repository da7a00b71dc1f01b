"""A native library: exported C functions built as variants in instruction-set order (best first); a kernel family
is a library with one arithmetic and one weight layout (the W4 GEMMs; kernels/ops.py is a plain library).

A family's variants all export the same C functions and read the same packed layout, so QuantLinear prepares a
layer once per family whichever variant runs it; `auto` (the only policy) takes the first variant this CPU supports
that builds and loads, and logs the choice; SPECQUANT_NATIVE=<variant,...> narrows the walk to the named variants.
What is shared by both W4 families lives here too: tiles of 16 outputs, the packed scales, and the ctypes call.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

from specquant.kernels import build
from specquant.kernels.build import Variant

log = logging.getLogger(__name__)

_LIBRARIES: list["Library"] = []  # every library made, so that SPECQUANT_NATIVE's variant names are checked against all

TILE = 16  # output rows per tile in every family's packed layout (one zmm, two ymm of fp32 results)


@dataclass(frozen=True)
class Layout:
    """How a family holds a weight: codes int8 [N, K] <-> uint8 [N/16, K/8, 64] (the checkpoint's N·K/2 bytes,
    permuted, so QuantLinear keeps one copy in one buffer), and scales [N, K/group] -> [N/16, groups, 16]."""

    pack_codes: Callable[[torch.Tensor], torch.Tensor]
    unpack_codes: Callable[[torch.Tensor], torch.Tensor]
    pack_scales: Callable[[torch.Tensor], torch.Tensor]


@dataclass(eq=False)
class Library:
    name: str
    variants: tuple[Variant, ...]  # best first; adding one is a .cpp file (or flags) and a row here
    functions: dict  # exported C function -> ctypes argtypes, the same in every variant
    # variant name -> (library or None, reason); (variant or None, library or None, reason). Keyword-only, so that a
    # subclass (Family) adds positional fields after the base's
    _loaded: dict = field(default_factory=dict, repr=False, kw_only=True)
    _choice: tuple | None = field(default=None, repr=False, kw_only=True)

    def __post_init__(self):
        _LIBRARIES.append(self)

    def load(self, variant: Variant) -> tuple[ctypes.CDLL | None, str]:
        """Build (or find cached) and load one variant; (library or None, why not)."""
        if variant.name not in self._loaded:
            path, why = build.build(self.name, variant)
            self._loaded[variant.name] = build.load(path, self.functions) if path else (None, why)
        return self._loaded[variant.name]

    def supported_variants(self) -> list[Variant]:
        """The variants this CPU can run (whether or not they build here)."""
        return [v for v in self.variants if build.cpu_problem(v.cpu_flags) is None]

    def choose(self) -> tuple[Variant | None, ctypes.CDLL | None, str]:
        """`auto`: the first variant that this CPU supports and that builds and loads (logged once), among those
        SPECQUANT_NATIVE keeps."""
        if self._choice is None:
            keep = build.restriction({v.name for f in _LIBRARIES for v in f.variants})
            reasons = []
            for v in self.variants:
                if keep is not None and v.name not in keep:
                    continue
                lib, why = self.load(v)
                if lib is not None:
                    self._choice = (v, lib, f"variant {v.name}")
                    log.info("native %s kernel: variant %s (the first of %s this CPU runs)", self.name, v.name,
                             ", ".join(x.name for x in self.variants if keep is None or x.name in keep))
                    break
                reasons.append(f"{v.name}: {why}")
            else:
                if keep is not None:
                    why = f"disabled by {build.SWITCH}={os.environ[build.SWITCH]}"
                    if keep and reasons:
                        why += " (" + "; ".join(reasons) + ")"
                else:
                    why = "; ".join(reasons) or "no variant listed"
                log.info("native %s kernel unavailable (%s); its callers use their torch paths", self.name, why)
                self._choice = (None, None, why)
        return self._choice

    def library(self) -> ctypes.CDLL | None:
        return self.choose()[1]

    def variant(self) -> Variant | None:
        return self.choose()[0]

    def why(self) -> str:
        """The chosen variant, or why there is none."""
        return self.choose()[2]

    def lib_for(self, variant: Variant | None = None) -> ctypes.CDLL:
        """The chosen variant's library, or the named variant's (tests run every variant the CPU supports)."""
        if variant is None and self._choice is not None and self._choice[1] is not None:
            return self._choice[1]  # the per-call path: a decode step asks ~500 times
        lib, why = (self.library(), self.why()) if variant is None else self.load(variant)
        if lib is None:
            raise RuntimeError(f"native {self.name} kernel unavailable: {why}")
        return lib

    def reset(self) -> None:
        """Forget the loaded variants and the choice (after SPECQUANT_NATIVE changes: tests)."""
        self._loaded.clear()
        self._choice = None


@dataclass(eq=False)
class Family(Library):
    layout: Layout
    supports: Callable[[int, int, bool, int, int], bool]  # (bits, group, symmetric, in, out): can it take a layer
    gemm: Callable  # (x [..., K], packed, scales, group, variant=None) -> fp32 [..., N], through ctypes
    gemm_op: Callable  # the same as a torch operator, for torch.compile / torch.export


def pack_scales(scale: torch.Tensor) -> torch.Tensor:
    """scale [N, K/group] -> [N/16, groups, 16] in bf16 when every scale is a bf16 value (every variant widens them
    exactly, and they are half the bytes: at group 32 a fifth of what a step streams), else fp32. A bf16 checkpoint
    loaded into an fp32 model holds its bf16 scales widened to fp32, so the test is on the values, not the dtype."""
    n = scale.shape[0]
    as_bf16 = scale.to(torch.bfloat16)
    packed = as_bf16 if torch.equal(as_bf16.to(scale.dtype), scale) else scale.float()
    return packed.view(n // TILE, TILE, -1).transpose(1, 2).contiguous()


_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
# int f(x, M, K, packed, scales, N, group, scale_bf16, y, threads): both families' GEMM entry point
GEMM_ARGS = [_PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, ctypes.c_int, _PTR, ctypes.c_int]


# Below this many multiply-adds (M x N x K) a GEMM runs on one thread: an OpenMP region costs a fork and a join
# whatever the work, and a thread that is not running (another process on the core) stalls the join for a time
# slice. A 1-row 128x128 layer (the tests' models) on a shared 2-core Ice Lake: 2 threads 4.5 ms wall and 1 ms CPU
# per call (the workers spin at the join), 1 thread 0.16 ms wall and 0.03 ms CPU. The same bound as ops.cpp's
# kParallelMinWork (linear, attention, the DeltaNet state walk). Every output is computed by one thread in one
# order whatever the thread count (common.h), so the result is the same bit for bit.
PARALLEL_MIN_MACS = 1 << 16


def run_gemm(fn, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """Call a native GEMM (GEMM_ARGS) on x [..., K] already in its input format: fp32 [..., N], leading dims
    passed through without reshapes (a decode step makes ~100 of these calls, and each torch reshape costs ~2 us of
    Python). On torch's thread count, or one thread below PARALLEL_MIN_MACS."""
    k = x.shape[-1]
    m = x.numel() // k
    n = packed.shape[0] * TILE
    y = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    threads = torch.get_num_threads() if m * n * k >= PARALLEL_MIN_MACS else 1
    if fn(x.data_ptr(), m, k, packed.data_ptr(), scales.data_ptr(), n, group, scales.dtype == torch.bfloat16,
          y.data_ptr(), threads):
        raise ValueError(f"native kernel {fn.__name__} rejected shape M={m} K={k} N={n} group={group}")
    return y
