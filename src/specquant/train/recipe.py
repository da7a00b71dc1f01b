"""Regen + QAD as one cached step of the pipeline (`specquant demo` and `specquant bench` call it).

Teacher-written continuations of the bundled prompts (train/regen.py), then `distill target` on them
(train/qad.py). The result is cached under `cache`: a rerun with the same teacher, student and settings reuses it
(the key holds both checkpoints' sha256 and every setting), and an interrupted run resumes from its checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from specquant.train.config import QADConfig, RegenConfig, TrainConfig
from specquant.util.progress import BAR_ONLY  # the pipeline logs its own line per step (bench/stages.py)


@dataclass
class QADRecipe:
    """How much regen and QAD a pipeline run affords (the demo's presets override these fields)."""

    regen: RegenConfig = field(default_factory=lambda: RegenConfig(limit=64, max_new_tokens=64))
    train: TrainConfig = field(default_factory=lambda: TrainConfig(steps=60, eval_every=30, save_every=30))
    qad: QADConfig = field(default_factory=lambda: QADConfig(eval_samples=8))

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def qad_target(teacher: Path, student: Path, cache: Path, recipe: QADRecipe, log=print) -> tuple[Path, dict]:
    """(path of the QAD target checkpoint, info). Reuses cache/qad when the key matches; resumes otherwise."""
    from specquant.train.qad import fingerprint, run_qad
    from specquant.train.regen import regen

    key = hashlib.sha256(json.dumps({"teacher": fingerprint(teacher), "student": fingerprint(student),
                                     "recipe": recipe.to_json()}, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(cache) / f"qad-{key}"
    done = root / "result.json"
    if done.exists():
        info = json.loads(done.read_text())
        log(f"W4 + QAD target: reused {root / 'run' / 'model'} (same teacher, student and recipe)")
        return root / "run" / "model", {**info, "path": str(root / "run" / "model"), "produced": False}
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    data = root / "regen.jsonl"
    t_regen, cpu_regen = time.perf_counter(), time.process_time()
    made = regen(str(teacher), "bundled", data, recipe.regen, progress=BAR_ONLY)
    log(f"      regen: {made['written'] + made['skipped']} prompts x {recipe.regen.max_new_tokens} tokens from the "
        f"teacher ({made['seconds']:.0f} s)")
    regen_s, regen_cpu_s = time.perf_counter() - t_regen, time.process_time() - cpu_regen
    run = root / "run"
    resume = (run / "checkpoints").exists()
    result = run_qad(str(teacher), str(student), run, recipe.train, recipe.qad, data=str(data), resume=resume,
                     overwrite=not resume and run.exists(), progress=BAR_ONLY)
    info = {"method": f"QAD, {result['steps']} steps", "seconds": time.perf_counter() - t0, "steps": result["steps"], "best_step": result["best"]["step"],
            "start_kl": result["start_eval"]["kl"], "best_kl": result["best_eval"]["kl"],
            "seconds_per_step": result["seconds_per_step"], "regen_tokens": made["new_tokens"],
            "regen_seconds": regen_s, "regen_cpu_seconds": regen_cpu_s}
    log(f"      QAD: {info['steps']} steps, held-out KL to the teacher {info['start_kl']:.5f} -> "
        f"{info['best_kl']:.5f} (best step {info['best_step']}, {info['seconds']:.0f} s)")
    done.write_text(json.dumps(info) + "\n")
    return run / "model", {**info, "path": str(run / "model"), "produced": True}
