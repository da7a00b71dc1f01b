"""Few-query attention on CPU: the decoder's reference path (SDPA with enable_gqa), its folded path and an explicit
matmul path, 1..16 queries, beside the arithmetic floor.

A verify step of speculative decoding attends k+1 queries over the KV cache. Per step of --layers layers:
- `sdpa` (reference, as before): each layer builds the [T, S] causal mask and calls SDPA with enable_gqa, which
  reads K/V once per query head;
- `folded` (Attention.fold in model/decoder.py): the mask is built once per step in the folded row order and every
  layer calls SDPA on q viewed as [batch, kv_heads, g*T, head_dim], so K/V are read once per KV head;
- `matmul`: the same folded rows as explicit batched matmuls per KV head (Q·Kᵀ with the additive mask and the
  scale in one baddbmm, softmax in fp32, ·V in one bmm), the mask built once per step as an additive bias.
Shapes: Qwen3-0.6B (16 query heads, 8 KV heads, head_dim 128, 28 layers) and the bundled target (6 / 2 / 64,
8 layers); the T queries sit at the end of the context, K/V are a slice of a larger static buffer (as in the sliced
cache), q is non-contiguous (as after RoPE). Each path is checked against sdpa (max abs error), timed interleaved,
median of --reps, CPU time of the process, reported per layer. `vs 1q` = cost / the same path's 1-query cost;
`best vs 1q` = the fastest path at T / the fastest path at 1 query.
Floor: `floor vs 1q` = max(1, T-query multiply-adds (2·heads·T·S·head_dim) at this core's GEMM peak / the fastest
1-query time), the peak measured in the same run (a 512³ matmul in --dtype, CPU time). It is optimistic: the
1-query cost (K/V reads, per-call work) is taken as fully hidden under the arithmetic. Where it exceeds 1.5, "T
queries within 1.5x of one" cannot be met by any exact kernel on one core.
Usage: taskset -c 0 python benchmarks/few_query_attention.py [--contexts 64,256,1024] [--threads 1]
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from specquant.model.decoder import attention_mask

SHAPES = {"qwen3-0.6b": (16, 8, 128, 28), "tiny-target": (6, 2, 64, 8)}  # heads, kv_heads, head_dim, layers


def step_fns(heads, kv, d, layers, s, t, dtype):
    """The two paths' attention for one step of `layers` layers, T = t queries over s + t keys."""
    g = heads // kv
    qs = [torch.randn(1, t, heads, d, dtype=dtype).transpose(1, 2) for _ in range(layers)]
    bufs = [(torch.randn(1, kv, s + t + 64, d, dtype=dtype), torch.randn(1, kv, s + t + 64, d, dtype=dtype))
            for _ in range(layers)]
    kvs = [(k[:, :, : s + t], v[:, :, : s + t]) for k, v in bufs]

    def sdpa():
        out = []
        for q, (k, v) in zip(qs, kvs):
            mask = attention_mask(s, t, 0, s + t, None, "cpu")
            out.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))
        return out

    def folded():
        mask, out = attention_mask(s, t, 0, s + t, None, "cpu", g), []
        for q, (k, v) in zip(qs, kvs):
            o = F.scaled_dot_product_attention(q.reshape(1, kv, g * t, d), k, v, attn_mask=mask)
            out.append(o.reshape(1, heads, t, d))
        return out

    def matmul():
        mask, out = attention_mask(s, t, 0, s + t, None, "cpu", g), []
        bias = torch.zeros(g * t, s + t) if mask is None else torch.zeros(mask.shape).masked_fill_(~mask, -torch.inf)
        for q, (k, v) in zip(qs, kvs):
            scores = torch.baddbmm(bias, q.reshape(kv, g * t, d).float(), k[0].transpose(1, 2).float(),
                                   alpha=d ** -0.5)  # [kv, g*T, S]
            o = torch.bmm(torch.softmax(scores, dim=-1).to(dtype), v[0])  # [kv, g*T, d]
            out.append(o.reshape(1, heads, t, d))
        return out

    return {"sdpa": sdpa, "folded": folded, "matmul": matmul}


