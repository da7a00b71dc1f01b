"""The ablation: rows (a)-(e) and the transformers comparison (with a block drafter rows f-h and the levers, with
an MTP drafter rows m, n), measured in one run on the same prompts.

Rows are data (ROWS): which target (high precision or W4), which draft (none, high precision, W4), whether the
draft uses the sliding window. Every timed repetition runs every row on a prompt before the next prompt, so load
from other processes hits all rows alike and ratios are taken side by side.

Per row and length category: latency / TTFT / TPOT / tokens/s are the median over runs per prompt, then the mean
over the category's prompts; speedup = baseline (a) latency / row latency. Acceptance per content set comes from
one untimed greedy pass over the content prompts per speculative row (greedy acceptance does not change between
runs); acceptance per length category from the timed runs themselves, which is what the prediction uses.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specquant.bench.config import BenchConfig
from specquant.bench.measure import (WARM_BURST, BlockAccept, BlockForward, ForwardKey, MTPForward, Probe,
                                     environment, forward_times, hf_assisted, summarize)
from specquant.bench.predict import StepCosts, predict_row
from specquant.bench.prompts import Prompt, fit_lengths, load_prompts
from specquant.bench.results import BenchResults, CategoryCosts, CategoryResult, RowResult, SameTokens
from specquant.bench.spread import Runs, intervals, speedup
from specquant.bench.stages import StageTimes
from specquant.engines.timing import Sample, interleaved, ours_speculative, ours_target_only
from specquant.loader import load_model
from specquant.quant.linear import resolve_w4_activations
from specquant.model.checkpoint import load_tokenizer
from specquant.spec_decode.build import build_engine
from specquant.spec_decode.config import SpecConfig
from specquant.spec_decode.runtime import RuntimeConfig
from specquant.spec_decode.drafters import KINDS, block, hybrid, lm, mtp, suffix
from specquant.spec_decode.engine import SpecEngine
from specquant.spec_decode.metrics import SpecMetrics
from specquant.util.dtypes import DTYPES


# the drafter kinds the rows run, from the registry (spec_decode/drafters/): lm = k forwards per step, block = one,
# mtp = k (the target's own MTP layer, chained)
LM, BLOCK, SUFFIX, HYBRID, MTP = lm.KIND.name, block.KIND.name, suffix.KIND.name, hybrid.KIND.name, mtp.KIND.name


@dataclass(frozen=True)
class Row:
    id: str
    name: str
    target: str  # "hp" (high precision), "w4" or "qad" (W4 + QAD)
    draft: str | None  # None (target alone), "hp" or "w4"
    window: bool = False  # draft attends to its last BenchConfig.spec.draft_window positions
    impl: str = "specquant"  # or "transformers"
    drafter: str = LM  # the drafter kind's name (a key of spec_decode.drafters.KINDS)
    pruned: bool = False  # the drafter's head keeps BenchConfig.pruned_head_fraction of the vocabulary
    replay: bool = False  # the suffix drafter keeps its response cache (--suffix-cache-tokens)


ROWS = (
    Row("a", "baseline: target", "hp", None),
    Row("b", "W4 target", "w4", None),
    Row("c", "W4 target + draft", "w4", "hp"),
    Row("d", "W4 target + W4 draft", "w4", "w4"),
    Row("e", "W4 target + W4 draft + window", "w4", "w4", window=True),
)
# The block drafter (DFlash-style, model/block_draft.py) beside the LM rows (c)-(e): same targets, same metrics;
# its k is BenchConfig.block_draft_len.
BLOCK_ROWS = (
    Row("f", "W4 target + block draft", "w4", "hp", drafter=BLOCK),
    Row("g", "W4 target + W4 block draft", "w4", "w4", drafter=BLOCK),
    Row("h", "W4 target + W4 block draft + window", "w4", "w4", window=True, drafter=BLOCK),
)
# The MTP drafter (Qwen3.5's own MTP layer, spec_decode/drafters/mtp.py) beside the block rows, on a target whose
# checkpoint has mtp.* tensors (or with an MTP drafter directory): dense, and W4 by drafter_loader.write_w4_mtp;
# k = BenchConfig.spec.draft_len, as the LM rows (one MTP forward per drafted token)
MTP_ROWS = (
    Row("m", "W4 target + MTP draft", "w4", "hp", drafter=MTP),
    Row("n", "W4 target + W4 MTP draft", "w4", "w4", drafter=MTP),
)
# The levers (issue 25): the suffix drafter (model-free; its own k), the hybrid (suffix on a long match, else the W4
# block drafter) and the W4 block drafter with a vocabulary-pruned head; no prediction (their costs are not probed)
SUFFIX_ROW = Row("s", "W4 target + suffix draft", "w4", "model-free", drafter=SUFFIX)
# The suffix drafter with its response cache, only when --suffix-cache-tokens asks for one: a bench sends each
# prompt several times (warm-ups, timed rounds, the acceptance passes), so this row drafts the earlier answer to the
# same prompt, a replay, and is reported apart; every other row runs without the cache.
SUFFIX_REPLAY_ROW = Row("r", "W4 target + suffix draft, replay (response cache; prompts repeat)", "w4", "model-free",
                        drafter=SUFFIX, replay=True)
LEVER_BLOCK_ROWS = (
    Row("u", "W4 target + hybrid: suffix, else W4 block draft", "w4", "w4", drafter=HYBRID),
    Row("p", "W4 target + W4 block draft, pruned head", "w4", "w4", drafter=BLOCK, pruned=True),
)
# The target with a pruned vocabulary (quantize --prune-vocab N, specquant/quant/prune_vocab.py), alone: LOSSY, so it is
# never compared token for token with the unpruned target; the report gives its kl gate stats instead. Its prompts
# are the same texts spelled by its own (cut) tokenizer.
PRUNED_ROW = Row("v", "pruned-vocabulary target (lossy)", "pruned", None)
HF_ROW = Row("hf", "transformers assisted: target + draft", "hp", "hp", impl="transformers")
BASELINE = "a"
QAD_ROW = Row("q", "W4 + QAD target", "qad", None)


# (drafter kind, precision, the paths key of its checkpoint): the draft models a run loads, keyed as the rows read
# them (Row.drafter, Row.draft)
DRAFT_INPUTS = ((LM, "hp", "draft"), (LM, "w4", "quantized_draft"), (BLOCK, "hp", "block_draft"),
                (BLOCK, "w4", "quantized_block_draft"), (MTP, "hp", "mtp_draft"), (MTP, "w4", "quantized_mtp_draft"))


def rows_for(with_qad: bool, with_block: bool = False, with_mtp: bool = False,
             with_replay: bool = False) -> tuple[Row, ...]:
    """ROWS (+ BLOCK_ROWS, + MTP_ROWS, + the replay row), or with a QAD target: row (q) after (b), and every draft
    row runs against the QAD target."""
    mtp_rows = MTP_ROWS if with_mtp else ()
    suffix_rows = (SUFFIX_ROW, SUFFIX_REPLAY_ROW) if with_replay else (SUFFIX_ROW,)
    table = ((*ROWS, *BLOCK_ROWS, *mtp_rows, *suffix_rows, *LEVER_BLOCK_ROWS) if with_block
             else (*ROWS, *mtp_rows, *suffix_rows))
    if not with_qad:
        return table
    drafted = tuple(dataclasses.replace(r, target="qad", name=r.name.replace("W4 target", "W4 + QAD target"))
                    for r in table if r.draft is not None)
    return (*[r for r in table if r.draft is None], QAD_ROW, *drafted)


ALL_ROWS = (*ROWS, *BLOCK_ROWS, *MTP_ROWS, SUFFIX_ROW, *LEVER_BLOCK_ROWS, QAD_ROW, PRUNED_ROW, HF_ROW)
# what a kept row needs besides itself: the baseline (every speedup is over it) and its own target's row (its
# greedy tokens are checked against that row's: SameTokens)
OWN_ROW = {"hp": BASELINE, "w4": "b", "qad": QAD_ROW.id}


def check_row_ids(wanted) -> None:
    """BenchConfig.rows: every id names a row; raises SpecquantError naming the unknown ones."""
    from specquant.errors import SpecquantError

    known = list(dict.fromkeys(r.id for r in ALL_ROWS))
    unknown = [r for r in wanted if r not in known]
    if unknown:
        raise SpecquantError(f"rows {' '.join(unknown)}: no such row; the rows are {' '.join(known)}")


def select_rows(table: tuple[Row, ...], wanted) -> tuple[Row, ...]:
    """The rows of `table` that BenchConfig.rows keeps (all when it is empty), with the rows they need (OWN_ROW).
    A wanted row the run's inputs do not allow (a block row without --block-draft) raises SpecquantError."""
    from specquant.errors import SpecquantError

    if not wanted:
        return table
    ids = {r.id for r in table}
    missing = [w for w in wanted if w not in ids and w not in (HF_ROW.id, PRUNED_ROW.id)]
    if missing:
        raise SpecquantError(f"rows {' '.join(missing)} need inputs this run was not given (block rows: "
                             "--block-draft; MTP rows: an MTP drafter; q: --qad); run without them")
    keep = set(wanted) | {BASELINE} | {OWN_ROW[r.target] for r in table if r.id in wanted and r.draft is not None}
    return tuple(r for r in table if r.id in keep)


