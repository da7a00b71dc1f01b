"""`specquant bench --engine NAME` for an engine that runs rows (engines/*.py `run_rows`, e.g. vLLM): the ablation's
pairs run inside that engine and in ours, on the same prompts with the same protocol, in one report.

Rows (the ablation's ids where the row is one of its rows; a+ rows are the high-precision target with a drafter,
which every engine runs, also where it has no W4 kernel):
  a        the high-precision target alone                  a+draft  a + the high-precision draft
  b        the W4 target alone                              c        b + the high-precision draft
  d        b + the W4 draft                                 f        b + the block drafter (with --block-draft)
  m        b + the target's own MTP layer (a target with mtp.* tensors)
  s        b + a model-free drafter: the engine's own (vLLM: prompt-lookup n-grams; ours: the suffix drafter)
Protocol, both engines: greedy, EOS ignored, max_new_tokens per request, each prompt alone (batch 1), `warmup`
untimed rounds then `runs` timed ones, each request timed end to end around its call (prefill and decode);
tok/s per prompt = max_new_tokens / the median over runs, averaged over prompts. Each engine's rows are
interleaved prompt by prompt; the two engines run one after the other (the outside one first, in its own
process), so machine load between them is not cancelled: the load average before, between and after is in the
report. Acceptance is each
engine's own counters over every round (rate = accepted / drafted; MAL = 1 + accepted / drafts). `same` counts the
prompts whose tokens the outside engine generated exactly as ours did: expected for every row where both run the
same dtype; the hybrid and W4 rows run bf16 in vLLM's CPU build (engines/vllm.py), where near-ties can flip.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from specquant.engines import EngineRun, RowPair, engine
from specquant.errors import SpecquantError


def pairs(paths: dict[str, Path], k: int, block_k: int | None, has_mtp: bool) -> list[RowPair]:
    t, w4 = paths["target"], paths["quantized_target"]
    rows = [RowPair("a", "target", t), RowPair("a+draft", "target + draft", t, paths["draft"], k),
            RowPair("b", "W4 target", w4), RowPair("c", "W4 target + draft", w4, paths["draft"], k),
            RowPair("d", "W4 target + W4 draft", w4, paths["quantized_draft"], k)]
    if block_k:
        rows.append(RowPair("f", "W4 target + block draft", w4, paths["block_draft"], block_k))
    if has_mtp:
        rows.append(RowPair("m", "W4 target + MTP draft", w4, "mtp", k))
    rows.append(RowPair("s", "W4 target + model-free draft", w4, "model-free", k))
    return rows


def tokens_per_s(run: EngineRun, max_new_tokens: int) -> float | None:
    if not run.ran or not run.latency_s:
        return None
    return statistics.fmean(max_new_tokens / statistics.median(ts) for ts in run.latency_s)


def acceptance(run: EngineRun) -> tuple[float | None, float | None]:
    """(rate, mean acceptance length) from counters; (None, None) without drafts."""
    c = run.counters or {}
    if not c.get("num_drafts"):
        return None, None
    return c["num_accepted_tokens"] / c["num_draft_tokens"], 1 + c["num_accepted_tokens"] / c["num_drafts"]


def table_rows(rows: list[RowPair], theirs: dict, ours: dict, max_new_tokens: int) -> list[dict]:
    out = []
    for r in rows:
        a, b = theirs[r.id], ours[r.id]
        their_tps, our_tps = tokens_per_s(a, max_new_tokens), tokens_per_s(b, max_new_tokens)
        (their_rate, their_mal), (our_rate, our_mal) = acceptance(a), acceptance(b)
        row = {"id": r.id, "name": r.name, "k": r.k if r.draft else 0, "engine_dtype": a.dtype,
               "engine_drafter": a.drafter, "our_drafter": b.drafter, "engine_tokens_per_s": their_tps,
               "our_tokens_per_s": our_tps, "ours_over_engine": our_tps / their_tps if their_tps and our_tps else None,
               "engine_acceptance_rate": their_rate, "our_acceptance_rate": our_rate, "engine_mal": their_mal,
               "our_mal": our_mal, "engine_counters": a.counters, "our_counters": b.counters,
               "same_tokens": sum(x == y for x, y in zip(a.tokens, b.tokens)) if a.ran and b.ran else None,
               "prompts": len(b.tokens) if b.ran else len(a.tokens)}
        for side, run in (("engine", a), ("our", b)):
            if run.skipped:
                row[f"{side}_skipped"] = run.skipped
            if run.error:
                row[f"{side}_error"] = run.error
        out.append(row)
    return out


def format_table(result: dict) -> str:
    name = result["engine"]

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    lines = [f"{'row':<30} {'k':>2} {name + ' dtype':>12} {name + ' tok/s':>11} {'ours tok/s':>10} {'ours/them':>9} "
             f"{'accept them/ours':>17} {'MAL them/ours':>14} {'same':>5}"]
    for r in result["rows"]:
        why = r.get("engine_skipped") or r.get("engine_error") or r.get("our_error")
        same = f"{r['same_tokens']}/{r['prompts']}" if r["same_tokens"] is not None else "-"
        lines.append(f"{r['name']:<30} {r['k']:>2} {r['engine_dtype'] or '-':>12} "
                     f"{f(r['engine_tokens_per_s'], '.1f'):>11} {f(r['our_tokens_per_s'], '.1f'):>10} "
                     f"{f(r['ours_over_engine'], '.2f'):>9} "
                     f"{f(r['engine_acceptance_rate'], '.1%') + ' / ' + f(r['our_acceptance_rate'], '.1%'):>17} "
                     f"{f(r['engine_mal'], '.2f') + ' / ' + f(r['our_mal'], '.2f'):>14} {same:>5}"
                     + (f"  ({why})" if why else ""))
    lines.append(f"({len(result['prompts'])} prompts x {result['max_new_tokens']} new tokens, median of "
                 f"{result['runs']} runs after {result['warmup']} warm-up, each prompt alone; model-free row: "
                 f"{name} {result['engine_model_free']} vs our {result['our_model_free']}; 1-min load average at "
                 f"the start, between the engines and at the end: {', '.join(map(str, result['load_avg']))})")
    return "\n".join(lines)


def run_bench(cfg, name: str, target, draft, quantized_target=None, quantized_draft=None, log=print,
              block_draft=None) -> dict:
    """The rows in engine `name` and in ours; writes engine-NAME.json / .md into --out and returns the result."""
    from specquant.bench.prepare import prepare_quantized, target_prompts, validate
    from specquant.engines import ours
    from specquant.export.vllm import tensor_names
    from specquant.model.block_draft import BlockDraftConfig
    from specquant.model.checkpoint import read_hf_config
    from specquant.util.files import atomic_write, claim_out_dir

    outside = engine(name)
    if outside.run_rows is None:
        raise SpecquantError(f"engine {name!r} has no rows of this kind; its bench is its own")
    if cfg.sampling.temperature != 0:
        raise SpecquantError(f"--temperature {cfg.sampling.temperature}: the {name} rows are greedy; use 0")
    outside.check()  # bad input and a missing engine fail before anything is written
    paths = validate(cfg, target, draft, quantized_target, quantized_draft, "cpu", block_draft=block_draft)
    out = claim_out_dir(cfg.out, cfg.overwrite)
    prepare_quantized(cfg, paths, log)
    block_k = (BlockDraftConfig.from_hf(read_hf_config(paths["block_draft"])).block_size - 1
               if "block_draft" in paths else None)
    has_mtp = any(n.startswith("mtp.") for n in tensor_names(paths["target"]))
    rows = pairs(paths, cfg.spec.draft_len, block_k, has_mtp)
    _, prompts = target_prompts(cfg, paths["target"])
    ids = [p.ids for p in prompts]
    log(f"{name}: {len(rows)} rows x {len(ids)} prompts x {cfg.warmup} + {cfg.runs} rounds")
    load = [round(os.getloadavg()[0], 2)]
    theirs = outside.run_rows(rows, ids, cfg.max_new_tokens, cfg.warmup, cfg.runs, out / name, log)
    load.append(round(os.getloadavg()[0], 2))
    log("specquant: the same rows")
    mine = ours.run_rows(rows, ids, cfg.max_new_tokens, cfg.warmup, cfg.runs, log=log, runtime=cfg.runtime)
    load.append(round(os.getloadavg()[0], 2))
    result = {"engine": name, "prompts": [p.id for p in prompts], "max_new_tokens": cfg.max_new_tokens,
              "runs": cfg.runs, "warmup": cfg.warmup, "engine_model_free": outside.MODEL_FREE, "our_model_free": ours.MODEL_FREE,
              "load_avg": load, "rows": table_rows(rows, theirs, mine, cfg.max_new_tokens)}
    atomic_write(out / f"engine-{name}.json", json.dumps(result, indent=2) + "\n")
    atomic_write(out / f"engine-{name}.md", "```\n" + format_table(result) + "\n```\n")
    return result
