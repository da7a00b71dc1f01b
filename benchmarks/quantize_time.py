"""How long `specquant quantize` takes on a real model shape, and what calibration size buys on a trained model.

Time: the CLI end to end, each run a fresh process (imports, load, calibration, quantization, save), on a
random-init checkpoint of --shape (benchmarks/shapes.py's configs, e.g. Qwen3-0.6B; stored bf16 like the published
weights, with the bundled tokenizer; built once into --ckpt-dir and reused). Per method and calibration size:
wall seconds and the child's CPU seconds (user + sys). On a machine shared with other jobs wall exceeds CPU by the
share the others took; run it as `taskset -c 0 nice python ...` with --threads 1 for the one-core figure.
RTN reads no text by default; it is timed with --report-samples 0 and 1 (1: one calibration sequence run only for
the per-layer output-error report).

Quality: random weights say nothing about what calibration buys, so the same methods and calibration sizes are
applied to tiny-target (trained, bundled) and compared with it on held-out text (quant/quality.py): KL(fp || W4)
per position, perplexity, top-1 agreement, and the seconds quantize() took there.

Shape KL (--shape-kl N): each timed run's output is also compared with the random checkpoint itself, in fp32, on N
held-out sequences of 256 tokens (KL, top-1 agreement). The fp32 model's log-probabilities are computed once, in a
child process, into a file beside the checkpoint, and each comparison is a child process too (shape_kl), so no
model is held here while a quantize process runs. On random weights this measures how far each method's rounding
moves the output distribution, not what calibration buys (that is the quality part's question).

Usage: python benchmarks/quantize_time.py [--shape qwen3-0.6b] [--methods rtn,awq,gptq] [--calib-samples 8,32]
       [--threads 1] [--ckpt-dir runs/quantize_time] [--skip-time] [--skip-quality] [--eval-samples 16]
       [--shape-kl 0] [--awq-grid N]
A table, then one JSON line.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/shapes.py: the shapes' configs
from shapes import SHAPES, random_model  # noqa: E402

from specquant.loader import load_model  # noqa: E402
from specquant.model.checkpoint import BUNDLED_DIR, load_dense, load_tokenizer, save_model  # noqa: E402
from specquant.quant import QuantConfig, quantize  # noqa: E402
from specquant.quant.config import BUNDLED_CALIB  # noqa: E402
from specquant.quant.quality import compare, heldout_tokens, logprobs  # noqa: E402
from specquant.util.files import atomic_write  # noqa: E402


def random_checkpoint(shape: str, root: Path) -> Path:
    """root/<shape>-random: N(0, 0.02) matrices, unit norms, bf16, the bundled tokenizer; built once."""
    path = root / f"{shape}-random"
    if (path / "model.safetensors").exists():
        return path
    model = random_model(SHAPES[shape]())
    save_model(model.to(torch.bfloat16), path, tokenizer_from=BUNDLED_DIR / "tiny-target")
    return path


def time_cli(ckpt: Path, argv: list[str], threads: int, evaluate=None) -> dict:
    """One `specquant quantize` process: wall and CPU seconds, and the seconds its report gives quantize();
    evaluate(output dir) -> dict adds its keys (after the timing, before the output is deleted)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    with tempfile.TemporaryDirectory(dir=ckpt.parent) as tmp:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "specquant.cli", "quantize", "--model", str(ckpt),
                               "--out", str(Path(tmp) / "q"), "--json", *argv], env=env, capture_output=True,
                              text=True)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0:
            raise SystemExit(f"specquant quantize {' '.join(argv)} failed:\n{proc.stderr[-2000:]}")
        extra = evaluate(Path(tmp) / "q") if evaluate is not None else {}
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "quantize_s": report["seconds"], **extra}


