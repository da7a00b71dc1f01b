"""specquant: quantized-target + quantized-drafter speculative decoding on one machine."""

from specquant.runtime import apply_openmp_wait

apply_openmp_wait()  # before anything imports torch: OpenMP reads its wait policy when it loads (runtime.py)

__version__ = "0.1.0"
