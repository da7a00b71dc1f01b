"""QuantLinear: a weight-only quantized nn.Linear whose buffers are exactly the compressed-tensors tensors.

Buffers (names = checkpoint names, so `state_dict()` is the pack-quantized checkpoint as is):
  weight_packed      int32 [out, in·bits/32]          codes + 2^(bits-1), low bits first (see pack.py)
  weight_scale       [out, in/group] model dtype
  weight_zero_point  int32 [ceil(out·bits/32), in/group]  asymmetric only, packed along dim 0
  weight_shape       int64 [2] = (out, in)
Once a native kernel runs a layer, `weight_packed` holds the same bytes permuted into that kernel family's layout
(kernels: `native_layout` then names the family) instead of a second copy: one copy of the codes in memory.
`codes()` reads either layout, and `state_dict()` / `.to()` restore the compressed-tensors layout first, so
saving, exporting and moving see the checkpoint tensors as they are.

`forward` dispatches to a backend from BACKENDS. Every backend computes x @ dequant(W)ᵀ + b and is tested
against `reference` (tests/test_quant_linear.py):
  reference       dequantize on every call, then matmul in x's dtype. Slow, obviously correct.
  dequant_cached  dequantize once per (dtype, device) and keep the dense weight: dense-GEMM speed, but memory
                  returns to the unquantized size (plus the packed copy), so it suits small models / CPU
                  experiments, not memory-bound serving.
  int4pack_cpu    torch's tinygemm-style CPU kernel (aten._weight_int4pack_mm_for_cpu) on a weight repacked once
                  by aten._convert_weight_to_int4pack_for_cpu. Needs 4 bits, group 32/64/128/256, out % 16 == 0.
                  Layout/zero convention (established by testing against `reference`): it takes unsigned codes
                  u = c + 8 as int32 [out, in] and scale_and_zeros [in/group, out, 2] in x's dtype, and computes
                  w = (u - 8)·scale + zero; ours is w = (c - zp)·scale, so zero = -zp·scale (0 when symmetric).
                  It runs in fp32, bf16 or fp16 activations as long as scale_and_zeros has the same dtype.
  int4pack_cpu_bf16
                  the same kernel fed bf16 activations (and bf16 scale_and_zeros), the result cast back to x's
                  dtype: the kernel's fast path, since its fp32 path is much slower (docs/BENCH.md). For fp32 models this rounds
                  the activations entering each quantized Linear to bf16 (relative error <= 2^-9 per element).
  native_w4_bf16  the w4_bf16 kernel family (kernels/w4_bf16.py; its best variant for this CPU, built by
                  scripts/setup.sh or on first use with g++): same numerics contract as int4pack_cpu_bf16 (bf16
                  activations, exact int4 weights, fp32 sums), symmetric 4-bit only, out % 16 == 0; rows are
                  batch-invariant.
  native_w4a8     the w4a8 kernel family (kernels/w4a8.py): activations rounded to int8 per
                  block of 32 (GGUF's Q4_0 x Q8_0), exact integer dots, fp32 scales and sums; batch-invariant. Not
                  W4A16, so `auto` takes it only for layers whose `activations` is "int8" (set_w4_activations), and
                  then for every row count, prefill included, so a model runs one arithmetic throughout.
  triton_w4       quant/triton_w4.py: a Triton W4A16/W8A16 GEMM reading these buffers as they are (CUDA; tested on
                  CPU under TRITON_INTERPRET=1). Imported only when triton is installed and the input is on CUDA.

`backend="auto"` (default) takes the first row of AUTO_ORDER that applies (benchmarks/quant_backends.py at dfedb37's
measurement); a native backend runs its family's best variant for this CPU (kernels).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specquant.errors import SpecquantError
from specquant.kernels import FAMILIES, TILE, ops, w4a8
from specquant.model.modules import NATIVE_ROWS, dense_linear
from specquant.quant.config import W4_ACTIVATIONS
from specquant.quant.grid import dequantize
from specquant.quant.pack import pack_codes, packed_cols, unpack_codes

log = logging.getLogger(__name__)


class QuantLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int, symmetric: bool = True,
                 bias: bool = False, dtype: torch.dtype | None = None, device=None):
        super().__init__()
        assert in_features % group_size == 0 and (in_features * bits) % 32 == 0
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size, self.symmetric = bits, group_size, symmetric
        groups = in_features // group_size
        dtype = dtype or torch.get_default_dtype()
        self.register_buffer("weight_packed", torch.zeros(out_features, packed_cols(in_features, bits),
                                                          dtype=torch.int32, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, groups, dtype=dtype, device=device))
        self.register_buffer("weight_shape", torch.tensor([out_features, in_features], dtype=torch.int64,
                                                          device=device))
        if not symmetric:
            self.register_buffer("weight_zero_point", torch.zeros(packed_cols(out_features, bits), groups,
                                                                  dtype=torch.int32, device=device))
        else:
            self.weight_zero_point = None
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        self.backend = "auto"  # or a key of BACKENDS
        self._cache: dict = {}
        self.native_layout: str | None = None  # the native kernel whose layout weight_packed holds (docstring)
        self.activations = "float"  # or "int8": run on the W4A8 kernel (set_w4_activations)

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int,
                   bias: torch.Tensor | None = None) -> "QuantLinear":
        """codes int8 [out, in], scale [out, groups] (its dtype is the model dtype), zero int8 [out, groups]."""
        out, inp = codes.shape
        m = cls(inp, out, bits, inp // scale.shape[1], zero is None, bias is not None, scale.dtype, codes.device)
        m.weight_packed.copy_(pack_codes(codes, bits))
        m.weight_scale.copy_(scale)
        if zero is not None:
            m.weight_zero_point.copy_(pack_codes(zero, bits, dim=0))
        if bias is not None:
            m.bias.data.copy_(bias.detach().to(scale.dtype))
        return m

    @classmethod
    def concat(cls, mods: list["QuantLinear"]) -> "QuantLinear | None":
        """One QuantLinear computing cat([m(x) for m in mods], -1) (model.fuse), or None when they cannot be fused:
        the codes, scales and zero points concatenate along the output dim when bits, group and symmetry agree."""
        first = mods[0]
        key = (first.in_features, first.bits, first.group_size, first.symmetric, first.weight_scale.dtype,
               first.bias is None)
        if any(type(m) is not cls or (m.in_features, m.bits, m.group_size, m.symmetric, m.weight_scale.dtype,
                                      m.bias is None) != key for m in mods):
            return None
        zero = None if first.symmetric else torch.cat([m.zero_point() for m in mods])
        bias = None if first.bias is None else torch.cat([m.bias.detach() for m in mods])
        fused = cls.from_codes(torch.cat([m.codes() for m in mods]), torch.cat([m.weight_scale for m in mods]),
                               zero, first.bits, bias)
        fused.backend, fused.activations = first.backend, first.activations
        return fused

    def codes(self) -> torch.Tensor:
        if self.native_layout:
            return FAMILIES[self.native_layout].layout.unpack_codes(self._native_view())
        return unpack_codes(self.weight_packed, self.bits, self.in_features)  # int8 [out, in]

    def _native_view(self) -> torch.Tensor:
        """weight_packed's bytes as a kernel family's uint8 [out/16, in/8, 64] (no copy; every family's shape)."""
        return self.weight_packed.view(torch.uint8).view(self.out_features // TILE, self.in_features // 8, 64)

    def to_native_layout(self, family: str = "w4_bf16") -> None:
        """Permute weight_packed in place into a kernel family's layout (a no-op when it already is)."""
        if self.native_layout == family:
            return
        permuted = FAMILIES[family].layout.pack_codes(self.codes())
        self._native_view().copy_(permuted)
        self.native_layout = family

    def to_standard_layout(self) -> None:
        """Back to the compressed-tensors layout (a no-op when it already is)."""
        if not self.native_layout:
            return
        codes = self.codes()
        self.native_layout = None
        self.weight_packed.copy_(pack_codes(codes, self.bits))

    def zero_point(self) -> torch.Tensor | None:
        if self.weight_zero_point is None:
            return None
        return unpack_codes(self.weight_zero_point, self.bits, self.out_features, dim=0)  # int8 [out, groups]

    def dequantized_weight(self) -> torch.Tensor:
        """Dense weight [out, in] in the scale dtype, bit-identical to compressed-tensors' decompression."""
        return dequantize(self.codes(), self.weight_scale, self.zero_point())

    def invalidate(self):
        """Drop backend caches (after the buffers change)."""
        self._cache.clear()
        for name in DERIVED_BUFFERS:  # rebuilt from the checkpoint buffers on a backend's next call
            self._buffers.pop(name, None)

    def _apply(self, fn, recurse=True):
        self.invalidate()
        self.to_standard_layout()  # other devices' kernels (and the bytes of a copy) read the checkpoint layout
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs):
        self.invalidate()
        self.native_layout = None  # the buffer is overwritten with checkpoint (compressed-tensors) bytes
        return super()._load_from_state_dict(*args, **kwargs)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.native_layout:  # the checkpoint tensor, rebuilt from the permuted copy (only while saving)
            destination[prefix + "weight_packed"] = pack_codes(self.codes(), self.bits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out]
        key = ("backend", self.backend, self.activations, x.dtype, x.device.type,
               x.numel() >= LARGE_ROWS * self.in_features)
        name = self._cache.get(key)
        if name is None:
            name = self._cache[key] = resolve_backend(self, x)
        return BACKENDS[name].forward(self, x)

    # A native layer step (model/native_layer.py) runs this layer's GEMM itself when, for the few fp32 CPU rows it
    # takes (fewer than LARGE_ROWS), forward has chosen a native backend and prepared its layout: the same kernel on
    # the same pointers (on activations rounded to bf16 for w4_bf16, as its gemm rounds them), its bias added after,
    # as _native_forward does.
    def native_key(self) -> tuple | None:
        name = self._cache.get(("backend", self.backend, self.activations, torch.float32, "cpu", False))
        family = NATIVE_FAMILIES.get(name)
        prepared = self._cache.get(("native", family))
        bias = self._parameters.get("bias")  # not self.bias: nn.Module.__getattr__ costs ~1 us, asked every step
        if prepared is None or self.native_layout != family or (bias is not None and bias.dtype is not torch.float32):
            return None
        return family, prepared[0].data_ptr(), prepared[1].data_ptr(), None if bias is None else bias.data_ptr()

    def native_projection(self) -> ops.Projection | None:
        key = self.native_key()
        if key is None:
            return None
        family = key[0]
        packed, scales = self._cache[("native", family)]
        fn = ctypes.cast(getattr(FAMILIES[family].lib_for(), f"specquant_{family}_gemm"), ctypes.c_void_p).value
        return ops.Projection(kind=2 if family == "w4a8" else 3, n=packed.shape[0] * TILE, k=self.in_features,
                              group=self.group_size,
                              bf16_scales=int(scales.dtype == torch.bfloat16), fn=fn, w=packed.data_ptr(),
                              scales=scales.data_ptr(), bias=None if self.bias is None else self.bias.data_ptr())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, symmetric={self.symmetric}, backend={self.backend}"
                + (", activations=int8" if self.activations == "int8" else ""))