def shape_kl(ckpt: Path, samples: int, threads: int):
    """evaluate() for time_cli: KL(fp32 checkpoint || quantized output) on `samples` held-out sequences of 256.

    Each side runs in its own process (this script with --kl-reference / --kl-eval): the fp32 reference's
    log-probabilities are written once to a safetensors file beside the checkpoint, and each evaluation loads the
    quantized model and that file. So this process never holds a model or the log-probabilities while a quantize
    process runs: at the 4B shape AWQ alone peaks near 21 GB of a 24 GiB machine."""
    ref = ckpt.parent / f"{ckpt.name}-reference-{samples}x256.safetensors"
    if not ref.exists():
        t0 = time.perf_counter()
        _child(["--kl-reference", str(ckpt), str(ref), str(samples), "--threads", str(threads)])
        print(f"shape reference: {samples} x 256 tokens in {time.perf_counter() - t0:.0f} s", file=sys.stderr,
              flush=True)

    def evaluate(out: Path) -> dict:
        t0 = time.perf_counter()
        r = json.loads(_child(["--kl-eval", str(out), str(ref), "--threads", str(threads)]).strip().splitlines()[-1])
        return {**r, "shape_eval_s": round(time.perf_counter() - t0, 1)}

    return evaluate


def _child(argv: list[str]) -> str:
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), *argv], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"quantize_time {' '.join(argv)} failed:\n{proc.stderr[-2000:]}")
    return proc.stdout


def kl_reference(ckpt: Path, out: Path, samples: int) -> None:
    """--kl-reference: the held-out tokens and the fp32 checkpoint's log-probabilities, one tensor per sequence."""
    from safetensors.torch import save

    tokens = heldout_tokens(load_tokenizer(ckpt), BUNDLED_CALIB.with_name("heldout.txt"), samples, 256)
    reference = logprobs(load_model(ckpt, "float32"), tokens, batch_size=1)
    atomic_write(out, save({"tokens": tokens, **{f"logp.{i}": t for i, t in enumerate(reference)}}))


def kl_eval(model_dir: Path, ref: Path) -> None:
    """--kl-eval: KL(reference || model) and top-1 agreement as one JSON line."""
    from safetensors.torch import load_file

    data = load_file(str(ref))
    tokens = data.pop("tokens")
    reference = [data[f"logp.{i}"] for i in range(len(data))]
    r = compare(reference, load_model(model_dir, "float32"), tokens, batch_size=1)
    print(json.dumps({"shape_kl": r["kl"], "shape_kl_sem": r["kl_sem"], "shape_top1_agree": r["top1_agree"]}))


def runs(methods: list[str], calib: list[int], awq_grid: int | None = None) -> list[tuple[str, dict]]:
    """(label, QuantConfig overrides as CLI flags) for every method and calibration size (awq_grid: AWQ's alpha
    grid, None: its default)."""
    out = []
    for method in methods:
        if method == "rtn":
            out += [("rtn", {"method": "rtn", "report_samples": 0}), ("rtn +report", {"method": "rtn",
                                                                                      "report_samples": 1})]
        else:
            grid = {"awq": {"grid": awq_grid}} if method == "awq" and awq_grid else {}
            out += [(f"{method} n={n}", {"method": method, "calib_samples": n, **grid}) for n in calib]
    return out