# --- the run -----------------------------------------------------------------------------------------------------


def _load_hf(path: Path, dtype: torch.dtype, device):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True).to(device).eval()


def _bar(total: int, desc: str):
    from specquant.util.progress import Progress

    return Progress(total, desc, "rep", summary=False)  # bench logs each pass's wall time as a stage


def row_lines(rows: list[Row], samples: dict, prompts: list[Prompt]) -> list[str]:
    """One line per row that ran: its tokens/s and its average speedup over row (a) with the 95% interval, from
    the latency runs' samples ({row id: {prompt id: samples}}), as the report computes them."""
    by_cat: dict[str, list[str]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p.id)

    def per_category(rid: str) -> dict[str, dict[str, list[Sample]]]:
        return {cat: {pid: samples[rid][pid] for pid in pids} for cat, pids in by_cat.items()}

    base, lines = latency_runs(per_category(BASELINE)), []
    for r in rows:
        if r.id not in samples:
            continue
        cats = per_category(r.id)
        tok_s = sum(summarize(pp).tokens_per_s for pp in cats.values()) / len(cats)
        runs = latency_runs(cats)
        point = sum(speedup(base, runs).values()) / len(cats)
        iv = intervals(base, runs)["avg"]
        lines.append(f"      ({r.id}) {r.name}: {tok_s:.1f} tok/s, {point:.2f}x row (a) "
                     f"(95% interval {iv.low:.2f}-{iv.high:.2f})")
    return lines


