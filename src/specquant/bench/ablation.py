"""The ablation: rows (a)-(e) and the transformers comparison, measured in one run on the same prompts.

Rows are data (ROWS): which target (high precision or W4), which draft (none, high precision, W4), whether the
draft uses the sliding window. Every timed repetition runs every row on a prompt before the next prompt, so load
from other processes hits all rows alike and ratios are taken side by side.

Per row and length category: latency / TTFT / TPOT / tokens/s are the median over runs per prompt, then the mean
over the category's prompts; speedup = baseline (a) latency / row latency. Acceptance per content set comes from
one untimed greedy pass over the content prompts per speculative row (greedy acceptance does not change between
runs); acceptance per length category from the timed runs themselves, which is what the prediction uses.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specquant.bench.config import BenchConfig
from specquant.bench.measure import (Probe, environment, forward_times, hf_assisted, merged_spec,
                                     ours_speculative, ours_target_only, summarize)
from specquant.bench.predict import predict_row
from specquant.bench.prompts import Prompt, fit_lengths, load_prompts
from specquant.decode.sampling import SamplingConfig
from specquant.errors import SpecquantError
from specquant.model.checkpoint import DTYPES, load_model, load_tokenizer, read_config, read_hf_config, resolve
from specquant.spec.config import SpecConfig
from specquant.spec.engine import SpecEngine
from specquant.spec.metrics import SpecMetrics


@dataclass(frozen=True)
class Row:
    id: str
    name: str
    target: str  # "hp" (high precision) or "w4"
    draft: str | None  # None (target alone), "hp" or "w4"
    window: bool = False  # draft attends to its last BenchConfig.draft_window positions
    impl: str = "specquant"  # or "transformers"


ROWS = (
    Row("a", "baseline: target", "hp", None),
    Row("b", "W4 target", "w4", None),
    Row("c", "W4 target + draft", "w4", "hp"),
    Row("d", "W4 target + W4 draft", "w4", "w4"),
    Row("e", "W4 target + W4 draft + window", "w4", "w4", window=True),
)
HF_ROW = Row("hf", "transformers assisted: target + draft", "hp", "hp", impl="transformers")
BASELINE = "a"


# --- quantized inputs -------------------------------------------------------------------------------------------


def fingerprint(path: Path) -> dict:
    """Identity of a checkpoint's contents: sha256 over config.json and its safetensors files."""
    h = hashlib.sha256()
    for f in [path / "config.json", *sorted(path.glob("*.safetensors"))]:
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return {"path": str(path.resolve()), "sha256": h.hexdigest()}


def quant_config_for(method: str, overrides: dict):
    from specquant.quant import QuantConfig

    return QuantConfig.from_json({**overrides, "method": method}).validate()


def quantized_checkpoint(src: Path, role: str, method: str, overrides: dict, cache: Path) -> tuple[Path, dict]:
    """cache/role: src quantized with `method` (+ QuantConfig overrides), reused when its config.json records the
    same source contents and the same QuantConfig; otherwise produced again with quantize + save_quantized."""
    from specquant.quant import quantize, save_quantized

    qcfg = quant_config_for(method, overrides)
    want_quant = json.loads(json.dumps(qcfg.to_json()))
    source = fingerprint(src)
    dest = cache / role
    if (dest / "config.json").exists():
        hf = read_hf_config(dest)
        if (hf.get("specquant_bench_source") == source
                and (hf.get("quantization_config") or {}).get("specquant") == want_quant):
            return dest, {"path": str(dest), "method": method, "produced": False, "config": want_quant}
    dtype_name = read_hf_config(src).get("torch_dtype") or "float32"
    scale_dtype = DTYPES.get(dtype_name, torch.float32)
    t0 = time.perf_counter()
    model = load_model(src, torch.float32)  # calibrate in fp32 (as `specquant quantize` does), store scales as src
    report = quantize(model, qcfg, load_tokenizer(src), scale_dtype=scale_dtype, progress=True)
    model.to(scale_dtype)
    save_quantized(model, dest, tokenizer_from=src, cfg=qcfg)
    # record the source in the checkpoint itself (not in its name); a crash before this line only costs a re-run
    hf = read_hf_config(dest)
    hf["specquant_bench_source"] = source
    tmp = dest / f".config.json.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, dest / "config.json")
    return dest, {"path": str(dest), "method": method, "produced": True, "config": want_quant,
                  "seconds": round(time.perf_counter() - t0, 1), "bytes_before": report["bytes_before"],
                  "bytes_after": report["bytes_after"]}


