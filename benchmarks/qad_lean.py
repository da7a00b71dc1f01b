"""Lean (block-wise) QAD against full QAD: quality on the bundled targets, memory and time at the Qwen3.5 shapes.

Quality (--targets): for each bundled target (tiny-target: dense; tiny-hybrid: Qwen3.5 hybrid) and group size,
the AWQ checkpoint (`specquant quantize`), full QAD and lean QAD (`specquant distill target [--lean]`, the same
flags, so the same training rows: lean's pool is full QAD's steps x batch rows) are scored against the fp32 target
on --eval-samples held-out sequences (quant/quality.compare). Gap recovered = 1 - KL(QAD) / KL(AWQ); the ratio
lean / full recovered, with its standard error by the delta method over the per-sequence KLs (paired: the same
sequences score all three models). Runs found in --run-dir are reused (resumed if unfinished).

Memory (--shapes): a random-init checkpoint of each Qwen3.5 shape (benchmarks/shapes.py; bf16, one safetensors
shard per layer, written a layer at a time, so building it never holds the model) and its RTN W4 student, then
`distill target --lean` for --shape-steps steps per block in a child process: its peak RSS (ru_maxrss), the median
seconds per training step and per block. A watchdog kills the child when MemAvailable falls under --min-available
GB (a shared machine). A table, then one JSON line.

    OMP_NUM_THREADS=1 python benchmarks/qad_lean.py --run-dir runs/qad-lean --targets tiny-target tiny-hybrid
    python benchmarks/qad_lean.py --run-dir runs/qad-lean --targets --shapes qwen3.5-0.8b qwen3.5-2b qwen3.5-4b
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from safetensors.torch import save_file

from specquant.bench.shapes import SHAPES, random_model
from specquant.loader import load_model
from specquant.model.checkpoint import BUNDLED_DIR, copy_tokenizer, load_tokenizer
from specquant.quant import QuantConfig, quantize
from specquant.quant.checkpoint import quantization_config
from specquant.quant.quality import compare, heldout_tokens, logprobs
from specquant.train.qad import BUNDLED_HELDOUT
from specquant.util.files import atomic_dir, claim_out_dir


def cli(args: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specquant.cli", *args], check=True, capture_output=True, text=True,
                          **kw)


# --- quality on the bundled targets ---------------------------------------------------------------------------


def distill(target: str, student: Path, out: Path, lean: bool, a) -> Path:
    done = (out / "lean" / "state.json").exists() and "final_eval" in json.loads(
        (out / "lean" / "state.json").read_text()) if lean else any(
        json.loads(ln).get("event") == "train_end" for ln in (out / "log.jsonl").read_text().splitlines()) \
        if (out / "log.jsonl").exists() else False
    if not done:
        flags = ["--steps", str(a.steps), "--lr", str(a.lr), "--warmup", "10", "--batch", str(a.batch), "--seq-len",
                 str(a.seq_len), "--eval-every", "0", "--eval-samples", "16", "--save-every", "25", "--no-progress"]
        resume = ["--resume"] if (out / ("lean/state.json" if lean else "checkpoints")).exists() else ["--overwrite"]
        cli(["distill", "target", "--teacher", target, "--student", str(student), "--out", str(out), *flags, *resume,
             *(["--lean"] if lean else []), "--json"])
    return out / "model"


def ratio_se(awq: torch.Tensor, full: torch.Tensor, lean: torch.Tensor) -> tuple[float, float]:
    """(A - L) / (A - F) over per-sequence KLs, and its delta-method standard error (paired samples)."""
    x = torch.stack([awq, full, lean]).double()  # [3, samples]
    a, f, l_ = x.mean(1)
    r = (a - l_) / (a - f)
    grad = torch.stack([(l_ - f) / (a - f) ** 2, (a - l_) / (a - f) ** 2, -1 / (a - f)])
    var = grad @ torch.cov(x) @ grad / x.shape[1]
    return float(r), float(var.sqrt())


def quality(run_dir: Path, a) -> dict:
    out = {}
    for target in a.targets:
        teacher = load_model(target)
        tokens = heldout_tokens(load_tokenizer(target), BUNDLED_HELDOUT, a.eval_samples, a.eval_seq_len)
        reference = logprobs(teacher, tokens)
        for g in a.group_sizes:
            root = run_dir / target
            awq = root / f"awq_g{g}"
            if not (awq / "config.json").exists():
                cli(["quantize", "--model", target, "--out", str(awq), "--method", "awq", "--group-size", str(g),
                     "--json"])
            paths = {"AWQ": awq, "full QAD": distill(target, awq, root / f"full_g{g}", False, a),
                     "lean QAD": distill(target, awq, root / f"lean_g{g}", True, a)}
            rows = {k: compare(reference, load_model(p), tokens, per_sample=True) for k, p in paths.items()}
            gap = rows["AWQ"]["kl"]
            r, se = ratio_se(*(rows[k]["kl_per_sample"] for k in ("AWQ", "full QAD", "lean QAD")))
            lean_log = [json.loads(ln) for ln in (root / f"lean_g{g}" / "log.jsonl").read_text().splitlines()]
            blocks = [b for b in lean_log if b.get("event") == "block"]
            out[f"{target} g{g}"] = {
                "rows": {k: {m: v[m] for m in ("kl", "kl_sem", "ppl", "top1_agree")} for k, v in rows.items()},
                "recovered_full": 1 - rows["full QAD"]["kl"] / gap, "recovered_lean": 1 - rows["lean QAD"]["kl"] / gap,
                "ratio": r, "ratio_se": se,
                "lean_blocks_improved": sum(b["best_step"] > 0 for b in blocks), "lean_blocks": len(blocks)}
    return out


# --- memory and time at a model shape -------------------------------------------------------------------------


def one_layer(cfg, i: int):
    """The shape's layer i alone (a 1-layer model with a small vocabulary: the layer does not depend on it)."""
    kinds = cfg.layer_types or ("full_attention",) * cfg.num_hidden_layers
    return dataclasses.replace(cfg, num_hidden_layers=1, layer_types=(kinds[i],), vocab_size=64)