def run_ablation(cfg: BenchConfig, paths: dict[str, Path], device: torch.device,
                 times: StageTimes | None = None, log=None) -> BenchResults:
    """Measure every row; returns the results that report.py writes. paths: check_inputs' output plus the
    quantized_target / quantized_draft checkpoints. times: each measuring pass's wall time is recorded there.
    log: where given, one line per row once the latency runs end (its tok/s and speedup)."""
    env = environment(device)  # before the run: the load average it records is the one the run started under
    times = times if times is not None else StageTimes()
    t_load, cpu_load = time.perf_counter(), time.process_time()
    runtime, sampling = dataclasses.replace(cfg.runtime, device=str(device)), cfg.sampling
    tokenizer = load_tokenizer(paths["target"])
    draft_tokenizer = load_tokenizer(paths["draft"]) if (paths["draft"] / "tokenizer.json").exists() else None
    # every row decodes with fused q/k/v and gate/up projections (model/fuse.py), the baseline included; drafts
    # load as their kind loads them (spec_decode/drafters/)
    models = {("target", kind): load_model(paths[key], runtime.dtype, device, fuse=True,
                                           w4_activations=runtime.w4_activations)
              for kind, key in (("hp", "target"), ("w4", "quantized_target"), ("qad", "qad_target"),
                                ("pruned", "pruned_target")) if key in paths}
    for kind, precision, key in DRAFT_INPUTS:
        if key in paths:  # keyed by the rows' Row.drafter (a kind name) and Row.draft
            models[(kind, precision)] = KINDS[kind].load(paths[key], runtime)
    table = rows_for("qad_target" in paths, (BLOCK, "hp") in models, (MTP, "hp") in models,
                     cfg.drafters[SUFFIX].cache_tokens > 0)
    if "pruned_target" in paths:
        table = (*table, PRUNED_ROW)
    table = select_rows(table, cfg.rows)
    if (BLOCK, "w4") in models:  # row (p): its own copy of the W4 block drafter, with the token map
        models[(BLOCK, "w4", "pruned")] = _pruned_block(cfg, paths, runtime)
    context = min(models[("target", "hp")].config.max_position_embeddings,
                  models[(LM, "hp")].config.max_position_embeddings)
    lengths = fit_lengths(cfg.lengths, context, cfg.max_new_tokens)
    prompts = load_prompts(tokenizer, lengths, cfg.content_sets, cfg.prompts_per_length, cfg.prompts_per_set,
                           min(cfg.content_max_tokens, context - cfg.max_new_tokens), cfg.prompts,
                           filler_sets=cfg.filler_sets)
    length_prompts = [p for p in prompts if p.kind == "length"]
    content_prompts = [p for p in prompts if p.kind == "content"]
    filler_prompts = [p for p in prompts if p.kind == "filler"]

    runners, skipped, engines, row_seconds = {}, {}, {}, {}
    for row in table:
        target = models[("target", row.target)]
        if row.draft is None:
            runners[row.id] = ours_target_only(target, cfg.max_new_tokens, sampling)
            if row.target == "pruned":
                runners[row.id] = _respelled(runners[row.id], tokenizer, load_tokenizer(paths["pruned_target"]))
            continue
        engines[row.id] = _engine(cfg, runtime, row, models, tokenizer, draft_tokenizer)
        runners[row.id] = ours_speculative(engines[row.id], cfg.max_new_tokens, sampling)
    if cfg.rows and HF_ROW.id not in cfg.rows:
        pass  # not among the rows asked for: not in the table at all
    elif cfg.hf_compare:
        try:
            dtype = DTYPES[runtime.dtype]
            hf_target, hf_draft = _load_hf(paths["target"], dtype, device), _load_hf(paths["draft"], dtype, device)
            runners[HF_ROW.id] = hf_assisted(hf_target, hf_draft, cfg.max_new_tokens, cfg.spec.draft_len, sampling)
        except Exception as e:  # transformers may not know the architecture or may refuse the pair: say so
            skipped[HF_ROW.id] = f"transformers could not load the pair: {type(e).__name__}: {str(e)[:200]}"
    else:
        skipped[HF_ROW.id] = "disabled (hf_compare false)"
    rows = [*table, HF_ROW] if not cfg.rows or HF_ROW.id in cfg.rows else list(table)
    times.add("load models, build the rows' engines", time.perf_counter() - t_load, time.process_time() - cpu_load)

    def transformers_failed(rid: str, e: Exception) -> bool:
        if rid != HF_ROW.id:
            return False
        # transformers' assisted generation changes between versions: report it, keep our rows
        skipped[rid] = f"transformers generate failed: {type(e).__name__}: {str(e)[:200]}"
        del runners[rid]
        return True

    warm = "" if cfg.warmup_all_prompts or not cfg.warmup else f" ({cfg.warmup} warm-up on the first prompt)"
    with times(f"latency runs: {len(runners)} rows x {len(length_prompts)} prompts x {cfg.runs} timed rounds{warm}"):
        samples = interleaved(runners, length_prompts, cfg.warmup + cfg.runs, cfg.warmup, device, transformers_failed,
                              seconds=row_seconds,
                              rounds={HF_ROW.id: cfg.warmup + cfg.hf_runs} if cfg.hf_runs is not None else None,
                              warmup_prompts=None if cfg.warmup_all_prompts else 1)
    if log is not None:
        for line in row_lines(rows, samples, length_prompts):
            log(line)

    spec_runners = {r.id: runners[r.id] for r in rows if r.draft is not None and r.impl == "specquant"}
    by_source = {}  # a hybrid row's steps per source, per pass (content sets, filler sets)
    acceptance_samples = {}
    for name, pass_prompts in (("content", content_prompts), ("filler", filler_prompts)):
        for rid, engine in engines.items():
            if hasattr(engine.drafter, "take_totals"):
                engine.drafter.take_totals()  # what the timed runs drafted is not this pass's
        with times(f"acceptance, {name}: {len(spec_runners)} rows x {len(pass_prompts)} prompts"):
            passed = interleaved(spec_runners, pass_prompts, 1, 0, device, desc=f"acceptance, {name}",
                                 seconds=row_seconds)
        for rid, per_prompt in passed.items():
            acceptance_samples.setdefault(rid, {}).update({pid: ss[0].spec for pid, ss in per_prompt.items()})
        for rid, engine in engines.items():
            if hasattr(engine.drafter, "take_totals") and pass_prompts:
                by_source.setdefault(rid, {})[name] = engine.drafter.take_totals()

    # the rows whose drafter fixes its longest draft (a block drafter: block_size - 1) again at that length:
    # acceptance at every block position
    whole, t_whole, cpu_whole = {}, time.perf_counter(), time.process_time()
    for r in rows if cfg.whole_block_pass else ():
        if r.draft is not None and r.impl == "specquant":
            drafter = _engine(cfg, runtime, r, models, tokenizer, draft_tokenizer).drafter
            longest = getattr(drafter, "max_draft_len", None)
            if longest and not getattr(drafter, "own_draft_len", None):  # suffix, hybrid: their k is already theirs
                whole[r.id] = ours_speculative(_engine(cfg, runtime, r, models, tokenizer, draft_tokenizer, longest),
                                               cfg.max_new_tokens, sampling)
    passed = interleaved(whole, content_prompts, 1, 0, device, desc="acceptance, whole block", seconds=row_seconds)
    if whole:
        times.add(f"acceptance, whole block: {len(whole)} rows x {len(content_prompts)} prompts",
                  time.perf_counter() - t_whole, time.process_time() - cpu_whole)
    whole_block = {rid: SpecMetrics.total(ss[0].spec for ss in per_prompt.values()) for rid, per_prompt in passed.items()}

    with times(f"forward costs: {len(lengths)} contexts x {cfg.cost_reps} reps"):
        costs = measure_costs(cfg, models, lengths, rows)
    with times(f"drafter latency curve: {len(cfg.curve_fractions)} contexts"):
        curve = drafter_curve(cfg, models[(LM, "w4")], context)

    results_rows = [_row_result(r, cfg, samples, acceptance_samples, skipped, prompts, lengths, costs)
                    for r in rows]
    for res in results_rows:
        res.acceptance_whole_block = whole_block.get(res.id)
        res.by_source = by_source.get(res.id)
        if res.id == PRUNED_ROW.id and res.ok:
            res.lossy = _pruned_quality(paths, runtime)
        res.seconds = row_seconds.get(res.id)
    _add_speedups(results_rows)
    return BenchResults(
        config=cfg, environment=env, models=dict(paths),
        w4_activations={"target": resolve_w4_activations(runtime.w4_activations, device),
                        "draft": resolve_w4_activations(runtime.draft_w4_activations, device)},
        context=context, lengths=lengths, prompts=prompts, rows=results_rows, costs=costs, draft_latency=curve)