def check_inputs(target, draft, quantized_target=None, quantized_draft=None) -> dict[str, Path]:
    """Resolve every checkpoint before anything is written; raises SpecquantError naming the bad one."""
    paths = {"target": resolve(target), "draft": resolve(draft)}
    for role in ("target", "draft"):
        if read_hf_config(paths[role]).get("quantization_config"):
            raise SpecquantError(f"--{role} {str(paths[role])!r} is already quantized; pass the high-precision "
                                 f"checkpoint as --{role} and the quantized one as --quantized-{role}")
    for role, given in (("quantized_target", quantized_target), ("quantized_draft", quantized_draft)):
        if given is None:
            continue
        path = resolve(given)
        if not read_hf_config(path).get("quantization_config"):
            raise SpecquantError(f"--{role.replace('_', '-')} {str(path)!r} has no quantization_config in its "
                                 "config.json; pass a compressed-tensors checkpoint or omit the flag to quantize")
        paths[role] = path
    tv, dv = read_config(paths["target"]).vocab_size, read_config(paths["draft"]).vocab_size
    if tv != dv:
        raise SpecquantError(f"draft vocabulary has {dv} entries, target has {tv}; the draft must share the "
                             "target's tokenizer")
    return paths


# --- the run -----------------------------------------------------------------------------------------------------


def _load_hf(path: Path, dtype: torch.dtype, device):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True).to(device).eval()


def _acceptance(m: SpecMetrics) -> dict:
    return {"drafts": m.drafts, "draft_tokens": m.draft_tokens, "accepted": m.accepted,
            "mean_acceptance_length": m.mean_acceptance_length, "acceptance_rate": m.acceptance_rate,
            "per_position_rate": m.per_position_rate, "accepted_per_pos": m.accepted_per_pos,
            "histogram": m.histogram}


def _bar(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="call", disable=None, leave=False)


def run_ablation(cfg: BenchConfig, paths: dict[str, Path], device: torch.device) -> dict:
    """Measure every row; returns the results dict that report.py writes. paths: check_inputs' output plus the
    quantized_target / quantized_draft checkpoints."""
    env = environment(device)  # before the run: the load average it records is the one the run started under
    dtype = DTYPES[cfg.dtype]
    sampling = SamplingConfig(temperature=cfg.temperature, seed=cfg.seed).validate()
    tokenizer = load_tokenizer(paths["target"])
    draft_tokenizer = load_tokenizer(paths["draft"]) if (paths["draft"] / "tokenizer.json").exists() else None
    # every row decodes with fused q/k/v and gate/up projections (model/fuse.py), the baseline included
    models = {(role, kind): load_model(paths[key], dtype, device, fuse=True)
              for role, kind, key in (("target", "hp", "target"), ("target", "w4", "quantized_target"),
                                      ("draft", "hp", "draft"), ("draft", "w4", "quantized_draft"))}
    context = min(models[("target", "hp")].config.max_position_embeddings,
                  models[("draft", "hp")].config.max_position_embeddings)
    lengths = fit_lengths(cfg.lengths, context, cfg.max_new_tokens)
    prompts = load_prompts(tokenizer, lengths, cfg.content_sets, cfg.prompts_per_length, cfg.prompts_per_set,
                           min(cfg.content_max_tokens, context - cfg.max_new_tokens), cfg.prompts)
    length_prompts = [p for p in prompts if p.kind == "length"]
    content_prompts = [p for p in prompts if p.kind == "content"]

    runners, skipped = {}, {}
    for row in ROWS:
        target = models[("target", row.target)]
        if row.draft is None:
            runners[row.id] = ours_target_only(target, cfg.max_new_tokens, sampling)
            continue
        spec = SpecConfig(draft_len=cfg.draft_len, draft_window=cfg.draft_window if row.window else None)
        engine = SpecEngine(target, models[("draft", row.draft)], spec, tokenizer, draft_tokenizer)
        runners[row.id] = ours_speculative(engine, cfg.max_new_tokens, sampling)
    if cfg.hf_compare:
        try:
            hf_target, hf_draft = _load_hf(paths["target"], dtype, device), _load_hf(paths["draft"], dtype, device)
            runners[HF_ROW.id] = hf_assisted(hf_target, hf_draft, cfg.max_new_tokens, cfg.draft_len, sampling)
        except Exception as e:  # transformers may not know the architecture or may refuse the pair: say so
            skipped[HF_ROW.id] = f"transformers could not load the pair: {type(e).__name__}: {str(e)[:200]}"
    else:
        skipped[HF_ROW.id] = "disabled (hf_compare false)"
    rows = [*ROWS, HF_ROW]

    samples = {r.id: {p.id: [] for p in length_prompts} for r in rows}
    repetitions = cfg.warmup + cfg.runs
    with _bar(repetitions * len(length_prompts) * len(runners), "latency") as bar:
        for rep in range(repetitions):
            for p in length_prompts:
                ids = torch.tensor([p.ids], device=device)
                for row in rows:
                    if row.id not in runners:
                        continue
                    try:
                        s = runners[row.id](ids)
                    except Exception as e:
                        if row.impl != "transformers":
                            raise
                        # transformers' assisted generation changes between versions: report it, keep our rows
                        skipped[row.id] = f"transformers generate failed: {type(e).__name__}: {str(e)[:200]}"
                        del runners[row.id]
                        continue
                    finally:
                        bar.update(1)
                    if rep >= cfg.warmup:
                        samples[row.id][p.id].append(s)

    acceptance_samples = {r.id: {} for r in rows if r.draft is not None and r.id in runners and r.impl == "specquant"}
    with _bar(len(content_prompts) * len(acceptance_samples), "acceptance") as bar:
        for p in content_prompts:
            ids = torch.tensor([p.ids], device=device)
            for rid in acceptance_samples:
                acceptance_samples[rid][p.id] = runners[rid](ids)["spec"]
                bar.update(1)

    costs = measure_costs(cfg, models, lengths)
    curve = drafter_curve(cfg, models[("draft", "w4")], context)

    results_rows = [_row_result(r, cfg, samples, acceptance_samples, skipped, prompts, lengths, costs)
                    for r in rows]
    _add_speedups(results_rows, lengths)
    return {
        "benchmark": "specquant bench",
        "config": cfg.to_json(),
        "environment": env,
        "models": {role: str(p) for role, p in paths.items()},
        "context": context,
        "lengths": lengths,
        "prompts": [p.to_json() for p in prompts],
        "rows": results_rows,
        "costs": costs,
        "draft_latency": curve,
    }


