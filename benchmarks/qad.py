"""QAD quality table: fp32 / RTN / AWQ / GPTQ / AWQ + QAD of the bundled target at g32 and g128, on held-out text.

For each group size: quantize tiny-target with each method (`specquant quantize`, skipped when the checkpoint is
already in --run-dir), run `specquant distill target` on the AWQ checkpoint (resumed when a run is there), then
score every model against the fp32 target on --eval-samples held-out sequences of --eval-seq-len tokens
(src/specquant/data/heldout.txt, never trained on): KL(fp32 || model) with its standard error over sequences,
perplexity and top-1 agreement (specquant.quant.quality.compare). "gap recovered" = 1 - KL(QAD) / KL(AWQ), the
AWQ -> fp32 KL gap closed by QAD. Seconds per step and peak memory come from a separate short run per group size
(--cost-steps), the two back to back, each in its own process.
The table goes to stdout first; the last stdout line is one JSON object.

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/qad.py --run-dir runs/qad-bench
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from specquant.errors import SpecquantError
from specquant.loader import load_model
from specquant.model.checkpoint import load_tokenizer
from specquant.quant.quality import compare, heldout_tokens, logprobs
from specquant.train.config import QADConfig, TrainConfig
from specquant.train.qad import BUNDLED_HELDOUT, run_qad
from specquant.util.files import claim_out_dir
from specquant.train.trainer import checkpoints
from specquant.util.flags import finite_float

METHODS = ("rtn", "awq", "gptq")


def quantized(run_dir: Path, method: str, group: int) -> Path:
    out = run_dir / f"{method}_g{group}"
    if not (out / "config.json").exists():
        subprocess.run([sys.executable, "-m", "specquant.cli", "quantize", "--model", "tiny-target", "--out",
                        str(out), "--method", method, "--group-size", str(group), "--json"], check=True,
                       stdout=subprocess.DEVNULL)
    return out


def qad_run(run_dir: Path, group: int, train: TrainConfig, qad: QADConfig) -> Path:
    out = run_dir / f"qad_g{group}"
    done = checkpoints(out)
    if not (done and int(done[-1].name.split("-")[1]) >= train.steps and (out / "model").exists()):
        run_qad("tiny-target", str(quantized(run_dir, "awq", group)), out, train, qad, resume=bool(done),
                progress=False)
    return out


def step_cost(run_dir: Path, group: int, train: TrainConfig, steps: int) -> dict:
    """Median seconds per step and peak memory of a fresh `steps`-step run in its own process (so its peak RSS
    is its own), with the measured run's batch and sequence length; the group sizes run back to back."""
    out = run_dir / f"cost_g{group}"
    cmd = [sys.executable, "-m", "specquant.cli", "distill", "target", "--teacher", "tiny-target", "--student",
           str(quantized(run_dir, "awq", group)), "--out", str(out), "--overwrite", "--steps", str(steps),
           "--batch", str(train.batch), "--seq-len", str(train.seq_len), "--lr", str(train.lr), "--eval-every",
           "0", "--eval-samples", "2", "--save-every", str(steps), "--json"]
    result = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
    return {"seconds_per_step": result["seconds_per_step"], "peak_memory_mb": result["peak_memory_mb"],
            "steps": steps, "optimizer": result["optimizer"]}