def row_spec(cfg: BenchConfig, row: Row, draft_len: int | None = None) -> SpecConfig:
    """A speculative row's SpecConfig: the LM rows run BenchConfig.spec, the block rows block_draft_len (or
    draft_len), both with the row's window."""
    return ROW_SPECS[row.drafter](cfg, row.window, draft_len)


def _chain(spec: SpecConfig) -> SpecConfig:
    """A row whose drafter drafts chains only runs --tree-nodes 0 (spec_decode/tree.py: block and suffix trees)."""
    return dataclasses.replace(spec, tree_nodes=0)


# per drafter kind: how its rows set k (the block drafter's one forward drafts any k up to its block; the suffix
# drafter's k is its own, SuffixConfig.max_draft_len; the hybrid's block drafter drafts block_draft_len); with
# --tree-nodes, the block and suffix rows draft trees and the others stay chains
ROW_SPECS = {LM: lambda cfg, window, draft_len: _chain(cfg.spec_for(window)),
             BLOCK: lambda cfg, window, draft_len: cfg.block_spec_for(window, draft_len),
             SUFFIX: lambda cfg, window, draft_len: dataclasses.replace(
                 cfg.spec_for(window), draft_len=cfg.drafters[SUFFIX].max_draft_len, adaptive=False),
             HYBRID: lambda cfg, window, draft_len: _chain(cfg.block_spec_for(window, draft_len)),
             MTP: lambda cfg, window, draft_len: _chain(cfg.spec_for(window))}