def peak_macs_per_s(dtype, n: int = 512, reps: int = 9) -> float:
    """This core's GEMM multiply-adds per second: the best CPU time of an n³ matmul in dtype."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    times = []
    for _ in range(2 + reps):
        t0 = time.process_time()
        a @ b
        times.append(time.process_time() - t0)
    return n**3 / min(times[2:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3-0.6b,tiny-target")
    ap.add_argument("--contexts", default="64,256,1024")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    results = []
    with torch.inference_mode():
        peak = peak_macs_per_s(dtype)
        print(f"GEMM peak, 512^3 {args.dtype}, {args.threads} thread(s): {peak / 1e9:.1f} GMAC/s")
        print(f"{'shape':<12} {'context':>7} {'T':>3} {'sdpa us':>8} {'folded us':>9} {'matmul us':>9} "
              f"{'folded/sdpa':>11} {'matmul/fold':>11} {'folded vs 1q':>12} {'best vs 1q':>10} "
              f"{'floor vs 1q':>11} {'GMAC/s':>6} {'max err':>8}")
        for shape in args.shapes.split(","):
            heads, kv, d, layers = SHAPES[shape]
            for s in (int(c) for c in args.contexts.split(",")):
                one = None
                for t in (int(r) for r in args.rows.split(",")):
                    fns = step_fns(heads, kv, d, layers, s, t, dtype)
                    ref = fns["sdpa"]()
                    err = {n: max(float((a.float() - b.float()).abs().max()) for a, b in zip(ref, fns[n]()))
                           for n in ("folded", "matmul")}
                    samples = {n: [] for n in fns}
                    for _ in range(args.reps):
                        for n, fn in fns.items():
                            t0 = time.process_time()
                            fn()
                            samples[n].append((time.process_time() - t0) / layers * 1e6)
                    us = {n: statistics.median(v) for n, v in samples.items()}
                    one = one or dict(us, best=min(us.values()))
                    macs = 2 * heads * t * (s + t) * d  # Q·Kᵀ and P·V, per layer
                    floor = max(1.0, macs / peak * 1e6 / one["best"])
                    row = {"shape": shape, "context": s, "queries": t, "sdpa_us": us["sdpa"],
                           "folded_us": us["folded"], "matmul_us": us["matmul"],
                           "folded_vs_sdpa": us["folded"] / us["sdpa"], "matmul_vs_folded": us["matmul"] / us["folded"],
                           "sdpa_vs_one_query": us["sdpa"] / one["sdpa"],
                           "folded_vs_one_query": us["folded"] / one["folded"],
                           "matmul_vs_one_query": us["matmul"] / one["matmul"],
                           "best_vs_best_one_query": min(us.values()) / one["best"], "floor_vs_one_query": floor,
                           "best_macs_per_s": macs / min(us.values()) * 1e6,
                           "max_abs_err": max(err.values())}
                    results.append(row)
                    print(f"{shape:<12} {s:>7} {t:>3} {us['sdpa']:8.1f} {us['folded']:9.1f} {us['matmul']:9.1f} "
                          f"{row['folded_vs_sdpa']:10.2f}x {row['matmul_vs_folded']:10.2f}x "
                          f"{row['folded_vs_one_query']:11.2f}x {row['best_vs_best_one_query']:9.2f}x "
                          f"{floor:10.2f}x {row['best_macs_per_s'] / 1e9:6.1f} {row['max_abs_err']:8.1e}", flush=True)
    print(json.dumps({"benchmark": "few_query_attention", "threads": args.threads, "dtype": args.dtype,
                      "gemm_peak_macs_per_s": peak, "results": results}))


if __name__ == "__main__":
    main()
