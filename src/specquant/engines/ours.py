"""Our engine as a row of the engine table: `specquant serve` for the latency protocol, and the rows run in this
process by build_engine, timed as the other engines time theirs (each prompt alone, warm-up rounds untimed, end to
end around each generate call), so an outside engine's rows have ours beside them on the same prompts."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from specquant.engines import EngineRun, RowPair, Server
from specquant.errors import SpecquantError

NAME = "specquant"
MODEL_FREE = "suffix"  # our model-free drafter: what a row's "model-free" drafter runs here


def check() -> None:
    return None  # this package


def _draft(pair: RowPair) -> str:
    if pair.draft is None:
        return "none"
    return MODEL_FREE if pair.draft == "model-free" else str(pair.draft)


def server(pair: RowPair, workdir: Path, port: int, host: str, threads: int = 0, context: int = 0) -> Server:
    """`specquant serve` of the pair in a process of its own, as a user starts it (context: ours serves the
    model's own; the argument is for engines that must be told)."""
    argv = [sys.executable, "-m", "specquant.cli", "serve", "--target", str(pair.target), "--draft", _draft(pair),
            "--draft-len", str(pair.k), "--host", host, "--port", str(port), "--model-name", pair.id]
    if threads:
        argv += ["--threads", str(threads)]
    return Server(argv, {}, f"specquant serve ({pair.name})")


@torch.no_grad()
def run_rows(rows: list[RowPair], prompts: list[list[int]], max_tokens: int, warmup: int, runs: int,
             workdir: Path | None = None, log=print, runtime=None) -> dict[str, EngineRun]:
    """Every row on every prompt, greedy with EOS ignored, through the bench's interleaved loop (rows take turns
    prompt by prompt within each round, so load from other processes hits them alike). Counters are summed over
    every round, warm-up included, as vLLM's engine counts its own. runtime: a RuntimeConfig (default: ours, fp32)."""
    from specquant.decode.sampling import SamplingConfig
    from specquant.engines.timing import interleaved, ours_speculative
    from specquant.spec_decode.build import build_engine
    from specquant.spec_decode.config import SpecConfig
    from specquant.spec_decode.runtime import RuntimeConfig

    runtime = (runtime or RuntimeConfig()).validate()
    runners, result, totals = {}, {}, {}
    for r in rows:
        try:
            engine = build_engine(r.target, _draft(r), runtime, SpecConfig(draft_len=r.k))
        except SpecquantError as e:
            result[r.id] = EngineRun(error=str(e))
            continue
        result[r.id] = EngineRun(dtype=str(runtime.dtype), drafter="" if r.draft is None else _draft(r),
                                 k=r.k if r.draft else 0)
        runners[r.id] = _counted(ours_speculative(engine, max_tokens, SamplingConfig()), totals.setdefault(r.id, {}))
    numbered = [SimpleNamespace(id=i, ids=ids) for i, ids in enumerate(prompts)]
    samples = interleaved(runners, numbered, warmup + runs, warmup, torch.device(runtime.device), desc="specquant")
    for name, per_prompt in samples.items():
        run = result[name]
        run.latency_s = [[s.latency_s for s in per_prompt[p.id]] for p in numbered]
        run.tokens = [list(per_prompt[p.id][0].tokens) for p in numbered]
        run.counters = totals[name] or None
    log(f"specquant: {warmup + runs} rounds of {len(runners)} rows done")
    return result


def _counted(runner, total: dict):
    """The runner, adding each request's counters to `total` (warm-up requests too)."""
    def run(ids):
        sample = runner(ids)
        if sample.spec is not None:
            _add(total, sample.spec)
        return sample
    return run


def _add(total: dict, m) -> None:
    """vLLM's counter names, summed over requests."""
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        total[key] = total.get(key, 0) + getattr(m, key)
    per = total.setdefault("num_accepted_tokens_per_pos", [])
    per.extend([0] * (len(m.num_accepted_tokens_per_pos) - len(per)))
    for i, v in enumerate(m.num_accepted_tokens_per_pos):
        per[i] += v