def predicted(kind: str) -> bool:
    """Whether the rows of a drafter kind get a prediction (rows with a pruned head excepted): its row names what its
    step costs (DrafterKind.cost), which measure_costs times."""
    return KINDS[kind].cost is not None


def _engine(cfg: BenchConfig, runtime: RuntimeConfig, row: Row, models: dict, tokenizer, draft_tokenizer,
            draft_len: int | None = None) -> SpecEngine:
    """The SpecEngine of a speculative row (build_engine over the loaded models)."""
    target, spec = models[("target", row.target)], row_spec(cfg, row, draft_len)
    options = cfg.drafters  # the kinds' settings; only row (r) keeps the suffix drafter's response cache
    if not row.replay:
        options = dataclasses.replace(options, **{SUFFIX: dataclasses.replace(options[SUFFIX], cache_tokens=0)})
    if row.drafter == SUFFIX:
        draft = SUFFIX
    elif row.drafter == HYBRID:  # suffix, else the row's loaded block drafter
        draft = hybrid.HybridParts(KINDS[BLOCK], models[(BLOCK, row.draft)])
    else:
        draft = models[(row.drafter, row.draft, "pruned") if row.pruned else (row.drafter, row.draft)]
    return build_engine(target, draft, runtime, spec, target_tokenizer=tokenizer, draft_tokenizer=draft_tokenizer,
                        draft_options=options)


def _pruned_block(cfg: BenchConfig, paths: dict, runtime: RuntimeConfig):
    """Row (p)'s drafter: the W4 block drafter loaded again, its head keeping the most frequent
    pruned_head_fraction of the vocabulary, counted on the calibration text (spec_decode/drafters/pruned_head.py)."""
    from specquant.spec_decode.drafters.pruned_head import ATTRIBUTE
    from specquant.train.prune_head import build_token_map

    model = KINDS[BLOCK].load(paths["quantized_block_draft"], runtime)
    keep = max(1, round(cfg.pruned_head_fraction * model.config.vocab_size))
    ids, _ = build_token_map(paths["quantized_block_draft"], keep, tokenizer_from=paths["target"])
    setattr(model, ATTRIBUTE, ids)
    return model


def _respelled(run, tokenizer, own_tokenizer):
    """Row (v)'s runner: each prompt's text spelled by the pruned target's own tokenizer (outside the timing). That
    takes more tokens where the full spelling used a cut one, so its last len(prompt) tokens are kept: the same
    prompt length as every other row (the lengths are in tokens), over nearly the same text."""

    def respelled(prompt_ids: torch.Tensor):
        text = tokenizer.decode(prompt_ids[0].tolist())
        own = own_tokenizer.encode(text, add_special_tokens=False)[-prompt_ids.shape[1]:]
        return run(torch.tensor([own], device=prompt_ids.device))

    return respelled


def _pruned_quality(paths: dict, runtime: RuntimeConfig) -> dict:
    """Row (v)'s kl gate against the unpruned high-precision target, with the gate's default blocks and bounds."""
    from specquant.gate.config import KL_GATE, GateConfig
    from specquant.gate.kl import kl_gate

    stats, rows = kl_gate(str(paths["pruned_target"]), str(paths["target"]), GateConfig(), dtype=runtime.dtype,
                          w4_activations=runtime.w4_activations)
    stats.pop("text", None)
    return {"baseline": str(paths["target"]), **stats, "gate": KL_GATE,
            "passed": all(r.passed for r in rows), "rows": [r.to_dict() for r in rows]}


