"""benchmarks/gpu.py on CPU with tiny shapes: every field of its JSON line and file present and consistent.

The numbers are CPU timings of tiny models (meaningless as speed); what is checked is the bookkeeping: floors follow
from bytes and bandwidth, ratios from step times, the A10G rows from bytes and predict_row, the seed's histogram
has mean acceptance length 5.03.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from conftest import BENCHMARKS, load_benchmark

SCRIPT = BENCHMARKS / "gpu.py"


def test_seed_histogram_has_the_seed_mean_acceptance_length():
    gpu = load_benchmark("gpu.py")
    acc = gpu.seed_acceptance()
    assert gpu.acceptance_metrics(acc).mean_acceptance_length == pytest.approx(5.03, abs=1e-12)
    assert len(acc["histogram"]) == 16 and acc["draft_tokens"] / acc["drafts"] == 15


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # two spinning OpenMP threads on a shared 2-core box: 10x slower
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), json.loads((out / "gpu.json").read_text())


def test_json_line_has_every_field(run):
    line, _ = run
    assert line["benchmark"] == "gpu" and line["device"] == "cpu" and line["tiny"] is True
    assert line["copy_gbps"] > 0
    for role in ("target", "draft"):
        for prec in ("bf16", "w4"):
            assert line[f"{role}_{prec}_decode_tokens_per_s"] > 0
            assert line[f"{role}_{prec}_floor_tokens_per_s"] > 0
            assert line[f"{role}_{prec}_fraction_of_floor"] >= 0  # rounded to 3 digits: tiny CPU runs can read 0.0
    assert list(line["verify_ratio_w4"]) == [str(t) for t in range(1, 17)] and line["verify_ratio_w4"]["1"] == 1.0
    assert all(v > 0 for v in line["verify_ratio_w4"].values())
    assert set(line["draft_target_ratio"]) == {"bf16/bf16", "w4/w4", "bf16/w4"}
    assert all(v > 0 for v in line["draft_target_ratio"].values())
    assert line["block_draft_target_ratio"].startswith("not measured")
    assert set(line["goals_met"]) == {"bf16_fraction_of_floor", "w4_over_bf16_decode"}
    # fused q/k/v, o, fused gate/up, down: the W4 target's four distinct layer shapes
    assert len(line["w4_layer_speedup_1_row"]) == 4 and all(v > 0 for v in line["w4_layer_speedup_1_row"].values())
    for src in ("a10g_from_bundled", "a10g_from_seed_mal"):
        assert set(line[src]) == {f"{c}/{r}" for c in ("short", "medium", "long") for r in "abcde"}
        assert all(line[src][f"{c}/a"] == 1.0 for c in ("short", "medium", "long"))
        assert all(v > 0 and math.isfinite(v) for v in line[src].values())


def test_full_numbers_are_consistent(run):
    _, res = run
    bw = res["copy_gbps"] * 1e9
    for role, ms in res["models"].items():
        for prec, m in ms.items():
            assert m["bytes_per_step"] == m["weight_bytes"] + m["kv_bytes"] > 0
            assert m["floor_tokens_per_s"] == pytest.approx(bw / m["bytes_per_step"])
            assert m["fraction_of_floor"] == pytest.approx(m["decode_tokens_per_s"] / m["floor_tokens_per_s"])
            assert m["verify_ratio"]["4"] == pytest.approx(m["step_ms"]["4"] / m["step_ms"]["1"])
        # W4 holds 4-bit codes + group scales (+ the bf16 tied embedding): fewer bytes than bf16
        assert ms["w4"]["weight_bytes"] < ms["bf16"]["weight_bytes"]
    assert {r["rows"] for r in res["layers"]} == {1, 4, 16}
    for r in res["layers"]:
        assert r["w4_speedup"] == pytest.approx(r["bf16_us"] / r["w4_us"])
        assert r["backend"] in ("native_w4_bf16", "int4pack_cpu_bf16")  # auto: the native kernel where it builds
    assert res["kernel_sweep"].startswith("not measured")
    e = res["engine"]
    assert e["verify_steps"] > 0 and e["ms_per_step"] > 0 and e["parts_ms"] > 0
    assert e["overhead"] == pytest.approx(e["ms_per_step"] / e["parts_ms"] - 1)
    t = res["models"]["target"]
    assert res["w4_over_bf16_decode"] == pytest.approx(t["w4"]["decode_tokens_per_s"] / t["bf16"]["decode_tokens_per_s"])
    # row b is pure bytes: bf16 over W4 target bytes at each category's context
    for row in res["a10g"]["from_bundled"]:
        if row["row"] == "b":
            assert row["speedup"] > 1
    bundled = res["acceptance"]["bundled"]
    assert set(bundled) == {"c", "d", "e"} and all(sum(a["histogram"]) == a["drafts"] > 0 for a in bundled.values())
    assert bundled["e"]["window"] == res["a10g"]["window"] and bundled["d"]["window"] is None
    # the projections of one source use the same acceptance in every category: identical MAL per row
    for src in ("from_bundled", "from_seed_mal"):
        for r in "cde":
            mals = {round(x["mal"], 9) for x in res["a10g"][src] if x["row"] == r}
            assert len(mals) == 1
    assert {round(x["mal"], 9) for x in res["a10g"]["from_seed_mal"] if x["row"] in "cde"} == {5.03}
