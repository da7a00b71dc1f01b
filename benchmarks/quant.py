"""Quantization benchmark: decode speed (fp32, bf16, W4 per backend) and quality (RTN/AWQ/GPTQ at g32/g128).

Speed: one decode step at batch 1 after a 64-token prompt, with 1 row (plain decode) and k+1 rows (a
speculative verify step, k=4). Each timing is the median of --reps repetitions after warm-up; the KV cache is
rewound to the same position every time, so every repetition does identical work. rows/s = rows / step time (a
forward's throughput, not a request's tokens/s).
Quality: KL(fp ‖ quant) per position, perplexity and top-1 agreement against the unquantized model on held-out
text (src/specquant/data/heldout.txt). Uses tiny-target when its weights exist, else a random model of the
same shape (with a warning: then quality numbers say nothing about real text).
The table goes to stdout first; the last stdout line is one JSON object.
Usage: python benchmarks/quant.py [--reps 7] [--calib-samples 64] [--eval-samples 16] [--skip-quality]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import warnings

import torch

from specquant.model.checkpoint import BUNDLED_DIR, load_tokenizer
from specquant.loader import load_model
from specquant.model.config import ModelConfig
from specquant.model.decoder import Transformer
from specquant.quant import QuantConfig, quantize, set_backend
from specquant.quant.config import BUNDLED_CALIB
from specquant.quant.linear import BACKENDS
from specquant.quant.quality import compare, heldout_tokens, logprobs

PROMPT = 64
K = 4


def base_model():
    if (BUNDLED_DIR / "tiny-target" / "model.safetensors").exists():
        return load_model("tiny-target", dtype=torch.float32), load_tokenizer("tiny-target"), "tiny-target"
    warnings.warn("tiny-target weights not found: benchmarking a random model of the same shape; quality numbers "
                  "are meaningless for real text", stacklevel=1)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=8192, hidden_size=384, intermediate_size=1024, num_hidden_layers=8,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=64)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
    tok = None
    if (BUNDLED_DIR / "tiny-target" / "tokenizer.json").exists():  # the tokenizer ships before the weights
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(BUNDLED_DIR / "tiny-target"), local_files_only=True)
    return model, tok, "random"


@torch.inference_mode()
def step_seconds(model, rows: int, reps: int, dtype) -> float:
    """Median seconds of one forward of `rows` new tokens at position PROMPT, batch 1."""
    model.setup_cache(1, PROMPT + K + 1, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (1, PROMPT), generator=g)
    new = torch.randint(0, model.config.vocab_size, (1, rows), generator=g)
    model(prompt, 0)
    for _ in range(3):
        model(new, PROMPT)
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        model(new, PROMPT)  # rewinds to PROMPT each time: identical work per repetition
        samples.append(time.perf_counter() - t0)
    model.clear_cache()
    return statistics.median(samples)


def speed(fp, reps: int) -> list[dict]:
    w4 = copy.deepcopy(fp)
    quantize(w4, QuantConfig(method="rtn", group_size=128))  # speed does not depend on how codes were chosen
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        variants = [("dense", None, copy.deepcopy(fp).to(dtype))]  # a copy: fp must stay exact fp32
        w4 = w4.to(dtype)
        variants += [("W4", name, w4) for name in ("auto", *BACKENDS)]
        for kind, backend, model in variants:
            if backend is not None:
                set_backend(model, backend)
            x = torch.zeros(1, 1, model.config.hidden_size, dtype=dtype)
            if backend == "int4pack_cpu" and not BACKENDS[backend].supports(next(
                    m for m in model.modules() if hasattr(m, "weight_packed")), x):
                continue
            for n in (1, K + 1):
                sec = step_seconds(model, n, reps, dtype)
                rows.append({"weights": kind, "backend": backend or "-", "dtype": str(dtype).removeprefix("torch."),
                             "rows": n, "ms_per_step": round(sec * 1e3, 3), "rows_per_s": round(n / sec, 1)})
                print(f"{kind:>5} {backend or '-':>15} {rows[-1]['dtype']:>8} rows={n}  "
                      f"{rows[-1]['ms_per_step']:8.2f} ms/step  {rows[-1]['rows_per_s']:8.1f} rows/s", flush=True)
    return rows


def quality(fp, tok, calib_samples: int, eval_samples: int) -> list[dict]:
    heldout = heldout_tokens(tok, BUNDLED_CALIB.with_name("heldout.txt"), eval_samples, 256)
    reference = logprobs(fp, heldout)
    rows = []
    for group in (32, 128):
        for method in ("rtn", "awq", "gptq"):
            m = copy.deepcopy(fp)
            t0 = time.perf_counter()
            report = quantize(m, QuantConfig(method=method, group_size=group, calib_samples=calib_samples), tok)
            r = compare(reference, m, heldout)
            nll = r.pop("nll_tokens")
            rows.append({"method": method, "group_size": group, **{k: round(v, 6) for k, v in r.items()},
                         "nll_delta_se": round(float(nll.std()) / len(nll) ** 0.5, 6),
                         "quantize_s": round(time.perf_counter() - t0, 1), "bytes_after": report["bytes_after"]})
            q = rows[-1]
            print(f"{method:>5} g{group:<4} KL {q['kl']:.2e}  ppl {q['ppl']:.3f} (fp {q['ppl_ref']:.3f})  "
                  f"top-1 {q['top1_agree']:.4f}  {q['quantize_s']} s", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--calib-samples", type=int, default=QuantConfig().calib_samples)
    ap.add_argument("--eval-samples", type=int, default=16, help="held-out sequences of 256 tokens")
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    fp, tok, source = base_model()
    out = {"model": source, "threads": args.threads, "reps": args.reps, "k": K}
    if not args.skip_speed:
        print("== decode step (batch 1, prompt 64) ==")
        out["speed"] = speed(fp, args.reps)
    if not args.skip_quality:
        if tok is None:
            print("no tokenizer: skipping quality", file=sys.stderr)
        else:
            print(f"== quality vs fp32 on {args.eval_samples}x256 held-out tokens ==")
            out["quality"] = quality(fp, tok, args.calib_samples, args.eval_samples)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
