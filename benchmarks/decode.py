"""Decode speed: specquant's static-cache engine against transformers' `generate` on the same checkpoint.

Greedy, EOS ignored, exactly --new-tokens new tokens; float32 and bfloat16; one warm-up, then the median of --runs
timed runs, ours and transformers' interleaved run by run so load from other processes hits both alike. Our engine
runs eagerly and under `torch.compile(model, dynamic=True)`; the compiled row counts only if it produced the same
tokens as eager, and the table says when compiling failed or did not pay.

tok/s is specquant's one definition (decode.result.tokens_per_s: new tokens / wall time of one whole generate
call, prefill included), applied to both libraries alike; TPOT is our engine's own time per output token after the
first (decode.result.tpot_s).
Without the bundled weights (tiny-target still training) a random model of the same architecture is timed
instead, with a warning: speed does not depend on the weights' values.

Usage: python benchmarks/decode.py [--model tiny-target|DIR] [--new-tokens 128] [--runs 5] [--threads N]
The last stdout line is one JSON object: {"benchmark": "decode", "rows": [...]}.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from specquant.spec_decode.cli import DEFAULT_PROMPT
from specquant.decode.result import tokens_per_s
from specquant.spec_decode.engine import generate
from specquant.decode.sampling import SamplingConfig
from specquant.model.checkpoint import BUNDLED, BUNDLED_DIR, load_tokenizer, read_config, resolve, save_model
from specquant.loader import load_model
from specquant.model.config import ModelConfig
from specquant.model.decoder import Transformer
from specquant.util.device import sync
from specquant.util.dtypes import DTYPES

REPO = Path(__file__).resolve().parent.parent


def preset_config(name: str) -> ModelConfig:
    """The architecture scripts/train_bundled.py gives a bundled model (its PRESETS are the one home of it)."""
    spec = importlib.util.spec_from_file_location("train_bundled", REPO / "scripts" / "train_bundled.py")
    train = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = train  # its dataclasses look their module up while the class is built
    spec.loader.exec_module(train)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(BUNDLED_DIR / name / "tokenizer.json")).get_vocab_size()
    role = "target" if name == "tiny-target" else "draft"
    return ModelConfig(vocab_size=vocab, max_position_embeddings=2048, rope_theta=10000.0, **train.PRESETS[role])


def checkpoint_dir(name_or_dir: str, tmp: Path) -> tuple[Path, bool]:
    """(checkpoint directory, whether its weights are random stand-ins for absent bundled weights)."""
    if name_or_dir in BUNDLED and not (BUNDLED_DIR / name_or_dir / "model.safetensors").exists():
        has_config = (BUNDLED_DIR / name_or_dir / "config.json").exists()
        cfg = read_config(name_or_dir) if has_config else preset_config(name_or_dir)
        print(f"warning: bundled {name_or_dir} has no weights yet (still training?); timing a random model with "
              f"its architecture (from {'its config.json' if has_config else 'scripts/train_bundled.py PRESETS'})")
        torch.manual_seed(0)
        return save_model(Transformer(cfg), tmp / name_or_dir, tokenizer_from=BUNDLED_DIR / name_or_dir), True
    return resolve(name_or_dir), False


def timed(fn, device: torch.device) -> tuple[float, object]:
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def ours_fn(model, prompt, n):
    return lambda: generate(model, prompt, n, SamplingConfig(), stop_on_eos=False)


def hf_fn(model, prompt, n, pad_id):
    mask = torch.ones_like(prompt)
    return lambda: model.generate(prompt, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  pad_token_id=pad_id)


def bench_dtype(path: Path, dtype_name: str, prompt: torch.Tensor, args, device) -> list[dict]:
    from transformers import AutoModelForCausalLM

    dtype, n = DTYPES[dtype_name], args.new_tokens
    ours = load_model(path, dtype, device)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).to(device).eval()
    pad_id = ours.config.eos_ids[0] if ours.config.eos_ids else 0
    contenders = {"specquant/eager": ours_fn(ours, prompt, n), "transformers/eager": hf_fn(hf, prompt, n, pad_id)}
    status = {name: "ok" for name in contenders}

    # warm-up (and, for the compiled model, compilation) outside the timed runs
    reference = contenders["specquant/eager"]().token_ids
    hf_tokens = contenders["transformers/eager"]()[:, prompt.shape[1] :].tolist()
    if not args.no_compile:
        compiled = torch.compile(ours, dynamic=True)
        contenders["specquant/compiled"] = ours_fn(compiled, prompt, n)
        t0 = time.perf_counter()
        try:
            tokens = contenders["specquant/compiled"]().token_ids
            status["specquant/compiled"] = "ok" if tokens == reference else "tokens differ from eager: not counted"
        except Exception as e:  # compile support varies by platform/toolchain; report it, do not hide it
            status["specquant/compiled"] = f"compile failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
            del contenders["specquant/compiled"]
        compile_s = time.perf_counter() - t0

    samples = {name: [] for name in contenders}
    tpots = {name: [] for name in contenders if name.startswith("specquant")}
    for _ in range(args.runs):
        for name, fn in contenders.items():
            if status[name] != "ok":
                continue
            seconds, out = timed(fn, device)
            samples[name].append(seconds)
            if name in tpots:
                tpots[name].append(out.stats["tpot_s"])

    rows = []
    hf_median = statistics.median(samples["transformers/eager"])
    for name in status:
        impl, mode = name.split("/")
        row = {"impl": impl, "mode": mode, "dtype": dtype_name, "new_tokens": n, "runs": len(samples.get(name, [])),
               "status": status[name]}
        if samples.get(name):
            median = statistics.median(samples[name])
            row.update(median_s=median, tokens_per_s=tokens_per_s(n, median), speedup_vs_transformers=hf_median / median)
            if tpots.get(name):
                row["tpot_s"] = statistics.median(tpots[name])
        if name == "specquant/eager":
            row["same_tokens_as_transformers"] = reference == hf_tokens
        if mode == "compiled":
            row["compile_s"] = compile_s
        rows.append(row)
    eager_row = next(r for r in rows if r["impl"] == "specquant" and r["mode"] == "eager")
    compiled_row = next((r for r in rows if r["mode"] == "compiled" and "median_s" in r), None)
    if compiled_row and compiled_row["median_s"] > eager_row["median_s"]:
        compiled_row["status"] = "slower than eager"
    return rows


def print_table(rows: list[dict]):
    print(f"{'impl':<13} {'mode':<9} {'dtype':<9} {'median s':>9} {'tok/s':>8} {'TPOT ms':>8} {'vs HF':>6}"
          "  status")
    for r in rows:
        med = f"{r['median_s']:.3f}" if "median_s" in r else "-"
        tps = f"{r['tokens_per_s']:.1f}" if "tokens_per_s" in r else "-"
        dec = f"{r['tpot_s'] * 1e3:.2f}" if "tpot_s" in r else "-"
        vs = f"{r['speedup_vs_transformers']:.2f}x" if "speedup_vs_transformers" in r else "-"
        note = r["status"]
        if "same_tokens_as_transformers" in r:
            note += f" (same tokens as HF: {'yes' if r['same_tokens_as_transformers'] else 'no'})"
        if "compile_s" in r:
            note += f" (compile+first run {r['compile_s']:.0f} s)"
        print(f"{r['impl']:<13} {r['mode']:<9} {r['dtype']:<9} {med:>9} {tps:>8} {dec:>8} {vs:>6}  {note}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-target", help="checkpoint directory or bundled name")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5, help="timed runs per contender (median reported)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help=f"comma list from {', '.join(DTYPES)}")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    args = ap.parse_args()
    if args.runs < 1 or args.new_tokens < 2:
        ap.error("--runs must be >= 1 and --new-tokens >= 2")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # keep stdout/stderr to the table and the JSON line

    with tempfile.TemporaryDirectory() as tmp:
        path, random_weights = checkpoint_dir(args.model, Path(tmp))
        tokenizer = load_tokenizer(path)
        prompt = torch.tensor([tokenizer.encode(DEFAULT_PROMPT, add_special_tokens=False)], device=device)
        cfg = read_config(path)
        print(f"model {args.model} ({'random weights' if random_weights else path}): {cfg.num_hidden_layers} layers, "
              f"hidden {cfg.hidden_size}, vocab {cfg.vocab_size}; prompt {prompt.shape[1]} tokens, "
              f"{args.new_tokens} new tokens, {args.runs} runs, {args.threads} threads, {device}, "
              f"torch {torch.__version__}")
        rows = []
        for dtype_name in args.dtypes.split(","):
            rows += bench_dtype(path, dtype_name, prompt, args, device)
    for r in rows:
        r.update(model=args.model, random_weights=random_weights, threads=args.threads, device=args.device)
    print_table(rows)
    print(json.dumps({"benchmark": "decode", "rows": rows}))


if __name__ == "__main__":
    main()
