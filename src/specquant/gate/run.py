"""One gate run: check the inputs, run lm-eval on the model (and baseline), the kl gate, decide, write the outputs.

Output folder (written to a temporary folder beside it, then renamed):
    results.json          the gates, their values, thresholds, pass/fail, lm-eval's headline metrics, settings
    gates.md              the pass/fail table
    tasks/                the task overrides (`lm_eval --include_path OUT/tasks ...` reruns them)
    model/, baseline/     lm-eval's own results_*.json and samples_<task>_*.jsonl
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import time
from dataclasses import dataclass
from pathlib import Path

from specquant.errors import SpecquantError
from specquant.gate import datasets as local
from specquant.gate.config import GATE_RUNTIME, KL_GATE, LM_EVAL_GATES, BackendConfig, GateConfig
from specquant.gate.kl import kl_gate
from specquant.gate.thresholds import GateResult, decide_score, exit_code, metric_of, needs_baseline, table

@dataclass
class Subject:
    """What is evaluated: a local checkpoint (+ draft) through the specquant backend, or an OpenAI-compatible server."""

    label: str
    model: str | None = None
    draft: str | None = None
    server: str | None = None
    model_name: str | None = None

    def describe(self) -> str:
        if self.server:
            return f"{self.model_name} at {self.server}"
        return self.model + (f" + draft {self.draft}" if self.draft else "")


def check_subject(s: Subject):
    if s.server and s.model:
        raise SpecquantError(f"{s.label}: give a checkpoint or --server URL, not both")
    if s.server:
        if not s.server.startswith(("http://", "https://")):
            raise SpecquantError(f"{s.label} server {s.server!r} is not an http(s) URL; e.g. http://127.0.0.1:8000")
        if not s.model_name:
            raise SpecquantError(f"{s.label}: --server needs the served model's name (--model-name NAME)")
        if s.draft:
            raise SpecquantError(f"{s.label}: --draft applies to local checkpoints; a server does its own drafting")
        return
    if not s.model:
        raise SpecquantError(f"{s.label}: give a checkpoint directory (or bundled name) or --server URL")
    from specquant.model.checkpoint import resolve

    resolve(s.model)
    if s.draft:
        resolve(s.draft)


def lm_eval_model(s: Subject, backend: BackendConfig, chat: bool) -> tuple[str, dict]:
    """lm-eval's model type and model_args for a subject."""
    if s.server:
        root = s.server.rstrip("/").removesuffix("/v1")
        route = "chat/completions" if chat else "completions"
        # tokenizer_backend None: the gates only generate, and the server tokenizes; nothing is fetched from a hub
        return ("local-chat-completions" if chat else "local-completions",
                {"model": s.model_name, "base_url": f"{root}/v1/{route}", "tokenizer_backend": None,
                 "tokenized_requests": False, "num_concurrent": 1, "max_retries": 2, "timeout": 600})
    # device travels as lm-eval's own `device` argument (simple_evaluate passes it to every backend)
    runtime = {k: getattr(backend.runtime, k) for k in GATE_RUNTIME}  # flat in model_args
    args = {k: v for k, v in {**dataclasses.asdict(backend), **runtime}.items()
            if v is not None and k not in ("device", "runtime")}
    args.pop("target")
    args["pretrained"] = s.model  # = target; lm-eval files its logs under the `pretrained` name
    if s.draft:
        args["draft"] = s.draft
    return "specquant", args


def run_lm_eval(s: Subject, tasks: list[str], include: list[str], cfg: GateConfig, backend: BackendConfig,
                out: Path, log) -> dict:
    """lm-eval's simple_evaluate with its own task definitions (via our include path); saves its own logs."""
    from lm_eval import simple_evaluate
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager

    model_type, model_args = lm_eval_model(s, backend, cfg.apply_chat_template)
    log(f"  lm-eval {model_type} on {s.describe()}: {', '.join(tasks)}")
    tracker = EvaluationTracker(output_path=str(out))
    t0 = time.perf_counter()
    results = simple_evaluate(
        model=model_type, model_args=model_args, tasks=tasks, limit=cfg.limit, batch_size=1, device=backend.runtime.device,
        log_samples=True, evaluation_tracker=tracker, task_manager=TaskManager(include_defaults=False,
                                                                               include_path=include),
        apply_chat_template=cfg.apply_chat_template, random_seed=cfg.seeds[0], numpy_random_seed=cfg.seeds[1],
        torch_random_seed=cfg.seeds[2], fewshot_random_seed=cfg.seeds[3])
    samples = results.pop("samples")
    tracker.save_results_aggregated(results=results, samples=samples)
    for task in results["configs"]:
        tracker.save_results_samples(task_name=task, samples=samples[task])
    results["wall_s"] = time.perf_counter() - t0
    return results


def gate_score(gate: str, rule: dict, results: dict) -> float:
    """The gated number from lm-eval's results (MMLU-Pro: unweighted mean over its subject subtasks, as the seed)."""
    spec = LM_EVAL_GATES[gate]
    metric = metric_of(gate, rule)
    task = spec["task"]
    if spec.get("mean_over_subtasks") and "metric" not in rule:
        members = results["group_subtasks"][task]
        return sum(results["results"][m][metric] for m in members) / len(members)
    row = results["results"].get(task, {})
    if metric not in row:
        known = sorted(k for k in row if not k.endswith("_stderr") and "," in k)
        raise SpecquantError(f"lm-eval reported no {metric!r} for {task}; it has {', '.join(known)}")
    return float(row[metric])