def measure_costs(cfg: BenchConfig, models: dict, lengths: dict[str, int],
                  rows: list[Row] | None = None) -> dict[str, CategoryCosts]:
    """Per length category, forward times at the mean decode context (prompt + max_new_tokens / 2), all timed
    interleaved: each target's one-token step (between other probes, and alone: after its own step) and (k+1)-token
    verify, and each predicted row's drafter as its kind's cost names it (COST_PROBES: a decoder's one-token step,
    the W4 one also with the window; a block drafter's forward and its accept of 1 .. block_draft_len + 1 rows, and
    each target's verify of block_draft_len + 1 tokens; a head's chained forward against the W4 target's embeddings
    and head). rows: only the forwards these rows' predictions read (None: every row the models allow)."""
    k1 = cfg.spec.draft_len + 1
    # (drafter kind, precision, window) of every predicted row whose drafter is loaded
    drafted_by = {(r.drafter, r.draft, r.window) for r in (ALL_ROWS if rows is None else rows)
                  if r.draft is not None and r.impl == "specquant" and predicted(r.drafter)
                  and (r.drafter, r.draft) in models}
    # not the pruned one: nothing predicts it; the baseline always (every prediction is rescaled by its step)
    used = None if rows is None else {r.target for r in rows} | {"hp"}
    targets = [t for t in ("hp", "w4", "qad") if ("target", t) in models and (used is None or t in used)]
    probes: dict[ForwardKey, Probe] = {}
    for t in targets:
        probes[ForwardKey("target", t)] = Probe(models[("target", t)])
        probes[ForwardKey("target", t, alone=True)] = Probe(models[("target", t)], burst=WARM_BURST)
        probes[ForwardKey("target", t, "verify")] = Probe(models[("target", t)], k1)
    drafted = next(models[("target", t)] for t in ("qad", "w4", "hp") if ("target", t) in models)
    for kind in dict.fromkeys(k for k, _, _ in DRAFT_INPUTS):  # the loaded drafters, in the order they are timed
        if predicted(kind) and (kind, "hp") in models:
            keys = [(p, w) for p in ("hp", "w4") for w in (False, True) if (kind, p, w) in drafted_by]
            probes.update(COST_PROBES[KINDS[kind].cost](cfg, kind, keys, models, targets, drafted))
    out = {}
    with _bar(len(lengths) * (2 + cfg.cost_reps), "forward costs") as bar:
        for cat, n in lengths.items():
            ctx = n + cfg.max_new_tokens // 2
            out[cat] = CategoryCosts(ctx, forward_times(probes, ctx, cfg.cost_reps,
                                                        lambda: bar.update(1, status=f"{cat} context {ctx}")))
    return out


def _window(cfg: BenchConfig, windowed: bool) -> int | None:
    return cfg.spec.draft_window if windowed else None


def _decoder_probes(cfg: BenchConfig, kind: str, keys, models: dict, targets, drafted) -> dict[ForwardKey, Probe]:
    """A drafter with its own decoder (cost "decoder"): its one-token step, per (precision, window) in keys."""
    return {ForwardKey(kind, p, window=w): Probe(models[(kind, p)], window=_window(cfg, w)) for p, w in keys}


def _block_probes(cfg: BenchConfig, kind: str, keys, models: dict, targets, drafted) -> dict[ForwardKey, Probe]:
    """A block drafter (cost "block"): each target's verify of block_draft_len + 1 tokens, and per (precision,
    window) in keys its forward drafting block_draft_len tokens and its accept of 1 .. block_draft_len + 1 rows
    (after 0 .. block_draft_len accepted drafts), together its per-step cost."""
    kb = cfg.block_draft_len
    probes = {ForwardKey("target", t, "verify_block"): Probe(models[("target", t)], kb + 1) for t in targets}
    for precision in dict.fromkeys(p for p, _ in keys):
        fwd, acc = BlockForward(models[(kind, precision)], kb), BlockAccept(models[(kind, precision)])
        for windowed in (w for p, w in keys if p == precision):
            window = _window(cfg, windowed)
            probes[ForwardKey(kind, precision, window=windowed)] = Probe(fwd, window=window)
            for n in range(1, kb + 2):
                probes[ForwardKey(kind, precision, "accept", n, windowed)] = Probe(acc, n, window=window)
    return probes


def _head_probes(cfg: BenchConfig, kind: str, keys, models: dict, targets, drafted) -> dict[ForwardKey, Probe]:
    """A layer on the target's hidden states (cost "head"): its forward and head, one per drafted token, against the
    target the rows draft for (drafted: the QAD target, else the W4, else the baseline)."""
    return {ForwardKey(kind, p, window=w): Probe(MTPForward(models[(kind, p)], drafted), window=_window(cfg, w))
            for p, w in keys}


# DrafterKind.cost (spec_decode/drafter.COST_MODELS) -> the probes that time it: (cfg, kind, [(precision, window)],
# models, targets, drafted target) -> {ForwardKey: Probe}
COST_PROBES = {"decoder": _decoder_probes, "block": _block_probes, "head": _head_probes}


def drafter_curve(cfg: BenchConfig, draft, context: int) -> dict:
    """The W4 draft's one-token forward time against context length, full attention vs the sliding window."""
    contexts = sorted({max(1, int(f * context)) for f in cfg.curve_fractions})
    probes = {"full": Probe(draft), "window": Probe(draft, window=cfg.spec.draft_window)}
    full, windowed = [], []
    with _bar(len(contexts) * (2 + cfg.cost_reps), "drafter latency") as bar:
        for ctx in contexts:
            t = forward_times(probes, ctx, cfg.cost_reps, lambda: bar.update(1, status=f"context {ctx}"))
            full.append(t["full"])
            windowed.append(t["window"])
    return {"contexts": contexts, "full_s": full, "window_s": windowed, "window": cfg.spec.draft_window}


