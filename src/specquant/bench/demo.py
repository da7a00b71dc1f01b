"""`specquant demo`: quantize the bundled target (AWQ) and draft (GPTQ), QAD the W4 target, bench every row; then
the same on the bundled Qwen3.5-style hybrid pair, with its MTP drafter beside the block drafter.

The main job on both architectures, end to end, in one report (out/report.md, a section per architecture; each
pair's own files: out/ and out/hybrid/). Budget: ≤ 5 minutes on a 2-core Zen 1 with one row per story (the
default preset); `--full` runs every row (the whole table), `--quick` is a smoke run (docs/BENCH.md).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from specquant.bench.config import BenchConfig

# What the demo changes from BenchConfig's defaults to fit its time budget (everything else: BenchConfig).
# "full" (`--full`, the whole table): every row on both pairs. The full preset's AWQ: 16 calibration sequences and
# a 10-point alpha grid (a subset of the 20-point one, so never worse than RTN on its loss) gave the bundled target
# the same held-out KL to fp32 as 32 and 20, within its standard error, in under half the time (the git history of
# docs/BENCH.md); the W4 draft keeps GPTQ's 32 sequences. Two timed rounds, not the bench's 3: the latency runs
# were 57% of the demo, and the first two of a full demo's three rounds gave every row's speedup within 1% of the
# three rounds' on the Qwen3 pair, with the rows' order unchanged on both pairs (docs/BENCH.md, "The demo").
# "default" (no flag): one row per story, sized for 5 minutes on a 2-core Zen 1 (docs/BENCH.md, "The default
# preset": what each part costs and tells, and the measured times).
FULL = dict(runs=2, prompts_per_length=2, prompts_per_set=2, cost_reps=10,
            curve_fractions=(1 / 16, 1 / 4, 1 / 2, 3 / 4),
            quant_overrides={"calib_samples": 16, "awq": {"grid": 10}},
            draft_quant_overrides={**BenchConfig().draft_quant_overrides, "calib_samples": 32},
            qad_steps=60, qad_prompts=64, qad_new_tokens=64, hf_runs=1, warmup_all_prompts=False)
# The default's rows: (a) the baseline, (b) W4 target, (q) W4 + QAD, (d) / (e) the W4 LM drafter without and with
# its window, (g) the W4 block drafter, (s) the suffix drafter (and on the hybrid (n), its W4 MTP layer). Left to
# --full: (c), (f), (m) (the same drafters unquantized: the W4 rows draft as well, docs/BENCH.md), (h) (the window
# is (e)'s story), (u), (p) (levers over (g) and (s)) and the transformers row.
DEFAULT_ROWS = ["a", "b", "q", "d", "e", "g", "s"]
PRESETS = {
    "default": dict(rows=DEFAULT_ROWS, hf_compare=False, whole_block_pass=False, max_new_tokens=48, runs=3,
                    prompts_per_length=1, prompts_per_set=1, lengths={"short": 32, "long": 512},
                    content_max_tokens=256, cost_reps=2, curve_fractions=(1 / 16, 1 / 2),
                    quant_overrides={"calib_samples": 8, "seq_len": 128, "awq": {"grid": 5, "clip": False}},
                    draft_quant_overrides={**BenchConfig().draft_quant_overrides, "calib_samples": 16},
                    block_draft_quant={**BenchConfig().block_draft_quant, "calib_samples": 8, "seq_len": 128},
                    qad_steps=8, qad_prompts=16, qad_new_tokens=32, qad_eval_samples=4, warmup_all_prompts=False),
    "full": FULL,
    "quick": dict(max_new_tokens=32, runs=1, prompts_per_length=1, prompts_per_set=1, cost_reps=5,
                  lengths={"short": 32, "medium": 128, "long": 512}, curve_fractions=(1 / 16, 1 / 4, 1 / 2),
                  quant_overrides={"calib_samples": 8, "seq_len": 128, "awq": {"grid": 5, "clip": False}},
                  qad_steps=6, qad_prompts=8, qad_new_tokens=32, qad_eval_samples=4, warmup_all_prompts=False),
}
# Steps of the full pipeline that the demo does not run (too slow for its budget), with the command that does.
NOT_RUN = {
    "drafter adaptation": "the LM draft is not adapted to the W4 target here; `specquant distill draft --kind lm "
                          "--target W4_DIR --init tiny-draft --out DIR` does it (KL to the target's logits), and "
                          "`--kind block` trains a block drafter (docs/BLOCK_DRAFT.md)",
}
DEFAULT_OUT = "runs/demo"
# The hybrid pair: tiny-hybrid (Gated DeltaNet + gated attention), its block drafter and its MTP layer ("init": the
# checkpoint's mtp.* tensors, else an untrained one from its last attention layer, which the report flags). The LM
# rows (c)-(e) draft with tiny-draft: it shares tiny-hybrid's tokenizer (same tokenizer.json), so it is a valid LM
# drafter for it, and the LM rows keep the three drafter kinds side by side on both architectures (the bench's
# context and drafter-latency curve are an LM draft's too).
HYBRID = {"target": "tiny-hybrid", "draft": "tiny-draft", "block_draft": "tiny-hybrid-block-draft", "mtp": "init"}
HYBRID_DIR = "hybrid"  # under --out
# What the hybrid section changes on top of the preset: transformers' assisted generation refused recurrent
# targets up to 5.24 (the hf row would only be skipped; 5.25 runs it, not yet compared with ours here), and with
# --quick shorter prompts and fewer tokens keep it small (every prompt category stays: a category that is not a
# length category would count as a content set, bench/prompts.py)
HYBRID_PRESETS = {
    "default": dict(hf_compare=False, rows=[*DEFAULT_ROWS, "n"]),
    "full": dict(hf_compare=False),
    "quick": dict(hf_compare=False, max_new_tokens=24, lengths={"short": 32, "medium": 96, "long": 192},
                  content_max_tokens=128, cost_reps=3, curve_fractions=(1 / 4,), qad_steps=4, qad_prompts=4,
                  qad_new_tokens=24),
}


def add_parser(sub):
    p = sub.add_parser("demo", help="the whole pipeline on the bundled pair: quantize, then bench every row",
                       description=__doc__.splitlines()[0])
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output directory, relative to the cwd (default: {DEFAULT_OUT})")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--full", dest="preset", action="store_const", const="full", default="default",
                      help="the whole table: every row on both pairs, more prompts, calibration and QAD steps "
                           "(several times the default's time)")
    size.add_argument("--quick", dest="preset", action="store_const", const="quick",
                      help="fewer tokens and runs, small calibration: a smoke run, too short to read speedups from")
    p.add_argument("--overwrite", action="store_true", help=BenchConfig.__dataclass_fields__["overwrite"].metadata["help"])
    p.add_argument("--no-hybrid", dest="hybrid", action="store_false",
                   help="skip the hybrid pair's section (tiny-hybrid with its block and MTP drafters)")
    p.add_argument("--serve", action="store_true",
                   help="then serve the W4 pair on loopback and time it with `specquant latency` (short category)")
    return p


def demo_config(out: str, preset: str = "default") -> BenchConfig:
    return dataclasses.replace(BenchConfig(), out=out, **PRESETS[preset])


def hybrid_config(out: str, preset: str, overrides: dict, hybrid_overrides: dict | None = None) -> BenchConfig:
    """The hybrid section's BenchConfig: the demo's preset, then HYBRID_PRESETS, then the caller's overrides (the
    ones given to both sections, then the hybrid's own), in out/hybrid."""
    return dataclasses.replace(demo_config(str(Path(out) / HYBRID_DIR), preset),
                               **{**HYBRID_PRESETS[preset], **overrides, **(hybrid_overrides or {})})