def headline(results: dict) -> dict:
    """lm-eval's own numbers per task/group (every metric, with stderr), for results.json."""
    return {name: {k: v for k, v in row.items() if k != "alias" and isinstance(v, (int, float))}
            for name, row in results["results"].items()}


def run_gates(cfg: GateConfig, backend: BackendConfig, model: Subject, baseline: Subject | None, rules: dict,
              data_dir: str | None, out: str, overwrite: bool = False, kl_text: str | None = None, log=print) -> dict:
    """Every selected gate; returns the summary written to results.json (its "exit_code": 0 pass, 1 fail)."""
    from specquant.util.files import atomic_dir, check_out_dir

    # ---- bad input first, before anything slow
    unknown = [t for t in cfg.tasks if t not in (*LM_EVAL_GATES, KL_GATE)]
    if unknown or not cfg.tasks:
        raise SpecquantError(f"unknown gate {unknown[0] if unknown else '(none)'!r} in --tasks; choose from "
                             f"{', '.join((*LM_EVAL_GATES, KL_GATE))}")
    if cfg.limit is not None and cfg.limit < 1:
        raise SpecquantError(f"--limit {cfg.limit} must be at least 1 (or omitted for every document)")
    check_subject(model)
    if baseline is not None:
        check_subject(baseline)
    for gate in cfg.tasks:
        if needs_baseline(gate, rules[gate]) and baseline is None:
            what = "compares the model with its baseline" if gate == KL_GATE else f"threshold {rules[gate]} is a ratio"
            raise SpecquantError(f"the {gate} gate {what}: pass --baseline DIR (or --baseline-server URL), or give "
                                 "absolute thresholds with --thresholds FILE")
    if KL_GATE in cfg.tasks and (model.server or (baseline and baseline.server)):
        raise SpecquantError("the kl gate reads logits from local checkpoints; drop kl from --tasks with --server")
    lm_gates = [g for g in cfg.tasks if g in LM_EVAL_GATES]
    if lm_gates and importlib.util.find_spec("lm_eval") is None:  # the main job's setup leaves lm-eval out
        raise SpecquantError(f"--tasks {','.join(lm_gates)} runs lm-eval, which is not installed in this environment: "
                             "run `bash scripts/setup.sh --test` (or `pip install -e '.[gate]'`), or use --tasks kl")
    local.offline()
    data = {g: local.locate(g, data_dir) for g in lm_gates}
    categories = None
    for g in lm_gates:
        splits = local.check_columns(g, data[g])
        if g == "mmlu_pro":
            categories = set(splits["test"]["category"])
    out_path = check_out_dir(out, overwrite)  # a non-empty folder specquant did not create needs --overwrite
    if "ifeval" in lm_gates:
        from specquant.gate.punkt import ensure_punkt

        ensure_punkt()

    from specquant.gate.tasks import include_paths, write_overrides

    summary = {"model": model.describe(), "baseline": baseline.describe() if baseline else None,
               "data_dir": str(data_dir) if data_dir else str(local.FIXTURES), "config": dataclasses.asdict(cfg),
               "backend": dataclasses.asdict(backend), "thresholds": {g: rules[g] for g in cfg.tasks}}
    rows: list[GateResult] = []
    with atomic_dir(out_path, overwrite) as tmp:
        if lm_gates:
            names = write_overrides(tmp / "tasks", data, cfg, categories)
            include = include_paths(tmp / "tasks", lm_gates)
            tasks = [names[g] for g in lm_gates]
            res = {"model": run_lm_eval(model, tasks, include, cfg, backend, tmp / "model", log)}
            if baseline is not None:
                res["baseline"] = run_lm_eval(baseline, tasks, include, cfg, backend, tmp / "baseline", log)
            summary["lm_eval"] = {who: {"wall_s": r["wall_s"], "results": headline(r),
                                        "n_samples": r.get("n-samples", {})} for who, r in res.items()}
            for g in lm_gates:
                value = gate_score(g, rules[g], res["model"])
                base = gate_score(g, rules[g], res["baseline"]) if baseline is not None else None
                rows.append(decide_score(g, rules[g], value, base))
        if KL_GATE in cfg.tasks:
            log(f"  kl: {model.model} against {baseline.model}")
            stats, kl_rows = kl_gate(model.model, baseline.model, cfg, rules[KL_GATE], kl_text,
                                    backend.runtime.dtype, backend.runtime.w4_activations)
            summary["kl"] = stats
            rows.extend(kl_rows)
        summary["gates"] = [r.to_dict() for r in rows]
        summary["exit_code"] = exit_code(rows)
        summary["passed"] = summary["exit_code"] == 0
        (tmp / "gates.md").write_text(table(rows) + "\n")
        (tmp / "results.json").write_text(json.dumps(summary, indent=2, default=float) + "\n")
    summary["table"] = table(rows)
    summary["out"] = str(out_path)
    return summary
