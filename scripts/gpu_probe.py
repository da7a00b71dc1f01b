"""Probe: Triton W4 kernel time per call under CUDA-graph replay (no launch overhead), dot vs gemv, rows 1-16;
then W4 4B decode and verify steps with GEMV_MAX_ROWS 0 / 1 / 16."""
import json, os, statistics, sys, time
import torch
sys.path.insert(0, "benchmarks")  # run from the repo root: python scripts/gpu_probe.py
import gpu as G
from specquant.quant import triton_w4
from specquant.quant.linear import QuantLinear
dev = torch.device("cuda")
res = {}
model = G.build("target", G.SHAPES, dev, G.W4)
def graph_us(f, calls=20, reps=5):
    f(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            f()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); g.replay(); torch.cuda.synchronize(); ts.append((time.perf_counter() - t0) / calls)
    return statistics.median(ts) * 1e6
seen, rows_out = set(), []
for m in model.modules():
    if not isinstance(m, QuantLinear) or (m.out_features, m.in_features) in seen:
        continue
    seen.add((m.out_features, m.in_features))
    w = torch.empty(m.out_features, m.in_features, dtype=torch.bfloat16, device=dev).normal_()
    for r in (1, 2, 4, 8, 16):
        x = torch.randn(r, m.in_features, dtype=torch.bfloat16, device=dev)
        row = {"shape": f"{m.out_features}x{m.in_features}", "rows": r, "bf16": graph_us(lambda: x @ w.T)}
        for gemv in (False, True):
            for bn in (32, 64, 128):
                for warps in (4, 8):
                    row[f"{'gemv' if gemv else 'dot'}_bn{bn}_w{warps}"] = graph_us(lambda: triton_w4.w4a16_matmul(
                        x, m.weight_packed, m.weight_scale, m.weight_zero_point, m.bits, m.group_size,
                        block_n=bn, num_warps=warps, gemv=gemv))
        best = min((v, k) for k, v in row.items() if k not in ("shape", "rows", "bf16"))
        print(row["shape"], r, "bf16 %.1f" % row["bf16"], "dot64w4 %.1f" % row["dot_bn64_w4"], "gemv64w4 %.1f" % row["gemv_bn64_w4"], "best %s %.1f" % (best[1], best[0]), flush=True)
        rows_out.append(row)
    del w
res["kernel"] = rows_out
json.dump(res, open(os.environ["OUT"] + "/probe.json", "w"), indent=1)
for gm in (0, 1, 16):
    triton_w4.GEMV_MAX_ROWS = gm
    r = G.measure_model(model, dev, 256, 64, 8, 3, 10, False)
    res[f"decode_gemv_max_{gm}"] = {"tok_s": r["decode_tokens_per_s"], "step_ms": r["step_ms"]}
    print("GEMV_MAX_ROWS", gm, "decode tok/s %.1f" % r["decode_tokens_per_s"], {t: round(v, 3) for t, v in r["step_ms"].items()}, flush=True)
    json.dump(res, open(os.environ["OUT"] + "/probe.json", "w"), indent=1)
