"""vLLM against our engine on the bundled pairs exported for vLLM: per drafter kind, vLLM's speculative counters
beside ours (counted as vLLM counts: export/vllm_engine.counters_as_vllm) and whether the greedy tokens agree.
Needs .venv-vllm (bash scripts/setup_vllm.sh). Prints a table, then one JSON line.

  python benchmarks/vllm_acceptance.py [--new-tokens 24] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from specquant.export.vllm_engine import bundled_engines, counters_as_vllm, greedy_gaps, run_vllm
from specquant.loader import load_model
from specquant.spec_decode.build import build_engine
from specquant.spec_decode.config import SpecConfig
from specquant.spec_decode.runtime import RuntimeConfig

PROMPTS = [[5, 17, 301, 42, 99, 7], [100, 200, 300, 400], [11, 12, 13, 14, 15, 16, 17, 18]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--work", default=None, help="where the exports go (default: a temporary directory)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="vllm-acceptance-") as tmp:
        root = Path(args.work or tmp)
        root.mkdir(parents=True, exist_ok=True)
        engines, ours = bundled_engines(root)
        result = run_vllm(engines, PROMPTS, args.new_tokens)
        rows = []
        for spec in engines:
            name, out = spec["name"], result["engines"][spec["name"]]
            target, draft, k = ours[name]
            row = {"engine": name, "vllm_dtype": spec["dtype"], "k": k}
            if "tokens" not in out:
                rows.append({**row, "vllm": out.get("error") or out.get("skipped")})
                continue
            engine = build_engine(target, draft, RuntimeConfig(dtype="float32"), SpecConfig(draft_len=k))
            model = load_model(target, torch.float32)
            gaps = [g for p, t in zip(PROMPTS, out["tokens"]) for g in greedy_gaps(model, p, t)]
            row.update(vllm=out["counters"], ours=counters_as_vllm(engine, PROMPTS, args.new_tokens, k),
                       tokens_our_argmax=sum(g == 0 for g in gaps) / len(gaps), max_gap=max(gaps),
                       vllm_start_s=out["start_s"])
            rows.append(row)
    print(f"{'engine':<14} {'dtype':<9} {'k':>3} {'drafts v/o':>11} {'accepted v/o':>13} {'rate v/o':>12} "
          f"{'argmax':>7}  accepted per position (vLLM | ours)")
    for r in rows:
        if "ours" not in r:
            print(f"{r['engine']:<14} {r['vllm_dtype']:<9} {r['k']:>3}  {r['vllm']}")
            continue
        v, o = r["vllm"], r["ours"]
        rate = lambda c: c["num_accepted_tokens"] / max(1, c["num_draft_tokens"])  # noqa: E731
        print(f"{r['engine']:<14} {r['vllm_dtype']:<9} {r['k']:>3} {v['num_drafts']:>5}/{o['num_drafts']:<5} "
              f"{v['num_accepted_tokens']:>6}/{o['num_accepted_tokens']:<6} {rate(v):>5.3f}/{rate(o):<6.3f} "
              f"{r['tokens_our_argmax']:>7.1%}  {v['num_accepted_tokens_per_pos'][:4]} | "
              f"{o['num_accepted_tokens_per_pos'][:4]}")
    print(json.dumps({"vllm": result["vllm"], "wna16": result["wna16"], "new_tokens": args.new_tokens,
                      "rows": rows}))


if __name__ == "__main__":
    main()