def measure_costs(cfg: BenchConfig, models: dict, lengths: dict[str, int]) -> dict:
    """Per length category, forward times at the mean decode context (prompt + max_new_tokens / 2), all timed
    interleaved: each target's one-token step and (k+1)-token verify, each draft's one-token step (the W4 draft
    also with the window)."""
    k1 = cfg.draft_len + 1
    probes = {"target_hp_step_s": Probe(models[("target", "hp")]),
              "target_hp_verify_s": Probe(models[("target", "hp")], k1),
              "target_w4_step_s": Probe(models[("target", "w4")]),
              "target_w4_verify_s": Probe(models[("target", "w4")], k1),
              "draft_hp_step_s": Probe(models[("draft", "hp")]),
              "draft_w4_step_s": Probe(models[("draft", "w4")]),
              "draft_w4_step_s_window": Probe(models[("draft", "w4")], window=cfg.draft_window)}
    out = {}
    with _bar(len(lengths), "forward costs") as bar:
        for cat, n in lengths.items():
            ctx = n + cfg.max_new_tokens // 2
            out[cat] = {"context": ctx, **forward_times(probes, ctx, cfg.cost_reps)}
            bar.update(1)
    return out


def drafter_curve(cfg: BenchConfig, draft, context: int) -> dict:
    """The W4 draft's one-token forward time against context length, full attention vs the sliding window."""
    contexts = sorted({max(1, int(f * context)) for f in cfg.curve_fractions})
    probes = {"full": Probe(draft), "window": Probe(draft, window=cfg.draft_window)}
    full, windowed = [], []
    with _bar(len(contexts), "drafter latency") as bar:
        for ctx in contexts:
            t = forward_times(probes, ctx, cfg.cost_reps)
            full.append(t["full"])
            windowed.append(t["window"])
            bar.update(1)
    return {"contexts": contexts, "full_s": full, "window_s": windowed, "window": cfg.draft_window}