# --- backends -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Backend:
    forward: Callable[[QuantLinear, torch.Tensor], torch.Tensor]
    supports: Callable[[QuantLinear, torch.Tensor], bool]


def _reference(m: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    w = m.dequantized_weight().to(x.dtype)
    return F.linear(x, w, None if m.bias is None else m.bias.to(x.dtype))


# Tensors a backend derives once from the checkpoint buffers (a kernel's repacked codes, its scales, a dense
# weight). They are kept as non-persistent buffers, not plain attributes, because a torch.compile'd or exported
# graph reads a module's tensors by buffer name: a plain attribute would be baked into an AOT package as a
# constant that cannot be bound to the model's own tensors. Never saved; dropped by invalidate().
DERIVED_BUFFERS = ("native_scales", "dense_weight", "int4pack_weight", "int4pack_scale_and_zeros", "int8pack_weight",
                   "int8pack_scale")


def _derived(m: QuantLinear, name: str, key, build: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The derived buffer `name`, (re)built when missing or made for another key (an activation dtype)."""
    if name not in m._buffers or m._cache.get(("derived", name)) != key:
        _register_derived(m, name, key, build)  # under torch.export, aot.settle has run it eagerly before
    return getattr(m, name)  # by attribute: what a graph being traced sees as the module's buffer


@torch.compiler.disable  # registers a buffer: never traced into a graph
def _register_derived(m: QuantLinear, name: str, key, build: Callable[[], torch.Tensor]) -> None:
    m.register_buffer(name, build(), persistent=False)
    m._cache[("derived", name)] = key


def _dequant_cached(m: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    w = _derived(m, "dense_weight", (x.dtype, x.device),
                 lambda: m.dequantized_weight().to(device=x.device, dtype=x.dtype))
    return dense_linear(x, w, None if m.bias is None else m.bias.to(x.dtype))  # the same path as a dense Linear


INT4PACK_GROUPS = (32, 64, 128, 256)
LARGE_ROWS = 128  # auto: from this many rows on, dequantize per call + dense GEMM beats the int4 kernel
assert LARGE_ROWS > NATIVE_ROWS  # native_key reads the backend chosen for fewer rows: the native layer step's
INT4PACK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _int4pack_supports(m: QuantLinear, x: torch.Tensor) -> bool:
    return (m.bits == 4 and x.device.type == "cpu" and m.group_size in INT4PACK_GROUPS
            and m.out_features % 16 == 0 and x.dtype in INT4PACK_DTYPES
            and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"))


def _int4pack_cpu(m: QuantLinear, x: torch.Tensor, kernel_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x @ W^T (+ bias) with the int4 kernel run in kernel_dtype (default x's dtype); result in x's dtype."""
    kd = kernel_dtype or x.dtype
    packed = _derived(m, "int4pack_weight", None, lambda: torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        m.codes().to(torch.int32) + 8, 1))  # unsigned codes [out, in] in 0..15

    def scale_and_zeros_for_kd() -> torch.Tensor:
        scale = m.weight_scale.float()
        zp = m.zero_point()
        zero = torch.zeros_like(scale) if zp is None else -zp.float() * scale
        return torch.stack([scale.t(), zero.t()], dim=-1).to(kd).contiguous()  # [groups, out, 2]

    scale_and_zeros = _derived(m, "int4pack_scale_and_zeros", kd, scale_and_zeros_for_kd)
    x2 = x.reshape(-1, m.in_features).to(kd).contiguous()
    mm = int4pack_mm_op if torch.compiler.is_compiling() else torch.ops.aten._weight_int4pack_mm_for_cpu
    y = mm(x2, packed, m.group_size, scale_and_zeros).to(x.dtype)
    if m.bias is not None:
        y = y + m.bias.to(x.dtype)
    return y.reshape(*x.shape[:-1], m.out_features)


@torch.library.custom_op("specquant::int4pack_mm", mutates_args=())
def int4pack_mm_op(x: torch.Tensor, packed: torch.Tensor, group: int, scale_and_zeros: torch.Tensor) -> torch.Tensor:
    """torch's int4 CPU kernel as an opaque operator for torch.compile / torch.export. Why: inductor's own lowering
    of the aten op adds the group size as a tensor constant of the graph, which an AOT package built without its
    constants (decode/aot.py) cannot bind to any of the model's tensors."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scale_and_zeros)


@int4pack_mm_op.register_fake
def _(x, packed, group, scale_and_zeros):
    return x.new_empty(x.shape[0], scale_and_zeros.shape[1])  # [rows, out]


def _int4pack_cpu_bf16(m: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    return _int4pack_cpu(m, x, torch.bfloat16)


def _native_supports(family: str) -> Callable[[QuantLinear, torch.Tensor], bool]:
    fam = FAMILIES[family]

    def supports(m: QuantLinear, x: torch.Tensor) -> bool:
        return (x.device.type == "cpu" and x.dtype in INT4PACK_DTYPES
                and fam.supports(m.bits, m.group_size, m.symmetric, m.in_features, m.out_features)
                and fam.library() is not None)

    return supports


def _native_forward(family: str) -> Callable[[QuantLinear, torch.Tensor], torch.Tensor]:
    """Run a kernel family's gemm (its chosen variant) on weight_packed permuted (once, in place) into that
    family's layout. The kernel's view of the codes and its scales are prepared once (a decode step makes ~100 of
    these calls, so per-call Python work counts), and re-prepared whenever the layout was changed for the other
    family. Under torch.compile the kernel runs as its torch operator (no graph break). The result comes back in
    x's dtype."""
    fam = FAMILIES[family]

    def forward(m: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        prepared = m._cache.get(("native", family))
        if prepared is None or m.native_layout != family:
            prepared = _prepare_native(m, family)
        if torch.compiler.is_compiling():  # torch.compile / torch.export: buffers only, so the graph reads them
            y = fam.gemm_op(x, m._native_view(), m.native_scales, m.group_size)
        else:
            y = fam.gemm(x, *prepared, m.group_size)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        if m.bias is not None:
            y = y + m.bias.to(x.dtype)
        return y

    return forward


@torch.compiler.disable  # permutes a buffer in place: never traced into a graph
def _prepare_native(m: QuantLinear, family: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Permute the codes into the family's layout and pack its scales, kept as the non-persistent buffer
    `native_scales` (so a compiled or exported graph finds it among the module's buffers, by name)."""
    m.to_native_layout(family)
    m.register_buffer("native_scales", FAMILIES[family].layout.pack_scales(m.weight_scale), persistent=False)
    prepared = m._cache[("native", family)] = (m._native_view(), m.native_scales)
    return prepared


def _int8pack_supports(m: QuantLinear, x: torch.Tensor) -> bool:
    return (m.bits == 8 and m.symmetric and m.group_size == m.in_features and x.device.type == "cpu"
            and x.dtype in (torch.float32, torch.bfloat16) and hasattr(torch.ops.aten, "_weight_int8pack_mm"))


def _int8pack_cpu(m: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """torch's W8 per-channel CPU kernel (aten._weight_int8pack_mm): int8 weight [out, in], scales [out]."""
    codes = _derived(m, "int8pack_weight", None, lambda: m.codes().contiguous())
    scale = _derived(m, "int8pack_scale", x.dtype, lambda: m.weight_scale.reshape(-1).to(x.dtype).contiguous())
    y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, m.in_features).contiguous(), codes, scale)
    if m.bias is not None:
        y = y + m.bias.to(x.dtype)
    return y.reshape(*x.shape[:-1], m.out_features)


@functools.lru_cache(maxsize=None)
def _triton_w4():
    """quant/triton_w4.py, or None without triton (an optional extra: `pip install specquant[gpu]`)."""
    if importlib.util.find_spec("triton") is None:
        return None
    from specquant.quant import triton_w4

    return triton_w4


def _triton_supports(m: QuantLinear, x: torch.Tensor) -> bool:
    return x.device.type == "cuda" and _triton_w4() is not None and _triton_w4().supports(m, x)


def _triton_forward(m: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    return _triton_w4().forward(m, x)


NATIVE_FAMILIES = {"native_w4_bf16": "w4_bf16", "native_w4a8": "w4a8"}  # backend -> kernel family (native_key)
BACKENDS: dict[str, Backend] = {
    "reference": Backend(_reference, lambda m, x: True),
    "dequant_cached": Backend(_dequant_cached, lambda m, x: True),
    "int4pack_cpu": Backend(_int4pack_cpu, _int4pack_supports),
    "int4pack_cpu_bf16": Backend(_int4pack_cpu_bf16, _int4pack_supports),
    # bf16 activations (as int4pack_cpu_bf16), exact int4 weights, fp32 sums and scales (kernels/w4_bf16.py)
    "native_w4_bf16": Backend(_native_forward("w4_bf16"), _native_supports("w4_bf16")),
    # int8 activations per block of 32, exact integer dots, fp32 scales and sums (kernels/w4a8.py)
    "native_w4a8": Backend(_native_forward("w4a8"), _native_supports("w4a8")),
    "int8pack_cpu": Backend(_int8pack_cpu, _int8pack_supports),
    "triton_w4": Backend(_triton_forward, _triton_supports),
}


def register_backend(name: str, backend: Backend):
    """Add a kernel (e.g. a future Triton CUDA W4A16 GEMM); a row in AUTO_ORDER says when `auto` picks it."""
    BACKENDS[name] = backend


@functools.lru_cache(maxsize=None)
def _log_choice(choice: str, why: str):
    log.info("QuantLinear backend: %s (%s)", choice, why)  # lru_cache: logged once per distinct decision


@dataclass(frozen=True)
class AutoRule:
    """One row of AUTO_ORDER: `backend` is taken when `when(layer, x, rows)` holds and the backend supports the
    layer and input; `why` (formatted with rows, dtype, device, variant) is logged with the choice."""

    backend: str
    when: Callable[[QuantLinear, torch.Tensor, int], bool]
    why: str


def _always(m: QuantLinear, x: torch.Tensor, rows: int) -> bool:
    return True


def _float_or_bf16(m: QuantLinear, x: torch.Tensor, rows: int) -> bool:
    return x.dtype in (torch.float32, torch.bfloat16)


# `auto`, first match wins; follows benchmarks/quant_backends.py at dfedb37's measurement (numbers in docs/BENCH.md, weights
# streamed from memory as in a forward pass). int8 activations run the W4A8 kernel at every row count, prefill
# included, so one model runs one arithmetic. From LARGE_ROWS rows on (prompt prefill), dequantizing per call and
# one dense GEMM beats the few-row kernels, without a dense copy. On CUDA, decode and verify shapes go to the Triton
# kernel when triton is installed (it streams the packed weight; benchmarks/gpu.py, docs/GPU.md). For few rows on
# CPU the native W4 kernel beat torch's int4 kernel on bf16 activations, which beat the dense GEMM in either dtype
# (fp32 goes through a bf16 cast); layers neither can take (8 bits, odd shapes) use dequant_cached.
AUTO_ORDER: tuple[AutoRule, ...] = (
    AutoRule("native_w4a8", lambda m, x, rows: m.activations == "int8",
             "int8 activations asked for: the native W4A8 kernel ({variant}) at every row count"),
    AutoRule("reference", lambda m, x, rows: rows >= LARGE_ROWS,
             "{rows} rows (>= " + str(LARGE_ROWS) + "): dequantize per call, then one dense GEMM"),
    AutoRule("triton_w4", _always, "{dtype} activations on CUDA: the Triton W4A16 kernel on the packed weight"),
    AutoRule("int8pack_cpu", _always, "{dtype} activations on CPU, 8-bit per-channel: the int8 kernel"),
    AutoRule("native_w4_bf16", _float_or_bf16, "{dtype} activations on CPU: the native W4 kernel ({variant})"),
    AutoRule("int4pack_cpu_bf16", _float_or_bf16, "{dtype} activations on CPU: the int4 kernel on bf16 activations"),
    AutoRule("dequant_cached", _always, "{dtype} activations on {device}: dense GEMM on cached weights"),
)
NATIVE_BACKENDS = {"native_w4a8": "w4a8", "native_w4_bf16": "w4_bf16"}  # backend -> the kernel family it runs


def auto_backend(m: QuantLinear, x: torch.Tensor) -> str:
    """The backend `auto` picks for this layer and input: the first row of AUTO_ORDER that applies. The choice
    depends on dtype, device, layer and whether rows >= LARGE_ROWS; each layer caches it per key."""
    rows = x.numel() // m.in_features
    rule = next(r for r in AUTO_ORDER if r.when(m, x, rows) and BACKENDS[r.backend].supports(m, x))
    family = NATIVE_BACKENDS.get(rule.backend)
    _log_choice(rule.backend, rule.why.format(rows=rows, dtype=x.dtype, device=x.device.type,
                                              variant=FAMILIES[family].why() if family else ""))
    return rule.backend


def resolve_backend(m: QuantLinear, x: torch.Tensor) -> str:
    if m.backend == "auto":
        return auto_backend(m, x)
    if m.backend not in BACKENDS:
        raise SpecquantError(f"unknown QuantLinear backend {m.backend!r}; use auto or one of {', '.join(BACKENDS)}")
    if not BACKENDS[m.backend].supports(m, x):
        raise SpecquantError(
            f"backend {m.backend!r} cannot run this layer ({m.bits} bits, group {m.group_size}, "
            f"out {m.out_features}) on {x.dtype} {x.device.type} input; use backend 'auto' or 'reference'"
        )
    return m.backend


def set_backend(model: nn.Module, name: str) -> int:
    """Force one backend on every QuantLinear in model ("auto" restores automatic choice). Returns the count."""
    if name != "auto" and name not in BACKENDS:
        raise SpecquantError(f"unknown QuantLinear backend {name!r}; use auto or one of {', '.join(BACKENDS)}")
    n = 0
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            mod.backend = name
            mod.invalidate()
            n += 1
    return n


def resolve_w4_activations(mode: str, device: str | torch.device = "cpu") -> str:
    """"auto" -> "int8" where the W4A8 kernel runs (a CPU device, the native library built), else "float"; the
    other modes as they are."""
    if mode == "auto":
        return "int8" if torch.device(device).type == "cpu" and w4a8.FAMILY.library() is not None else "float"
    return mode


def set_w4_activations(model: nn.Module, mode: str) -> int:
    """Run the model's symmetric 4-bit layers on float (W4A16: the checkpoint's arithmetic) or int8 activations
    (W4A8, GGUF's Q4_0 x Q8_0: the w4a8 kernel family, at every row count, so decode, verify and prefill share one
    arithmetic); "auto" (the engines' default, quant.config.W4_ACTIVATIONS) is int8 where the kernel runs on the
    model's device and float elsewhere. Layers the W4A8 kernel cannot take (8 bits, zero points, odd shapes) keep
    float activations. Returns how many layers run int8; raises when int8 is asked for and the kernel is
    unavailable."""
    if mode not in W4_ACTIVATIONS:
        raise SpecquantError(f"w4 activations {mode!r} is not supported; use one of {', '.join(W4_ACTIVATIONS)}")
    device = next((b.device for b in model.buffers()), torch.device("cpu"))
    mode = resolve_w4_activations(mode, device)
    if mode == "int8" and w4a8.FAMILY.library() is None:
        raise SpecquantError(f"int8 W4 activations need the native W4A8 kernel, which is unavailable here "
                             f"({w4a8.FAMILY.why()}); use float activations")
    n = 0
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            mod.activations = mode
            mod.invalidate()
            n += mode == "int8" and w4a8.supports(mod.bits, mod.group_size, mod.symmetric, mod.in_features,
                                                  mod.out_features)
    return n