def flags(overrides: dict) -> list[str]:
    """QuantConfig.from_json-style overrides as `specquant quantize` flags (a method's section: --awq-grid ...)."""
    flat = {}
    for k, v in overrides.items():
        flat.update({f"{k}_{f}": x for f, x in v.items()} if isinstance(v, dict) else {k: v})
    return [x for k, v in flat.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def quality(label: str, overrides: dict, fp, tok, heldout, reference) -> dict:
    model = copy.deepcopy(fp)
    t0 = time.perf_counter()
    quantize(model, QuantConfig.from_json(overrides), tok)
    seconds = time.perf_counter() - t0
    r = compare(reference, model, heldout)
    return {"kl": r["kl"], "kl_sem": r["kl_sem"], "ppl": r["ppl"], "ppl_ref": r["ppl_ref"],
            "top1_agree": r["top1_agree"], "tiny_quantize_s": round(seconds, 2)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-0.6b", choices=[s for s in SHAPES if s != "tiny-target"])
    ap.add_argument("--methods", default="rtn,awq,gptq")
    ap.add_argument("--calib-samples", default="8,32", help="calibration sizes for AWQ and GPTQ (comma-separated)")
    ap.add_argument("--awq-grid", type=int, default=None, help="AWQ's alpha grid (default: quantize's); its time "
                    "is proportional to it, and the demo uses 10")
    ap.add_argument("--threads", type=int, default=1, help="threads of each quantize process (default: 1)")
    ap.add_argument("--ckpt-dir", default="runs/quantize_time", help="where the random checkpoint is built once")
    ap.add_argument("--eval-samples", type=int, default=16, help="held-out sequences of 256 tokens (quality)")
    ap.add_argument("--skip-time", action="store_true")
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--shape-kl", type=int, default=0, metavar="N",
                    help="also KL of each timed output to the fp32 random checkpoint on N sequences of 256 (0: off)")
    ap.add_argument("--kl-reference", nargs=3, metavar=("CKPT", "OUT", "N"), help=argparse.SUPPRESS)
    ap.add_argument("--kl-eval", nargs=2, metavar=("MODEL", "REF"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.kl_reference:  # the child processes of --shape-kl (shape_kl)
        return kl_reference(Path(args.kl_reference[0]), Path(args.kl_reference[1]), int(args.kl_reference[2]))
    if args.kl_eval:
        return kl_eval(Path(args.kl_eval[0]), Path(args.kl_eval[1]))
    plan = runs(args.methods.split(","), [int(n) for n in args.calib_samples.split(",")], args.awq_grid)
    result = {"shape": args.shape, "threads": args.threads, "load_avg_start": os.getloadavg()[0], "runs": {}}
    rows = {label: {} for label, _ in plan}
    if not args.skip_quality:
        fp = load_dense("tiny-target")
        tok = load_tokenizer("tiny-target")
        heldout = heldout_tokens(tok, BUNDLED_CALIB.with_name("heldout.txt"), args.eval_samples, 256)
        reference = logprobs(fp, heldout)
        for label, overrides in plan:
            rows[label].update(quality(label, overrides, fp, tok, heldout, reference))
            print(f"quality {label}: {rows[label]}", file=sys.stderr, flush=True)
    if not args.skip_time:
        ckpt = random_checkpoint(args.shape, Path(args.ckpt_dir))
        evaluate = shape_kl(ckpt, args.shape_kl, args.threads) if args.shape_kl else None
        for label, overrides in plan:
            rows[label].update(time_cli(ckpt, flags(overrides), args.threads, evaluate))
            print(f"time {label}: {rows[label]}", file=sys.stderr, flush=True)
    result["load_avg_end"] = os.getloadavg()[0]
    result["runs"] = rows
    print(f"{'run':<14} {args.shape + ' wall s':>16} {'CPU s':>8} {'quantize() s':>13} {'KL':>9} {'top-1':>7} | "
          f"tiny-target: "
          f"{'KL':>9} {'ppl':>8} {'top-1':>7} {'s':>6}")
    for label, r in rows.items():
        def fmt(key, spec):
            return format(r[key], spec) if key in r else format("-", ">" + spec.split(".")[0])
        print(f"{label:<14} {fmt('wall_s', '16.1f')} {fmt('cpu_s', '8.1f')} {fmt('quantize_s', '13.1f')} "
              f"{fmt('shape_kl', '9.2e')} {fmt('shape_top1_agree', '7.2%')} | "
              f"{'':12} {fmt('kl', '9.2e')} {fmt('ppl', '8.3f')} {fmt('top1_agree', '7.2%')} "
              f"{fmt('tiny_quantize_s', '6.1f')}")
    if not args.skip_quality:
        ppl_ref = next(iter(rows.values()))["ppl_ref"]
        print(f"tiny-target fp32 ppl {ppl_ref:.3f}; load average {result['load_avg_start']:.1f} -> "
              f"{result['load_avg_end']:.1f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