def shape_config(shape: str, layers: int):
    """The shape's config, cut to its first `layers` layers when layers > 0 (every block keeps the shape's size)."""
    cfg = SHAPES[shape]()
    if layers and layers < cfg.num_hidden_layers:
        kinds = cfg.layer_types[:layers] if cfg.layer_types else None
        cfg = dataclasses.replace(cfg, num_hidden_layers=layers, layer_types=kinds)
    return cfg


def write_random_pair(shape: str, root: Path, group: int, layers: int) -> tuple[Path, Path]:
    """root/<shape>[-Nl]-teacher (bf16, random as shapes.random_model) and its RTN W4 student, each a shard per
    layer, built one layer at a time."""
    cfg = shape_config(shape, layers)
    name = f"{shape}-{cfg.num_hidden_layers}l"
    teacher, student = root / f"{name}-teacher", root / f"{name}-w4g{group}"
    if (teacher / "config.json").exists() and (student / "config.json").exists():
        return teacher, student
    maps, ignore, qc = ({}, {}), ["lm_head"], None
    with atomic_dir(teacher, overwrite=True) as t_tmp, atomic_dir(student, overwrite=True) as s_tmp:
        gen = torch.Generator().manual_seed(0)
        embed = torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=torch.bfloat16).normal_(0, 0.02, generator=gen)
        norm = torch.zeros if cfg.zero_centred_norms else torch.ones
        ends = {"model.embed_tokens.weight": embed, "model.norm.weight": norm(cfg.hidden_size, dtype=torch.bfloat16)}
        for tmp, m in ((t_tmp, maps[0]), (s_tmp, maps[1])):
            save_file(ends, tmp / "model-ends.safetensors", metadata={"format": "pt"})
            m.update({k: "model-ends.safetensors" for k in ends})
        del embed, ends
        for i in range(cfg.num_hidden_layers):
            model = random_model(one_layer(cfg, i))
            name = f"model-{i:05d}.safetensors"

            def layer_tensors(m):
                return {k.replace("model.layers.0.", f"model.layers.{i}."): v.detach().contiguous()
                        for k, v in m.state_dict().items() if k.startswith("model.layers.0.")}

            t = layer_tensors(model.to(torch.bfloat16))
            save_file(t, t_tmp / name, metadata={"format": "pt"})
            maps[0].update({k: name for k in t})
            model.float()
            qcfg = QuantConfig(method="rtn", group_size=group)
            quantize(model, qcfg, scale_dtype=torch.bfloat16)
            model.to(torch.bfloat16)
            s = layer_tensors(model)
            save_file(s, s_tmp / name, metadata={"format": "pt"})
            maps[1].update({k: name for k in s})
            layer_qc = quantization_config(model, qcfg)
            qc = qc or layer_qc
            ignore += [n.replace("model.layers.0.", f"model.layers.{i}.") for n in layer_qc["ignore"]
                       if n.startswith("model.")]
            del model, t, s
        hf = {**cfg.to_hf(), "torch_dtype": "bfloat16"}
        for tmp, m, extra in ((t_tmp, maps[0], {}), (s_tmp, maps[1], {"quantization_config": {**qc,
                                                                                             "ignore": ignore}})):
            (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": m}))
            (tmp / "config.json").write_text(json.dumps({**hf, **extra}, indent=2, sort_keys=True) + "\n")
            copy_tokenizer(BUNDLED_DIR / "tiny-target", tmp)
    return teacher, student


def mem_available_gb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def shape_run(shape: str, root: Path, a) -> dict:
    cfg = shape_config(shape, a.shape_layers)
    t0 = time.perf_counter()
    teacher, student = write_random_pair(shape, root, a.shape_group, a.shape_layers)
    written = time.perf_counter() - t0
    out = root / f"{shape}-{cfg.num_hidden_layers}l-lean"
    cmd = [sys.executable, "-m", "specquant.cli", "distill", "target", "--teacher", str(teacher), "--student",
           str(student), "--out", str(out), "--overwrite", "--lean", "--steps", str(a.shape_steps), "--batch", "1",
           "--seq-len", str(a.shape_seq_len), "--lean-forward-batch", "1", "--eval-samples", "2", "--eval-seq-len",
           str(a.shape_seq_len), "--eval-every", "0", "--save-every", str(a.shape_steps), "--warmup", "0",
           "--max-start-kl", "100", "--no-progress", "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    low = None
    t0 = time.perf_counter()
    while proc.poll() is None:
        avail = mem_available_gb()
        if avail < a.min_available:
            low = avail
            proc.kill()
            break
        time.sleep(0.5)
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - t0
    if low is not None:
        return {"shape": shape, "stopped": f"MemAvailable {low:.1f} GB < {a.min_available} GB: killed"}
    if proc.returncode != 0:
        return {"shape": shape, "stopped": f"exit {proc.returncode}: {stderr.strip().splitlines()[-1:]}"}
    r = json.loads(stdout.splitlines()[-1])
    layer_params = sum(p.numel() for p in random_model(one_layer(cfg, 0)).model.layers.parameters())
    return {"shape": shape, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
            "params_layer0": layer_params, "peak_rss_mb": r["peak_memory_mb"],
            "peak_rss_blocks_mb": r["peak_rss_blocks_mb"], "peak_rss_start_mb": r["peak_rss_start_mb"],
            "peak_rss_end_mb": r["peak_rss_end_mb"],
            "seconds_per_step": r["seconds_per_step"], "seconds_per_block": r["seconds_per_block"],
            "wall_s": wall, "write_s": written, "steps_per_block": a.shape_steps, "seq_len": a.shape_seq_len,
            "kl_start": r["start_eval"]["kl"], "kl_end": r["best_eval"]["kl"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", default="runs/qad-lean")
    p.add_argument("--targets", nargs="*", default=["tiny-target", "tiny-hybrid"])
    p.add_argument("--group-sizes", type=int, nargs="+", default=[32, 128])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--eval-samples", type=int, default=64)
    p.add_argument("--eval-seq-len", type=int, default=256)
    p.add_argument("--shapes", nargs="*", default=[], choices=[s for s in SHAPES if s.startswith("qwen3.5")])
    p.add_argument("--shape-steps", type=int, default=2, help="training steps per block at a shape")
    p.add_argument("--shape-seq-len", type=int, default=256)
    p.add_argument("--shape-group", type=int, default=128)
    p.add_argument("--shape-layers", type=int, default=0,
                   help="only the shape's first N layers (0 = all): per-block figures at full size, fewer blocks")
    p.add_argument("--min-available", type=float, default=2.0, help="GB; kill the shape run below this")
    a = p.parse_args()
    run_dir = claim_out_dir(a.run_dir, overwrite=True, flag="--run-dir")
    result = {"quality": quality(run_dir, a) if a.targets else {}, "shapes": [],
              "threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    for shape in a.shapes:
        result["shapes"].append(shape_run(shape, run_dir / "shapes", a))
        print(f"# {json.dumps(result['shapes'][-1])}", file=sys.stderr, flush=True)
    if result["quality"]:
        print(f"held-out: {a.eval_samples} x {a.eval_seq_len} tokens; {a.steps} steps x {a.batch} x {a.seq_len} "
              f"tokens, lr {a.lr}")
        print(f"{'target':<17} {'model':<9} {'KL to fp32':>11} {'± SEM':>9} {'top-1':>7}")
        for key, q in result["quality"].items():
            for name, v in q["rows"].items():
                print(f"{key:<17} {name:<9} {v['kl']:>11.6f} {v['kl_sem']:>9.6f} {v['top1_agree']:>7.2%}")
            print(f"{key:<17} recovered: full {q['recovered_full']:.1%}, lean {q['recovered_lean']:.1%}; lean / full "
                  f"{q['ratio']:.1%} ± {q['ratio_se']:.1%} (blocks improved {q['lean_blocks_improved']}/"
                  f"{q['lean_blocks']})")
    for s in result["shapes"]:
        if "stopped" in s:
            print(f"{s['shape']}: {s['stopped']}")
        else:
            print(f"{s['shape']} ({s['layers']} layers): peak RSS {s['peak_rss_mb']:.0f} MB (blocks "
                  f"{s['peak_rss_blocks_mb']:.0f}, start eval {s['peak_rss_start_mb']:.0f}, end eval + export "
                  f"{s['peak_rss_end_mb']:.0f}), {s['seconds_per_step']:.2f} s/step, {s['seconds_per_block']:.1f} "
                  f"s/block, {s['wall_s']:.0f} s in all")
    print(json.dumps(result, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