def _costs_for(row: Row, cfg: BenchConfig, c: dict) -> dict:
    draft_key = f"draft_{row.draft}_step_s" + ("_window" if row.window else "")
    return {"target_step_s": c[f"target_{row.target}_step_s"], "verify_s": c[f"target_{row.target}_verify_s"],
            "draft_step_s": c[draft_key], "baseline_step_s": c["target_hp_step_s"]}


def _row_result(row: Row, cfg: BenchConfig, samples, acceptance_samples, skipped, prompts: list[Prompt],
                lengths: dict[str, int], costs: dict) -> dict:
    res = {"id": row.id, "name": row.name, "impl": row.impl, "target": row.target, "draft": row.draft,
           "draft_window": cfg.draft_window if row.window else None,
           "draft_len": cfg.draft_len if row.draft else None}
    if row.id in skipped:
        return {**res, "status": "skipped", "reason": skipped[row.id]}
    res["status"] = "ok"
    cats = {}
    for cat in lengths:
        cat_prompts = [p for p in prompts if p.category == cat]
        if not cat_prompts:
            continue
        per_prompt = {p.id: samples[row.id][p.id] for p in cat_prompts}
        entry = summarize(per_prompt)
        entry["new_tokens"] = [s["new_tokens"] for ss in per_prompt.values() for s in ss]
        entry["samples"] = {pid: [{k: s[k] for k in ("latency_s", "ttft_s", "tpot_s")} for s in ss]
                            for pid, ss in per_prompt.items()}
        entry["tokens"] = {pid: ss[0]["tokens"] for pid, ss in per_prompt.items() if ss}
        if row.draft is not None and row.impl == "specquant":
            merged = merged_spec(s["spec"] for ss in per_prompt.values() for s in ss)
            entry["acceptance"] = _acceptance(merged)
            entry["predicted"] = predict_row(merged.histogram, merged.draft_tokens, merged.drafts,
                                             _costs_for(row, cfg, costs[cat]))
        elif row.draft is None:
            c = costs[cat]
            entry["predicted"] = {"speedup": c["target_hp_step_s"] / c[f"target_{row.target}_step_s"]}
        cats[cat] = entry
    res["categories"] = cats
    if row.id in acceptance_samples:
        sets = {p.category: [] for p in prompts if p.kind == "content"}
        for p in prompts:
            if p.kind == "content":
                sets[p.category].append(acceptance_samples[row.id][p.id])
        per_set = {name: merged_spec(specs) for name, specs in sets.items()}
        total = merged_spec(spec for specs in sets.values() for spec in specs)
        res["acceptance"] = {name: _acceptance(m) for name, m in per_set.items()}
        res["acceptance_all"] = _acceptance(total)
    return res


def _add_speedups(rows: list[dict], lengths: dict[str, int]):
    """speedup = baseline latency / row latency per category; decode_speedup the same on TPOT; averages are the
    mean over categories; same_tokens: the row produced the baseline-precision target's own tokens."""
    base = next(r for r in rows if r["id"] == BASELINE)
    own = {"hp": BASELINE, "w4": "b"}
    by_id = {r["id"]: r for r in rows}
    for r in rows:
        if r["status"] != "ok":
            continue
        for cat, e in r["categories"].items():
            b = base["categories"][cat]
            e["speedup"] = b["latency_s"] / e["latency_s"]
            e["decode_speedup"] = b["tpot_s"] / e["tpot_s"] if e["tpot_s"] > 0 else float("nan")
            ref = by_id.get(own[r["target"]])
            if ref is not None and ref["status"] == "ok" and r["id"] != ref["id"]:
                e["same_tokens_as"] = {"row": ref["id"], "match": e["tokens"] == ref["categories"][cat]["tokens"]}
        cats = list(r["categories"].values())
        r["speedup_avg"] = sum(e["speedup"] for e in cats) / len(cats)
        r["decode_speedup_avg"] = sum(e["decode_speedup"] for e in cats) / len(cats)
        for key, avg_key in (("latency_s", "latency_avg_s"), ("ttft_s", "ttft_avg_s"), ("tpot_s", "tpot_avg_s"),
                             ("tokens_per_s", "tokens_per_s_avg")):
            r[avg_key] = sum(e[key] for e in cats) / len(cats)
        preds = [e["predicted"]["speedup"] for e in cats if "predicted" in e]
        if len(preds) == len(cats):
            r["predicted_speedup_avg"] = sum(preds) / len(preds)
    for r in rows:  # token ids were kept only for the comparison above
        for e in r.get("categories", {}).values():
            e.pop("tokens", None)
