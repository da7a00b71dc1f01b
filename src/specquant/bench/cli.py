"""`specquant bench`: the ablation (a)-(e) plus the transformers comparison, written to --out.

Everything the user passes is checked before anything is written: checkpoints, the prompts file, the config ranges
and the output path. Quantized inputs that are not given are produced (AWQ target, GPTQ draft by default) and
cached in --out/cache/.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from specquant.bench.config import DTYPES, BenchConfig
from specquant.cliutil import add_config_flags, config_from_args
from specquant.errors import SpecquantError

HELPS = {
    "draft_window": "drafter sliding window W for row (e)",
    "prompts": 'JSONL of {"id","category","text"} replacing the packaged prompts',
    "max_new_tokens": "new tokens per request (EOS ignored)",
    "runs": "timed runs per prompt and row (median reported)",
    "warmup": "untimed runs first",
    "temperature": "sampling temperature; 0 = greedy",
    "draft_len": "draft tokens per verify step (k)",
    "prompts_per_length": "prompts per length category (first N in the file)",
    "prompts_per_set": "prompts per content set (first N in the file)",
    "threads": "torch threads; 0 = torch's default",
    "out": "output directory",
}


def add_parser(sub):
    p = sub.add_parser("bench", help="latency/acceptance ablation: W4 target, W4 draft, sliding window",
                       description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="high-precision target: checkpoint directory or bundled name")
    p.add_argument("--draft", required=True, help="high-precision draft: checkpoint directory or bundled name")
    p.add_argument("--quantized-target", default=None, help="W4 target checkpoint (default: AWQ it into --out/cache)")
    p.add_argument("--quantized-draft", default=None, help="W4 draft checkpoint (default: GPTQ it into --out/cache)")
    add_config_flags(p, BenchConfig, HELPS)
    p.add_argument("--dtype", choices=DTYPES, default=BenchConfig.dtype, help="activation dtype of every row")
    p.add_argument("--no-hf-compare", dest="hf_compare", action="store_false", default=BenchConfig.hf_compare,
                   help="skip the transformers generate(assistant_model=...) row")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--json", action="store_true", help="print one JSON summary line instead of the table")
    return p


def check_out(out: Path):
    if out.exists() and not out.is_dir():
        raise SpecquantError(f"--out {str(out)!r} is a file; pass a directory (it is created if missing)")


def validate(cfg: BenchConfig, target, draft, quantized_target=None, quantized_draft=None, device="cpu"):
    """Every check that needs no model run; raises SpecquantError. Returns the resolved checkpoint paths."""
    from specquant.bench.ablation import check_inputs, quant_config_for
    from specquant.bench.prompts import read_jsonl

    cfg.validate()
    if device == "cuda" and not torch.cuda.is_available():
        raise SpecquantError("--device cuda requested but no CUDA device is visible; use --device cpu")
    paths = check_inputs(target, draft, quantized_target, quantized_draft)
    if cfg.prompts:
        read_jsonl(Path(cfg.prompts).expanduser())
    if quantized_target is None:
        quant_config_for(cfg.target_method, cfg.quant_overrides_for("target"))
    if quantized_draft is None:
        quant_config_for(cfg.draft_method, cfg.quant_overrides_for("draft"))
    check_out(Path(cfg.out))
    return paths


def prepare_quantized(cfg: BenchConfig, paths: dict[str, Path], log=print) -> dict:
    """Fill paths["quantized_target"/"quantized_draft"], quantizing into out/cache what was not given."""
    from specquant.bench.ablation import quantized_checkpoint

    info = {}
    cache = Path(cfg.out) / "cache"
    for role, method in (("target", cfg.target_method), ("draft", cfg.draft_method)):
        key = f"quantized_{role}"
        if key in paths:
            info[key] = str(paths[key])
            continue
        paths[key], info[key] = quantized_checkpoint(paths[role], role, method, cfg.quant_overrides_for(role), cache)
        how = f"quantized in {info[key]['seconds']:.1f} s" if info[key]["produced"] else "reused: same source, config"
        log(f"W4 {role}: {method.upper()} -> {cache / role} ({how})")
    return info


def measure_and_report(cfg: BenchConfig, paths: dict[str, Path], quantized: dict, device="cpu"):
    """Run every row and write the outputs; returns (results, written files)."""
    from specquant.bench.ablation import run_ablation
    from specquant.bench.report import write_report

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    results = run_ablation(cfg, paths, torch.device(device))
    results["quantized"] = quantized
    files = write_report(results, Path(cfg.out))
    return results, files


def summary(results: dict, files) -> dict:
    rows = []
    for r in results["rows"]:
        row = {"id": r["id"], "name": r["name"], "status": r["status"]}
        if r["status"] == "ok":
            row.update(latency_avg_s=r["latency_avg_s"], speedup_avg=r["speedup_avg"],
                       speedups={c: e["speedup"] for c, e in r["categories"].items()},
                       predicted_speedup_avg=r.get("predicted_speedup_avg"),
                       mean_acceptance_length={s: a["mean_acceptance_length"]
                                               for s, a in r.get("acceptance", {}).items()})
        else:
            row["reason"] = r["reason"]
        rows.append(row)
    return {"benchmark": "bench", "out": str(Path(files[0]).parent), "files": [str(f) for f in files], "rows": rows}


def run(args) -> int:
    from specquant.bench.report import summary_table

    cfg = config_from_args(BenchConfig, args)
    paths = validate(cfg, args.target, args.draft, args.quantized_target, args.quantized_draft, args.device)
    log = (lambda msg: print(msg, file=sys.stderr)) if args.json else print
    quantized = prepare_quantized(cfg, paths, log)
    results, files = measure_and_report(cfg, paths, quantized, args.device)
    if args.json:
        print(json.dumps(summary(results, files), default=float))
    else:
        print(summary_table(results))
        print(f"report: {Path(cfg.out) / 'report.md'} (all numbers in results.json, plots *.png)")
    return 0
