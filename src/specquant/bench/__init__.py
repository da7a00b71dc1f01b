"""Benchmarks of the quantized speculative pipeline: `specquant bench` (the ablation) and `specquant demo`.

    results = run_ablation(BenchConfig(), paths, torch.device("cpu"))   # ablation.py
    write_report(results, Path("runs/bench"))                            # report.py
"""

from specquant.bench.config import BenchConfig

__all__ = ["BenchConfig"]
