"""The native W4 kernel (kernels/w4_bf16.cpp): build once with the system C++ compiler, load with ctypes.

Why ctypes and not a torch C++ extension: the kernel needs no torch headers, so it compiles in about a second with
plain `g++` (a torch extension takes a minute and pins the build to one torch ABI), and CI builds it in
scripts/setup.sh with no network. The shared library links `libgomp.so.1`, the OpenMP runtime torch's CPU wheel
already loaded, so both share one thread pool.

`library()` returns the loaded library or None; a missing compiler, a CPU without AVX-512 BF16, or a failed build
is logged once with its reason, and QuantLinear then keeps its other backends. The build lands in
`${SPECQUANT_CACHE:-~/.cache/specquant}/kernels/w4_bf16-<hash of source and flags>.so`, written to a temporary
name and renamed, so concurrent processes never load a half-written file. `python -m specquant.quant.native`
builds it and prints where (or why not).
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
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "kernels" / "w4_bf16.cpp"
FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl",
         "-mavx512bf16", "-mfma"]
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
TILE = 16  # output rows per tile (one zmm of fp32 results)


def cache_dir() -> Path:
    return Path(os.environ.get("SPECQUANT_CACHE") or Path.home() / ".cache" / "specquant") / "kernels"


def _cpu_problem() -> str | None:
    try:
        flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), [])
    except OSError:
        return "cannot read /proc/cpuinfo (not Linux?)"
    missing = [f for f in CPU_FLAGS if f not in flags]
    return f"CPU lacks {', '.join(missing)}" if missing else None


def build(quiet: bool = False) -> tuple[Path | None, str]:
    """Compile the kernel if its cached build is missing; returns (path or None, reason)."""
    if os.environ.get("SPECQUANT_NATIVE", "1") == "0":
        return None, "disabled by SPECQUANT_NATIVE=0"
    problem = _cpu_problem()
    if problem:
        return None, problem
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        return None, "no C++ compiler (g++/c++) on PATH; install g++ or set CXX"
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    out = cache_dir() / f"w4_bf16-{digest}.so"
    if out.is_file():
        return out, "cached"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
        os.close(fd)
        res = subprocess.run([cxx, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=300)
        if res.returncode:
            os.unlink(tmp)
            first = (res.stderr.strip().splitlines() or ["?"])[0]
            return None, f"{Path(cxx).name} failed: {first[:200]}"
        os.replace(tmp, out)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"build failed: {e}"
    return out, "built"


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL | None:
    """The loaded kernel, or None (the reason is logged once)."""
    path, why = build()
    if path is None:
        log.info("native W4 kernel unavailable: %s; QuantLinear uses its torch backends", why)
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        log.info("native W4 kernel unavailable: cannot load %s (%s)", path, e)
        return None
    fn = lib.specquant_w4_bf16_gemm
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
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
    """scale [N, K/group] -> fp32 [N/16, groups, 16]."""
    n = scale.shape[0]
    return scale.float().view(n // TILE, TILE, -1).transpose(1, 2).contiguous()


def gemm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] (any float dtype; rounded to bf16) -> fp32 [M, N] with the packed weight."""
    lib = library()
    xb = x.to(torch.bfloat16).contiguous()
    m, k = xb.shape
    n = packed.shape[0] * TILE
    y = torch.empty(m, n, dtype=torch.float32)
    rc = lib.specquant_w4_bf16_gemm(xb.data_ptr(), m, k, packed.data_ptr(), scales.data_ptr(), n, group,
                                    y.data_ptr(), torch.get_num_threads())
    if rc:
        raise ValueError(f"native W4 kernel rejected shape M={m} K={k} N={n} group={group}")
    return y


if __name__ == "__main__":
    path, why = build()
    print(f"native W4 kernel: {path} ({why})" if path else f"native W4 kernel not built: {why}")
    sys.exit(0)
