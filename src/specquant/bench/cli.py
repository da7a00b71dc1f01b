"""`specquant bench`: the ablation (a)-(e) plus the transformers comparison, written to --out.

Parses the flags (built from BenchConfig and the configs it holds) and calls ablation.run_bench, which checks every
input before anything is written; quantized inputs that are not given are produced (AWQ target, GPTQ draft by
default) and cached in --out/cache/. --draft-window is the window of row (e).
"""

from __future__ import annotations

import sys
from pathlib import Path

from specquant.bench.config import BenchConfig
from specquant.engines import NAMES, engine
from specquant.util.device import DEVICES
from specquant.util.flags import add_config_flags, config_from_args, print_json


def add_parser(sub):
    p = sub.add_parser("bench", help="latency/acceptance ablation: W4 target, W4 draft, sliding window",
                       description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="high-precision target: checkpoint directory or bundled name")
    p.add_argument("--draft", required=True, help="high-precision draft: checkpoint directory or bundled name")
    p.add_argument("--quantized-target", default=None, help="W4 target checkpoint (default: AWQ it into --out/cache)")
    p.add_argument("--quantized-draft", default=None, help="W4 draft checkpoint (default: GPTQ it into --out/cache)")
    p.add_argument("--qad-target", default=None, help="W4 + QAD target checkpoint for row (q) and the draft rows "
                                                      "(default: regen + distill target into --out/cache)")
    p.add_argument("--block-draft", default=None, help="block drafter (DFlashDraftModel dir or bundled name, e.g. "
                                                        "tiny-block-draft) for rows (f)-(h); default: no block rows")
    p.add_argument("--quantized-block-draft", default=None,
                   help="its W4 checkpoint (default: GPTQ it on the rows' target features into --out/cache)")
    add_config_flags(p, BenchConfig)
    p.add_argument("--pruned-target", default=None,
                   help="a vocabulary-pruned target (specquant quantize --prune-vocab N) for row (v): LOSSY, so "
                        "reported with its kl gate against --target, never as the same tokens")
    p.add_argument("--device", choices=DEVICES, default="cpu")
    p.add_argument("--json", action="store_true", help="print one JSON summary line instead of the table")
    p.add_argument("--engine", choices=NAMES, default="specquant",
                   help="engine that runs the rows: ours (the ablation), llama.cpp's tools on the exported GGUF "
                        "files, or vLLM on our --for vllm export beside our engine (engines/)")
    p.add_argument("--llama-cpp", default=None, metavar="DIR",
                   help="llama.cpp binaries for --engine llama.cpp (default: the build cache, built on first use)")
    return p


def run_llama_cpp(cfg: BenchConfig, args, log) -> int:
    """The ablation rows inside llama.cpp (bench/llama_cpp.py), on the same checked inputs; greedy only."""
    from specquant.bench.llama_cpp import format_table, run_bench

    result = run_bench(cfg, args.target, args.draft, args.quantized_target, args.quantized_draft, args.llama_cpp,
                       log, args.block_draft, args.quantized_block_draft)
    if args.json:
        print_json(result)
    else:
        print(format_table(result))
    return 0


def run_engine(cfg: BenchConfig, args, log) -> int:
    """An outside engine's rows beside ours (bench/engines.py)."""
    from specquant.bench.engines import format_table, run_bench

    result = run_bench(cfg, args.engine, args.target, args.draft, args.quantized_target, args.quantized_draft, log,
                       args.block_draft)
    if args.json:
        print_json(result)
    else:
        print(format_table(result))
    return 0


def run(args) -> int:
    from specquant.bench.ablation import run_bench
    from specquant.bench.report import summary, summary_table

    cfg = config_from_args(BenchConfig, args)
    log = (lambda msg: print(msg, file=sys.stderr)) if args.json else print
    if args.engine != "specquant":  # an engine with rows of its own (llama.cpp), or the shared comparison
        return run_engine(cfg, args, log) if engine(args.engine).run_rows else run_llama_cpp(cfg, args, log)
    results, files = run_bench(cfg, args.target, args.draft, args.quantized_target, args.quantized_draft,
                               args.device, log, args.qad_target, args.block_draft, args.quantized_block_draft,
                               pruned_target=args.pruned_target)
    if args.json:
        print_json(summary(results, files))
    else:
        print(summary_table(results))
        print(f"report: {Path(cfg.out) / 'report.md'} (all numbers in results.json, plots *.png)")
    return 0