def _costs_for(row: Row, c: CategoryCosts, cfg: BenchConfig) -> StepCosts:
    """predict_row's costs for a speculative row: its forwards (as many per step as its kind runs for its k) and a
    drafter's accept of target features, where timed, timed between other models' forwards (a speculative step
    alternates models), the baseline's step timed alone (row (a) decodes with the baseline target only)."""
    t, k = c.times, row_spec(cfg, row).draft_len
    own = dict(target_step_s=t[ForwardKey("target", row.target)],
               baseline_step_s=t[ForwardKey("target", "hp", alone=True)])
    # measure_costs times the verify at both draft lengths: the one of this row's k
    verify = t[ForwardKey("target", row.target, "verify" if k == cfg.spec.draft_len else "verify_block")]
    accept = tuple(t[key] for key in (ForwardKey(row.drafter, row.draft, "accept", rows, row.window)
                                      for rows in range(1, k + 2)) if key in t)
    return StepCosts(**own, verify_s=verify, draft_step_s=t[ForwardKey(row.drafter, row.draft, window=row.window)],
                     draft_forwards_per_step=KINDS[row.drafter].forwards_per_step(k), accept_s=accept or None)


def _row_result(row: Row, cfg: BenchConfig, samples, acceptance_samples, skipped, prompts: list[Prompt],
                lengths: dict[str, int], costs: dict[str, CategoryCosts]) -> RowResult:
    res = RowResult(
        id=row.id, name=row.name, impl=row.impl, target=row.target, draft=row.draft,
        drafter=row.drafter if row.draft else None, draft_window=cfg.spec.draft_window if row.window else None,
        draft_len=row_spec(cfg, row).draft_len if row.draft else None)
    if row.id in skipped:
        res.status, res.reason = "skipped", skipped[row.id]
        return res
    for cat in lengths:
        cat_prompts = [p for p in prompts if p.category == cat]
        if not cat_prompts:
            continue
        per_prompt = {p.id: samples[row.id][p.id] for p in cat_prompts}
        entry = CategoryResult(per_prompt, summarize(per_prompt))
        if row.draft is not None and row.impl == "specquant":
            entry.acceptance = SpecMetrics.total(s.spec for ss in per_prompt.values() for s in ss)
            if predicted(row.drafter) and not row.pruned:
                entry.prediction = predict_row(entry.acceptance, _costs_for(row, costs[cat], cfg))
        elif row.draft is None and ForwardKey("target", row.target, alone=True) in costs[cat].times:
            t = costs[cat].times  # (the pruned target is not probed: no step ratio for row v)
            entry.step_ratio = t[ForwardKey("target", "hp", alone=True)] / t[ForwardKey("target", row.target,
                                                                                        alone=True)]
        res.categories[cat] = entry
    if row.id in acceptance_samples:
        for kind, attr in (("content", "acceptance"), ("filler", "filler")):
            sets = {p.category: [] for p in prompts if p.kind == kind}
            for p in prompts:
                if p.kind == kind:
                    sets[p.category].append(acceptance_samples[row.id][p.id])
            merged = {name: SpecMetrics.total(specs) for name, specs in sets.items()}
            setattr(res, attr, merged if kind == "content" or merged else None)
    return res


def latency_runs(per_category: dict[str, dict[str, list[Sample]]]) -> Runs:
    """{category: {prompt id: samples}} -> the per-run latencies bench/spread.py reads."""
    return {cat: {pid: [s.latency_s for s in ss] for pid, ss in per_prompt.items()}
            for cat, per_prompt in per_category.items()}


def _add_speedups(rows: list[RowResult]):
    """speedup = baseline latency / row latency per category, with its 95% interval (bench/spread.py);
    decode_speedup the same on TPOT (the averages are RowResult's properties); same_tokens_as: the row produced the
    baseline-precision target's own tokens."""
    base = next(r for r in rows if r.id == BASELINE)
    own = OWN_ROW
    by_id = {r.id: r for r in rows}
    base_runs = latency_runs({cat: e.samples for cat, e in base.categories.items()})
    for r in rows:
        if not r.ok:
            continue
        spread = intervals(base_runs, latency_runs({cat: e.samples for cat, e in r.categories.items()}))
        r.speedup_avg_interval = spread["avg"]
        for cat, e in r.categories.items():
            e.speedup_interval = spread[cat]
            b = base.categories[cat].timing
            e.speedup = b.latency_s / e.timing.latency_s
            e.decode_speedup = b.tpot_s / e.timing.tpot_s if e.timing.tpot_s > 0 else float("nan")
            ref = by_id.get(own.get(r.target))  # a pruned target has no own row: its tokens are not compared
            if ref is not None and ref.ok and r.id != ref.id:
                e.same_tokens_as = SameTokens(ref.id, e.tokens == ref.categories[cat].tokens)