def run_demo(out: str = DEFAULT_OUT, preset: str = "default", target: str = "tiny-target", draft: str = "tiny-draft",
             log=print, block_draft: str | None = "tiny-block-draft", serve: bool = False,
             hybrid: dict | None = HYBRID, hybrid_overrides: dict | None = None, **overrides) -> dict:
    """The demo as a function (the tests call it on small random checkpoints); returns results.json's content with
    the quality gate's verdict added ("quality_gate"), with serve the served pair's latency ("served"), and with
    hybrid (HYBRID's keys; None: skipped) the hybrid section's results.json content ("hybrid")."""
    from specquant.bench.ablation import run_bench
    from specquant.bench.report import summary_table, write_demo_report
    from specquant.bench.stages import StageTimes

    cfg = dataclasses.replace(demo_config(out, preset), **overrides)
    t0 = time.perf_counter()
    times = StageTimes()  # the demo's parts; each bench logs and reports its own stages
    steps = 4 if hybrid else 3
    log(f"[1/{steps}] quantize {target} with {cfg.target_method.upper()} and {draft} with {cfg.draft_method.upper()}, "
        f"QAD the W4 target on teacher-written text ({cfg.qad_steps} steps), then bench "
        + (f"rows {', '.join(f'({r})' for r in cfg.rows)}" if cfg.rows else "every row")
        + f" ({preset} preset{'; --full runs every row' if preset == 'default' else ''})")
    if block_draft:
        log(f"      block rows: the block drafter {block_draft} (GPTQ W4 on the target's features), "
            f"k = {cfg.block_draft_len}")
    for name, what in NOT_RUN.items():
        log(f"      {name}: not run by the demo ({what})")
    with times("Qwen3 pair: bench"):
        results, files = run_bench(cfg, target, draft, log=log, block_draft=block_draft)
    log(f"[2/{steps}] quality gate: the W4 target against the fp32 target (specquant gate's kl gate)")
    from specquant.gate.kl import demo_gate

    w4 = results.quantized["quantized_target"]
    with times("quality gate"):
        gate = demo_gate(w4["path"] if isinstance(w4, dict) else w4, target, preset == "quick", log)
    served = None
    if serve:  # optional: needs the serve extra, and its time is outside the demo's budget
        from specquant.serve.config import LatencyConfig
        from specquant.serve.latency import serve_and_time

        path = lambda p: p["path"] if isinstance(p, dict) else p  # noqa: E731
        log("      serve: the W4 pair on loopback, timed with specquant latency's protocol (short category)")
        with times("serve and time the W4 pair"):
            served = serve_and_time(path(w4), path(results.quantized["quantized_draft"]),
                                    LatencyConfig(categories=["short"], runs=3 if preset == "quick" else 10,
                                                  warmup=1), log)
    sections, hybrid_results = [("Qwen3 pair", f"{target} + {draft}", files, "")], None
    if hybrid:
        hcfg = hybrid_config(out, preset, overrides, hybrid_overrides)
        log(f"[3/{steps}] the hybrid pair: {hybrid['target']} (W4 by {hcfg.target_method.upper()}, QAD "
            f"{hcfg.qad_steps} steps), LM draft {hybrid['draft']}, block drafter {hybrid['block_draft']}, MTP drafter "
            f"({hybrid['mtp']}) dense and W4 -> {hcfg.out}; the quality gate runs on the Qwen3 pair only")
        shared = _shared_draft(cfg, hcfg, draft, hybrid["draft"], results.quantized["quantized_draft"], log)
        with times("hybrid pair: bench"):
            hybrid_results, hybrid_files = run_bench(hcfg, hybrid["target"], hybrid["draft"], log=log,
                                                     block_draft=hybrid["block_draft"], mtp_draft=hybrid["mtp"],
                                                     quantized_draft=shared)
        log(f"      the hybrid section took {times.stages[-1].seconds:.0f} s")
        sections.append(("Qwen3.5 hybrid pair", f"{hybrid['target']} + {hybrid['block_draft']} + its MTP layer",
                         hybrid_files, HYBRID_DIR))
    report = write_demo_report(Path(cfg.out), sections, times)
    log(f"[{steps}/{steps}] done in {time.perf_counter() - t0:.0f} s\n")
    log(summary_table(results))
    if hybrid_results is not None:
        log("\nhybrid pair:\n" + summary_table(hybrid_results))
    log(f"\nreport: {report or Path(cfg.out) / 'report.md'}; numbers: {Path(cfg.out) / 'results.json'}"
        + (f", {Path(cfg.out) / HYBRID_DIR / 'results.json'}" if hybrid else "") + "; plots: "
        + ", ".join(f.name for f in files if f.suffix == ".png"))
    return {**results.to_json(), "quality_gate": gate, **({"served": served} if serve else {}),
            **({"hybrid": hybrid_results.to_json()} if hybrid_results is not None else {})}


def _shared_draft(cfg: BenchConfig, hcfg: BenchConfig, draft, hybrid_draft, quantized, log) -> Path | None:
    """The Qwen3 section's W4 LM draft for the hybrid section, when both sections draft with the same checkpoint
    quantized the same way (the bundled pairs share tiny-draft): GPTQ is deterministic, so quantizing it again
    would write the same file. None: the hybrid section quantizes its own."""
    from specquant.model.checkpoint import resolve

    same = (resolve(draft).resolve() == resolve(hybrid_draft).resolve() and cfg.draft_method == hcfg.draft_method
            and cfg.quant_overrides_for("draft") == hcfg.quant_overrides_for("draft"))
    if not same:
        return None
    path = Path(quantized["path"] if isinstance(quantized, dict) else quantized)
    log(f"      W4 draft for the hybrid section: {path} (the same checkpoint and {cfg.draft_method.upper()} "
        "settings as the Qwen3 section's)")
    return path


def run(args) -> int:
    run_demo(args.out, args.preset, overwrite=args.overwrite, serve=args.serve, hybrid=HYBRID if args.hybrid else None)
    return 0
