"""Our engine as a row of the engine table: `specquant serve` for the latency protocol, and the rows run in this
process by build_engine, timed as the other engines time theirs (each prompt alone, warm-up rounds untimed, end to
end around each generate call), so an outside engine's rows have ours beside them on the same prompts."""

from __future__ import annotations

import sys
import time
from pathlib import Path

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
    """Every row on every prompt, greedy with EOS ignored; rows interleaved prompt by prompt within each round, so
    load from other processes hits them alike. runtime: a RuntimeConfig (default: ours, fp32)."""
    from specquant.spec_decode.build import build_engine
    from specquant.spec_decode.config import SpecConfig
    from specquant.spec_decode.runtime import RuntimeConfig

    runtime = (runtime or RuntimeConfig()).validate()
    engines, result = {}, {}
    for r in rows:
        try:
            engines[r.id] = build_engine(r.target, _draft(r), runtime, SpecConfig(draft_len=r.k))
        except SpecquantError as e:
            result[r.id] = EngineRun(error=str(e))
            continue
        result[r.id] = EngineRun(latency_s=[[] for _ in prompts], dtype=str(runtime.dtype),
                                 drafter="" if r.draft is None else _draft(r), k=r.k if r.draft else 0)
    totals = {name: {} for name in engines}
    for rep in range(warmup + runs):
        for i, prompt in enumerate(prompts):
            ids = torch.tensor([prompt])
            for name, engine in engines.items():
                t0 = time.perf_counter()
                res = engine.generate(ids, max_tokens, stop_on_eos=False)
                seconds = time.perf_counter() - t0
                run = result[name]
                if res.spec is not None:
                    _add(totals[name], res.spec)
                if rep >= warmup:
                    run.latency_s[i].append(seconds)
                    if rep == warmup:
                        run.tokens.append(res.token_ids[0])
        log(f"specquant: round {rep + 1}/{warmup + runs} done")
    for name, t in totals.items():
        result[name].counters = t or None
    return result


def _add(total: dict, m) -> None:
    """vLLM's counter names, summed over requests."""
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        total[key] = total.get(key, 0) + getattr(m, key)
    per = total.setdefault("num_accepted_tokens_per_pos", [])
    per.extend([0] * (len(m.num_accepted_tokens_per_pos) - len(per)))
    for i, v in enumerate(m.num_accepted_tokens_per_pos):
        per[i] += v