def run_bench(cfg: BenchConfig, target, draft, quantized_target=None, quantized_draft=None, device="cpu", log=print,
              qad_target=None, block_draft=None, quantized_block_draft=None,
              mtp_draft=None, pruned_target=None) -> tuple[BenchResults, list[Path]]:
    """The whole bench as one call (`specquant bench` and `specquant demo` only parse and call this): check every
    input, claim the output directory, quantize what was not given, measure every row, write the report.
    block_draft: a block drafter (DFlashDraftModel) for rows (f)-(h); its W4 is GPTQ'd into out/cache when not
    given. mtp_draft: rows (m), (n), the MTP drafter: "mtp" (the target checkpoint's own mtp.* tensors), "init"
    (those, else an untrained MTP layer initialised from the target's last attention layer, as `distill draft
    --kind mtp` starts one) or a dense MTP drafter directory; its W4 is written into out/cache (prepare_mtp).
    pruned_target: a vocabulary-pruned target (quantize --prune-vocab N) for row (v), lossy, with its kl gate.
    Returns (results, written files)."""
    from specquant.bench.prepare import check_pruned_target, prepare_quantized, validate
    from specquant.bench.report import write_report
    from specquant.util.files import claim_out_dir

    paths = validate(cfg, target, draft, quantized_target, quantized_draft, device, qad_target, block_draft,
                     quantized_block_draft)
    if pruned_target is not None:
        paths["pruned_target"] = check_pruned_target(paths, pruned_target)
    check_row_ids(cfg.rows)  # and that the inputs allow them, before anything is written:
    available = rows_for(cfg.qad or "qad_target" in paths, block_draft is not None, mtp_draft is not None)
    select_rows((*available, PRUNED_ROW) if pruned_target is not None else available, cfg.rows)
    claim_out_dir(cfg.out, cfg.overwrite)
    times = StageTimes(log)
    quantized = prepare_quantized(cfg, paths, log, times)
    if mtp_draft is not None:
        with times("MTP drafter and its W4"):
            quantized.update(prepare_mtp(paths, mtp_draft, Path(cfg.out) / "cache", cfg.sampling.seed, log))
    if cfg.runtime.threads:
        torch.set_num_threads(cfg.runtime.threads)
    torch.manual_seed(cfg.sampling.seed)
    results = run_ablation(cfg, paths, torch.device(device), times, log)
    results.quantized, results.stages = quantized, times
    t0 = time.perf_counter()
    files = write_report(results, Path(cfg.out))
    log(f"      [{time.perf_counter() - t0:6.1f} s] report and plots (not in the report's table: it was written then)")
    return results, files


MTP_SOURCES = ("mtp", "init")  # run_bench's mtp_draft besides a directory


def prepare_mtp(paths: dict[str, Path], source, cache: Path, seed: int = 0, log=print) -> dict:
    """Fill paths["mtp_draft"] / paths["quantized_mtp_draft"]: the dense MTP drafter (cache/mtp, from the target's
    mtp.* tensors or, with "init" and none, init_mtp; or the directory given) and its W4 (cache/mtp_w4) by
    drafter_loader.write_w4_mtp, the MTP drafter's own W4 path (RTN: one layer, no calibration). Both are
    rewritten every run: an MTP layer is a few tensors. Returns the quantized-inputs entries the report lists."""
    from specquant.drafter_loader import load_mtp_drafter, write_w4_mtp
    from specquant.errors import SpecquantError
    from specquant.model.checkpoint import resolve
    from specquant.model.mtp import mtp_layers_in, save_mtp_drafter

    info = {}
    if str(source) in MTP_SOURCES:
        target = load_model(paths["target"])
        if target.extra_tensors and mtp_layers_in(target.extra_tensors):
            from specquant.model.mtp import mtp_from_tensors

            model, how = mtp_from_tensors(target.config, target.extra_tensors), "the target checkpoint's mtp.* tensors"
        elif source == "init":
            from specquant.model.mtp import MTPModel
            from specquant.train.mtp import init_mtp

            model = init_mtp(MTPModel(target.config), target, seed)
            how = "UNTRAINED: initialised from the target's last attention layer (init_mtp)"
        else:
            raise SpecquantError(f"mtp draft 'mtp' reads the target's mtp.* tensors, and {paths['target']} has none; "
                                 "pass an MTP drafter directory (`specquant distill draft --kind mtp`) or 'init'")
        dense = save_mtp_drafter(model, cache / "mtp", tokenizer_from=paths["target"], overwrite=True)
        info["mtp_draft"] = {"path": str(dense), "method": how, "produced": True}
    else:
        dense = resolve(source)
        if load_mtp_drafter(dense).quantization:
            raise SpecquantError(f"mtp draft {dense} is already quantized; pass the dense MTP drafter (its W4 is "
                                 "made here)")
        how = f"the MTP drafter directory {dense}"
    paths["mtp_draft"] = Path(dense)
    log(f"MTP drafter: {how} -> {dense}")
    report = write_w4_mtp(dense, cache / "mtp_w4", overwrite=True)
    paths["quantized_mtp_draft"] = cache / "mtp_w4"
    log(f"W4 MTP drafter: RTN (drafter_loader.write_w4_mtp) -> {cache / 'mtp_w4'}")
    info["quantized_mtp_draft"] = {"path": str(cache / "mtp_w4"), "method": f"rtn w{report['config']['bits']}",
                                   "produced": True}
    return info
