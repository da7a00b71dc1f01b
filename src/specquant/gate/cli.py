"""`specquant gate`: MMLU-Pro, IFEval, GPQA-Diamond (lm-eval's own tasks and scorers, on local files) and the kl
gate, for a model against thresholds or a baseline. Exit code 0: every gate passed; 1: a gate failed; 2: bad input."""

from __future__ import annotations

import dataclasses

from specquant.util.flags import add_config_flags, config_from_args, print_json
from specquant.gate.config import ALL_GATES, BackendConfig, GateConfig

DEFAULT_OUT = "runs/gate"


def add_parser(sub):
    p = sub.add_parser("gate", help="quality gates through lm-evaluation-harness (offline) and the kl gate",
                       description=__doc__)
    p.add_argument("--model", default=None, help="checkpoint directory or bundled name to gate")
    p.add_argument("--draft", default=None, help="draft checkpoint: generate speculatively (lossless when greedy)")
    p.add_argument("--baseline", default=None, help="baseline checkpoint (ratio thresholds and the kl gate)")
    p.add_argument("--server", default=None, help="gate an OpenAI-compatible server instead (e.g. http://127.0.0.1:8000)")
    p.add_argument("--model-name", default=None, help="the model name the server serves")
    p.add_argument("--baseline-server", default=None, help="the baseline's OpenAI-compatible server")
    p.add_argument("--baseline-model-name", default=None, help="the model name the baseline server serves")
    p.add_argument("--tasks", default=",".join(GateConfig.tasks),
                   help=f"comma-separated gates from {', '.join(ALL_GATES)} (default: %(default)s)")
    p.add_argument("--data-dir", default=None,
                   help="folder with mmlu_pro/, ifeval/, gpqa_diamond/ in the Hub datasets' schemas (default: the "
                        "bundled fixtures; docs/GATES.md)")
    p.add_argument("--thresholds", default=None, help="JSON file of thresholds (default: the seed's ratios)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default: {DEFAULT_OUT})")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out this command did not create")
    p.add_argument("--kl-text", default=None, help="held-out text for the kl gate (default: the bundled held-out set)")
    add_config_flags(p, GateConfig)
    add_config_flags(p, BackendConfig)
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    return p


def run(args) -> int:
    from specquant.gate.run import Subject, run_gates
    from specquant.gate.thresholds import load_thresholds

    tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    cfg = config_from_args(GateConfig, args, tasks=tasks)
    backend = dataclasses.replace(config_from_args(BackendConfig, args), target=args.model or "")
    model = Subject("model", args.model, args.draft, args.server, args.model_name)
    baseline = None
    if args.baseline or args.baseline_server:
        baseline = Subject("baseline", args.baseline, None, args.baseline_server, args.baseline_model_name)
    rules = load_thresholds(args.thresholds, cfg.default_thresholds)
    log = (lambda *a: None) if args.json else print
    summary = run_gates(cfg, backend, model, baseline, rules, args.data_dir, args.out, args.overwrite, args.kl_text,
                        log)
    if args.json:
        print_json({k: v for k, v in summary.items() if k != "table"})
    else:
        print()
        print(summary["table"])
        verdict = "every gate passed" if summary["passed"] else "a gate FAILED"
        print(f"\n{verdict}; results: {summary['out']}/results.json, lm-eval logs: {summary['out']}/model/")
    return summary["exit_code"]