def train_stats(qad_dir: Path) -> dict:
    rows = [json.loads(ln) for ln in (qad_dir / "log.jsonl").read_text().splitlines()]
    steps = [r["seconds"] for r in rows if "loss" in r]
    end = [r for r in rows if r.get("event") == "train_end"][-1]
    best = end["best_step"]
    start = next(r for r in rows if r.get("event") == "train_start")
    return {"steps": len(steps), "median_seconds_per_step_in_run": sorted(steps)[len(steps) // 2], "best_step": best,
            "tokens_per_step": start["global_batch"] * start["config"]["seq_len"],
            "lr": start["config"]["lr"], "optimizer": start["optimizer"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", default="runs/qad-bench")
    p.add_argument("--group-sizes", type=int, nargs="+", default=[32, 128])
    p.add_argument("--eval-samples", type=int, default=64)
    p.add_argument("--eval-seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=TrainConfig.steps)
    p.add_argument("--lr", type=finite_float(TrainConfig.lr), default=TrainConfig.lr)
    p.add_argument("--batch", type=int, default=TrainConfig.batch)
    p.add_argument("--seq-len", type=int, default=TrainConfig.seq_len)
    p.add_argument("--eval-every", type=int, default=TrainConfig.eval_every)
    p.add_argument("--cost-steps", type=int, default=10, help="steps of the separate s/step + memory run")
    p.add_argument("--overwrite", action="store_true",
                   help="write into --run-dir even when it is a non-empty folder specquant did not create")
    args = p.parse_args()
    try:  # the --out policy of every command (util/files.py), before any work
        run_dir = claim_out_dir(args.run_dir, args.overwrite, "--run-dir")
    except SpecquantError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    train = TrainConfig(steps=args.steps, lr=args.lr, batch=args.batch, seq_len=args.seq_len,
                        eval_every=args.eval_every, save_every=25)
    qad = QADConfig(eval_samples=16)  # the run's own best-step choice; the table below uses --eval-samples

    teacher = load_model("tiny-target", dtype=torch.float32)
    tokens = heldout_tokens(load_tokenizer("tiny-target"), BUNDLED_HELDOUT, args.eval_samples, args.eval_seq_len)
    reference = logprobs(teacher, tokens)  # computed once, compared many times
    fp32 = compare(reference, teacher, tokens)
    results = {"eval": {"samples": len(tokens), "seq_len": tokens.shape[1], "tokens": tokens.numel(),
                        "text": str(BUNDLED_HELDOUT)}, "groups": {}}
    for g in args.group_sizes:
        paths = {m.upper(): quantized(run_dir, m, g) for m in METHODS}
        qad_dir = qad_run(run_dir, g, train, qad)
        paths["AWQ+QAD"] = qad_dir / "model"
        rows = {"fp32": fp32}
        for name, path in paths.items():
            rows[name] = compare(reference, load_model(path, dtype=torch.float32), tokens)
        gap = rows["AWQ"]["kl"]
        results["groups"][g] = {
            "rows": {k: {m: v[m] for m in ("kl", "kl_sem", "ppl", "top1_agree")} for k, v in rows.items()},
            "awq_gap": gap, "sem_over_gap": rows["AWQ"]["kl_sem"] / gap,
            "gap_recovered": 1 - rows["AWQ+QAD"]["kl"] / gap, "train": train_stats(qad_dir),
        }
    for g in args.group_sizes:
        results["groups"][g]["cost"] = step_cost(run_dir, g, train, args.cost_steps)
    print(f"held-out: {len(tokens)} sequences x {tokens.shape[1]} tokens of {BUNDLED_HELDOUT.name}")
    for g, r in results["groups"].items():
        print(f"\ngroup size {g}  (QAD: {r['train']['steps']} steps, lr {r['train']['lr']}, "
              f"{r['train']['tokens_per_step']} tokens/step, best step {r['train']['best_step']}; "
              f"{r['cost']['seconds_per_step']:.2f} s/step, peak RSS {r['cost']['peak_memory_mb']:.0f} MB "
              f"over a separate {r['cost']['steps']}-step run, {r['cost']['optimizer']})")
        print(f"{'model':<9} {'KL to fp32':>12} {'± SEM':>10} {'ppl':>9} {'top-1':>8}")
        for name, v in r["rows"].items():
            print(f"{name:<9} {v['kl']:>12.6f} {v['kl_sem']:>10.6f} {v['ppl']:>9.2f} {v['top1_agree']:>8.2%}")
        print(f"AWQ gap recovered by QAD: {r['gap_recovered']:.1%}; SEM / gap: {r['sem_over_gap']:.1%}")
    results["threads"] = torch.get_num_threads()
    results["omp_num_threads"] = os.environ.get("OMP_NUM_THREADS")
    print(json.dumps(results, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
