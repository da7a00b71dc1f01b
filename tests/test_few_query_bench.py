"""benchmarks/few_query_attention.py: the paths it times compute the same attention as SDPA with enable_gqa (so its
table compares equal work), and its floor uses a positive measured GEMM rate."""

from __future__ import annotations

import pytest
import torch
from conftest import load_benchmark


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("context, queries", [(16, 1), (16, 5), (40, 16)])
def test_every_timed_path_matches_sdpa(dtype, atol, context, queries):
    bench = load_benchmark("few_query_attention.py")
    torch.manual_seed(0)
    fns = bench.step_fns(6, 2, 64, 2, context, queries, dtype)  # tiny-target's heads / KV heads / head_dim, 2 layers
    with torch.inference_mode():
        ref = fns["sdpa"]()
        for name in ("folded", "matmul"):
            for a, b in zip(ref, fns[name]()):
                assert a.shape == b.shape == (1, 6, queries, 64)
                torch.testing.assert_close(b.float(), a.float(), atol=atol, rtol=0, msg=name)


def test_gemm_peak_is_measured():
    # a rate, positive and finite; not a speed floor (speed is for the benchmark, not a unit test: a loaded machine
    # measured 1.3e7 here once)
    peak = load_benchmark("few_query_attention.py").peak_macs_per_s(torch.float32, n=64, reps=2)
    assert 0 < peak < float("inf")
