"""The native W4 kernels (kernels/*.cpp): build once with the system C++ compiler, load with ctypes.

Two kernels, one per activation format, each built into its own shared library because each needs its own CPU
extension (a CPU may have one and not the other):
  w4_bf16    kernels/w4_bf16.cpp, AVX-512 BF16: bf16 activations (this module's pack/gemm);
  w4a8_vnni  kernels/w4a8_vnni.cpp, AVX-512 VNNI: int8 activations, GGUF's Q4_0 x Q8_0 (quant/w4a8.py).

Why ctypes and not a torch C++ extension: the kernels need no torch headers, so each compiles in about a second
with plain `g++` (a torch extension takes a minute and pins the build to one torch ABI), and CI builds them in
scripts/setup.sh with no network. The shared libraries link `libgomp.so.1`, the OpenMP runtime torch's CPU wheel
already loaded, so both share one thread pool.

`library(kernel)` returns the loaded library or None; a missing compiler, a CPU without the kernel's extension, or
a failed build is logged once with its reason, and QuantLinear then keeps its other backends. A build lands in
`${SPECQUANT_CACHE:-~/.cache/specquant}/kernels/<kernel>-<hash>.so` (the hash covers the source, kernels/common.h
and the flags), written to a temporary name and renamed, so concurrent processes never load a half-written file.
`main()` builds both and prints where (or why not); scripts/setup.sh calls it through `python -c` rather than
`python -m`, since the package imports this module before runpy would run it (a RuntimeWarning).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
BASE_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma"]


@dataclass(frozen=True)
class Kernel:
    source: str  # file name under kernels/
    flags: tuple[str, ...]  # compiler flags beyond BASE_FLAGS
    cpu_flags: tuple[str, ...]  # /proc/cpuinfo flags the kernel needs
    functions: dict  # exported C function -> ctypes argtypes (all return int: 0 = ok)


_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
KERNELS = {
    "w4_bf16": Kernel("w4_bf16.cpp", ("-mavx512bf16",), ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
                      {"specquant_w4_bf16_gemm": [_PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, ctypes.c_int, _PTR,
                                                  ctypes.c_int]}),
    "w4a8_vnni": Kernel("w4a8_vnni.cpp", ("-mavx512vnni",), ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
                        {"specquant_w4a8_gemm": [_PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, ctypes.c_int, _PTR,
                                                 ctypes.c_int],
                         "specquant_q8_quantize": [_PTR, _I64, _I64, _PTR, _PTR, _PTR]}),
}
TILE = 16  # output rows per tile (one zmm of fp32 results), in both kernels


def cache_dir() -> Path:
    return Path(os.environ.get("SPECQUANT_CACHE") or Path.home() / ".cache" / "specquant") / "kernels"


def _cpu_problem(needed: tuple[str, ...]) -> str | None:
    try:
        flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), [])
    except OSError:
        return "cannot read /proc/cpuinfo (not Linux?)"
    missing = [f for f in needed if f not in flags]
    return f"CPU lacks {', '.join(missing)}" if missing else None


def build(kernel: str = "w4_bf16") -> tuple[Path | None, str]:
    """Compile a kernel of KERNELS if its cached build is missing; returns (path or None, reason)."""
    if os.environ.get("SPECQUANT_NATIVE", "1") == "0":
        return None, "disabled by SPECQUANT_NATIVE=0"
    spec = KERNELS[kernel]
    problem = _cpu_problem(spec.cpu_flags)
    if problem:
        return None, problem
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        return None, "no C++ compiler (g++/c++) on PATH; install g++ or set CXX"
    source, flags = KERNEL_DIR / spec.source, [*BASE_FLAGS, *spec.flags]
    headers = b"".join(h.read_bytes() for h in sorted(KERNEL_DIR.glob("*.h")))  # kernels/common.h
    digest = hashlib.sha256(source.read_bytes() + headers + " ".join(flags).encode()).hexdigest()[:16]
    out = cache_dir() / f"{kernel}-{digest}.so"
    if out.is_file():
        return out, "cached"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
        os.close(fd)
        res = subprocess.run([cxx, *flags, str(source), "-o", tmp], capture_output=True, text=True, timeout=300)
        if res.returncode:
            os.unlink(tmp)
            first = (res.stderr.strip().splitlines() or ["?"])[0]
            return None, f"{Path(cxx).name} failed: {first[:200]}"
        os.replace(tmp, out)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"build failed: {e}"
    return out, "built"


@functools.lru_cache(maxsize=None)
def library(kernel: str = "w4_bf16") -> ctypes.CDLL | None:
    """The loaded kernel, or None (the reason is logged once)."""
    path, why = build(kernel)
    if path is None:
        log.info("native %s kernel unavailable: %s; QuantLinear uses its other backends", kernel, why)
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        log.info("native %s kernel unavailable: cannot load %s (%s)", kernel, path, e)
        return None
    for name, argtypes in KERNELS[kernel].functions.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int, argtypes
    return lib


def supports(bits: int, group_size: int, symmetric: bool, in_features: int, out_features: int) -> bool:
    return (bits == 4 and symmetric and out_features % TILE == 0 and group_size % 8 == 0
            and in_features % group_size == 0)


def pack(codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes int8 [N, K] in [-8, 7], scale [N, K/group] -> (packed uint8 [N/16, K/8, 64], fp32 [N/16, groups, 16]).

    See the layout comment in kernels/w4_bf16.cpp."""
    return pack_codes(codes), pack_scales(scale)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """codes int8 [N, K] in [-8, 7] -> uint8 [N/16, K/8, 64]: the same N·K/2 bytes as compressed-tensors' packing,
    permuted (so QuantLinear can hold either layout in one buffer)."""
    n, k = codes.shape
    u = (codes.to(torch.int16) + 8).to(torch.uint8).view(n // TILE, 4, 4, k // 8, 8)  # [tile, L, i, k8, kk]
    lo, hi = u[..., :4], u[..., 4:]  # k0..k3 low nibbles, k4..k7 high nibbles
    b = lo | (hi << 4)  # [tile, L, i, k8, 4]: byte for (k0|k4), (k1|k5), (k2|k6), (k3|k7)
    # bytes of lane L: 2i, 2i+1 <- (k0|k4), (k1|k5); 8+2i, 8+2i+1 <- (k2|k6), (k3|k7)
    first, second = b[..., 0:2], b[..., 2:4]  # [tile, L, i, k8, 2]
    lane = torch.stack([first, second], dim=2)  # [tile, L, half, i, k8, 2]
    return lane.permute(0, 4, 1, 2, 3, 5).reshape(n // TILE, k // 8, 64).contiguous()


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_codes: uint8 [N/16, K/8, 64] -> codes int8 [N, K]."""
    tiles, k8 = packed.shape[0], packed.shape[1]
    lane = packed.reshape(tiles, k8, 4, 2, 4, 2).permute(0, 2, 4, 1, 3, 5)  # [tile, L, i, k8, half, 2]
    b = lane.reshape(tiles, 4, 4, k8, 4)  # [tile, L, i, k8, 4]: (k0|k4), (k1|k5), (k2|k6), (k3|k7)
    u = torch.cat([b & 15, b >> 4], dim=-1)  # [tile, L, i, k8, 8]: k0..k7
    return (u.to(torch.int16) - 8).to(torch.int8).reshape(tiles * TILE, k8 * 8)


def pack_scales(scale: torch.Tensor) -> torch.Tensor:
    """scale [N, K/group] -> [N/16, groups, 16] in bf16 when every scale is a bf16 value (both kernels widen them
    exactly, and they are half the bytes: at group 32 a fifth of what a step streams), else fp32. A bf16 checkpoint
    loaded into an fp32 model holds its bf16 scales widened to fp32, so the test is on the values, not the dtype."""
    n = scale.shape[0]
    as_bf16 = scale.to(torch.bfloat16)
    packed = as_bf16 if torch.equal(as_bf16.to(scale.dtype), scale) else scale.float()
    return packed.view(n // TILE, TILE, -1).transpose(1, 2).contiguous()


def gemm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """x [..., K] (any float dtype; rounded to bf16) -> fp32 [..., N] with the packed weight (leading dims passed
    through without reshapes, as w4a8.gemm)."""
    return run_gemm(library().specquant_w4_bf16_gemm, x.to(torch.bfloat16).contiguous(), packed, scales, group)


def run_gemm(fn, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """Call a native GEMM (either kernel's C signature) on x [..., K] already in its input format: fp32 [..., N],
    leading dims passed through without reshapes (a decode step makes ~100 of these calls, and each torch reshape
    costs ~2 us of Python)."""
    k = x.shape[-1]
    m = x.numel() // k
    n = packed.shape[0] * TILE
    y = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    if fn(x.data_ptr(), m, k, packed.data_ptr(), scales.data_ptr(), n, group, scales.dtype == torch.bfloat16,
          y.data_ptr(), torch.get_num_threads()):
        raise ValueError(f"native kernel {fn.__name__} rejected shape M={m} K={k} N={n} group={group}")
    return y


@torch.library.custom_op("specquant::w4_bf16_gemm", mutates_args=())
def gemm_op(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """`gemm` as a torch operator, so torch.compile keeps it in the graph as one opaque call (a ctypes call is a
    graph break); QuantLinear uses it only while compiling, since the dispatcher costs a few us per call."""
    return gemm(x, packed, scales, group)


@gemm_op.register_fake
def _(x, packed, scales, group):
    return x.new_empty(*x.shape[:-1], packed.shape[0] * TILE, dtype=torch.float32)


def main() -> int:
    for name in KERNELS:
        path, why = build(name)
        print(f"native {name} kernel: {path} ({why})" if path else f"native {name} kernel not built: {why}")
    return 0  # a missing kernel is not an error: QuantLinear keeps its other backends


if __name__ == "__main__":
    sys.exit(main())
