"""The native CPU kernels: the W4 kernel families QuantLinear runs W4 layers on, each with its weight layout and its
variants in instruction-set order (best first), and the decoder's small fused ops (ops.py: the norms, SwiGLU,
norm + RoPE, few-query attention, the delta rule's step, a whole dense layer in one call), a library of one source
built per instruction set (avx512, avx2, portable). This package sits below model/ and quant/, which both call it.

  family   arithmetic                                       variants, best first (each module's VARIANTS)
  w4_bf16  bf16 activations x exact int4 weights, fp32 sums   avx512_bf16, avx2 (+FMA), portable
  w4a8     int8 activations per block of 32 x int4 weights    avx512_vnni, avx_vnni, avx2 (+FMA), portable
           (GGUF's Q4_0 x Q8_0); every variant bit-equal to w4a8.reference_gemm

The portable variants are plain C++ built with no instruction-set flag, for CPUs without AVX2 (old x86, ARM); a
NEON variant would be one more .cpp and row per family.

build.py probes the CPU, compiles and loads a variant; family.py picks, for each family, the first variant the CPU
runs (`auto`, logged). A new variant is one .cpp file in this folder plus one row in its family's VARIANTS; a new
family is one module plus one row below. `main()` builds every variant and prints what was built or why not;
scripts/setup.sh calls it through `python -c` (the package imports this module before `python -m` would run it).
"""

from __future__ import annotations

import sys

from specquant.kernels import build, ops, w4_bf16, w4a8
from specquant.kernels.family import TILE, Family, Library

FAMILIES: dict[str, Family] = {f.name: f for f in (w4_bf16.FAMILY, w4a8.FAMILY)}
LIBRARIES: dict[str, Library] = {**FAMILIES, ops.LIBRARY.name: ops.LIBRARY}  # everything main() builds

__all__ = ["FAMILIES", "LIBRARIES", "TILE", "Family", "Library", "build", "main", "ops", "reset", "w4_bf16", "w4a8"]


def reset() -> None:
    """Forget every loaded variant and choice, so the next use reads SPECQUANT_NATIVE again (tests)."""
    for library in LIBRARIES.values():
        library.reset()


def main() -> int:
    for family in LIBRARIES.values():
        for variant in family.variants:
            path, why = build.build(family.name, variant)
            print(f"native {family.name} {variant.name}: {path} ({why})" if path
                  else f"native {family.name} {variant.name} not built: {why}")
        print(f"native {family.name} kernel: {'auto picks ' if family.library() else 'none: '}{family.why()}")
    return 0  # a missing kernel is not an error: QuantLinear and the model keep their torch paths


if __name__ == "__main__":
    sys.exit(main())
