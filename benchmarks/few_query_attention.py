"""Few-query attention on CPU: torch's SDPA vs a grouped-matmul formulation, 1..16 queries over a KV cache.

The Qwen3-0.6B attention shape (16 query heads, 8 KV heads, head_dim 128), fp32, contexts --contexts; the T queries
sit at the end of the context under a causal mask (as in a verify step). Candidate `grouped`: the g = heads /
kv_heads query heads sharing a KV head and the T queries form one [g·T, d] matrix per KV head, so K and V are read
once per KV head for all of them (two matmuls and a softmax). Each is checked against SDPA (max abs error printed)
and timed interleaved, --layers calls per sample (one per layer), median of --reps, CPU time of the process.
Usage: python benchmarks/few_query_attention.py [--contexts 128,1024] [--threads 1]; a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F


def grouped(q, k, v, mask):
    b, h, t, d = q.shape
    kv, s = k.shape[1], k.shape[2]
    g = h // kv  # SDPA's enable_gqa: query head i uses KV head i // g
    scores = torch.matmul(q.reshape(b, kv, g * t, d), k.transpose(-1, -2)).mul_(d**-0.5)
    if mask is not None:
        scores = scores.view(b, kv, g, t, s).masked_fill_(~mask, float("-inf")).view(b, kv, g * t, s)
    p = torch.softmax(scores, -1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(p, v).view(b, h, t, d)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="128,1024")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    print(f"{'context':>7} {'T':>3} {'sdpa us':>8} {'grouped us':>10} {'sdpa vs T=1':>11} {'max err':>8}")
    with torch.inference_mode():
        for s in (int(c) for c in args.contexts.split(",")):
            base = None
            for t in (int(r) for r in args.rows.split(",")):
                q = torch.randn(1, 16, t, 128)
                k, v = torch.randn(1, 8, s + t, 128), torch.randn(1, 8, s + t, 128)
                mask = (torch.arange(s + t)[None] <= torch.arange(s, s + t)[:, None]) if t > 1 else None
                fns = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
                       "grouped": lambda: grouped(q, k, v, mask)}
                err = float((fns["sdpa"]() - fns["grouped"]()).abs().max())
                samples = {n: [] for n in fns}
                for _ in range(args.reps):
                    for n, fn in fns.items():
                        t0 = time.process_time()
                        for _ in range(args.layers):
                            fn()
                        samples[n].append((time.process_time() - t0) / args.layers * 1e6)
                row = {"context": s, "queries": t, **{f"{n}_us": statistics.median(v) for n, v in samples.items()},
                       "max_abs_err": err}
                base = base or row["sdpa_us"]
                row["sdpa_vs_one_query"] = row["sdpa_us"] / base
                results.append(row)
                print(f"{s:>7} {t:>3} {row['sdpa_us']:8.0f} {row['grouped_us']:10.0f} "
                      f"{row['sdpa_vs_one_query']:10.2f}x {err:8.1e}", flush=True)
    print(json.dumps({"benchmark": "few_query_attention", "threads": args.threads, "results": results}))


if __name__ == "__main__":
    main()
