"""W4A8 (int8 activations, GGUF's Q4_0 x Q8_0) against W4A16: what it costs in quality and buys in speed.

Quality: for each model (bundled names or W4 checkpoint dirs; a bundled name is quantized here with RTN, 4 bits,
--group, symmetric), the fp32 unquantized model is the reference and three versions of the W4 model are compared
with it on --samples held-out blocks of --seq-len tokens: float activations (W4A16; the reference backend, fp32),
bf16 activations (the native w4_bf16 kernel's arithmetic; what decode steps run by default where it builds) and
int8 activations (the W4A8 kernel, set_w4_activations). Reported: KL(fp32 || model) in nats per position, top-1
agreement with fp32 and perplexity. For a W4 checkpoint dir, --reference names its unquantized model.

Speed: the decoder linears of one Qwen3-0.6B-shaped layer stack (28 layers of q/k/v fused 1024->4096, o 2048->1024,
gate/up fused 1024->6144, down 3072->1024; random codes, group 32, bf16 scales as checkpoints store them), each
kernel run over all of them on 1, 2, 4, 8 and 16 rows, interleaved per repetition; the weights (248 MB) are
streamed from memory as in a decode step. The
ratio column is each row count's time over the same kernel's one-row time: the verify cost in decode steps.

Usage: python benchmarks/w4a8.py [--models tiny-target,tiny-draft] [--reference M] [--group 32] [--samples 16]
       [--seq-len 256] [--layers 28] [--reps 5] [--threads N] [--skip-speed] [--skip-quality]
A table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specquant.loader import load_model
from specquant.model.checkpoint import load_tokenizer, read_hf_config, resolve
from specquant.quant import QuantConfig, quantize
from specquant.kernels import w4_bf16, w4a8
from specquant.quant.linear import set_backend, set_w4_activations
from specquant.quant.quality import compare, heldout_tokens, logprobs

HELDOUT = Path(__file__).resolve().parent.parent / "src" / "specquant" / "data" / "heldout.txt"
LAYER = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]  # Qwen3-0.6B's fused decoder linears (out, in)
ROWS = (1, 2, 4, 8, 16)


def w4_model(name: str, group: int):
    """The W4 model: a checkpoint dir as it is, or a dense model quantized here (RTN, symmetric)."""
    if read_hf_config(resolve(name)).get("quantization_config"):
        return load_model(name)
    model = load_model(name)
    quantize(model, QuantConfig(method="rtn", bits=4, group_size=group))
    return model


def quality(models: list[str], reference: str | None, group: int, samples: int, seq_len: int) -> list[dict]:
    rows = []
    for name in models:
        ref_name = reference or name
        tokens = heldout_tokens(load_tokenizer(ref_name), HELDOUT, samples, seq_len)
        ref = logprobs(load_model(ref_name), tokens)
        model = w4_model(name, group)
        bf16 = "native_w4_bf16" if w4_bf16.FAMILY.library() else "int4pack_cpu_bf16"
        backends = {"float": "reference", "bf16": bf16,
                    "int8": "auto"}  # auto: the W4A8 kernel once the layers are set to int8 activations
        for label, backend in backends.items():
            set_w4_activations(model, "int8" if label == "int8" else "float")
            set_backend(model, backend)
            q = compare(ref, model, tokens)
            row = {"model": name, "activations": label, "kl": q["kl"], "kl_sem": q["kl_sem"],
                   "top1_agree": q["top1_agree"], "ppl": q["ppl"], "ppl_ref": q["ppl_ref"]}
            rows.append(row)
            print(f"{name:<14} {label:<6} KL {row['kl']:.3e} ± {row['kl_sem']:.1e}  top-1 {row['top1_agree']:.2%}  "
                  f"ppl {row['ppl']:.3f} (fp32 {row['ppl_ref']:.3f})", flush=True)
    return rows


def speed(layers: int, reps: int) -> dict:
    torch.manual_seed(0)
    stack = []
    for _ in range(layers):
        for n, k in LAYER:
            codes = torch.randint(-8, 8, (n, k), dtype=torch.int8)
            scale = (torch.rand(n, k // 32) * 0.01).to(torch.bfloat16)  # as checkpoints store them
            stack.append((k, w4_bf16.pack_codes(codes), w4a8.pack_codes(codes), w4a8.pack_scales(scale)))
    nbytes = sum(p.numel() + s.numel() * s.element_size() for _, p, _, s in stack)
    kernels = {"bf16": lambda x, pb, pv, s: w4_bf16.gemm(x, pb, s, 32),
               "int8": lambda x, pb, pv, s: w4a8.gemm(x, pv, s, 32)}
    samples = {(kern, r): [] for kern in kernels for r in ROWS}
    for rep in range(reps + 1):  # the first repetition warms up and is dropped
        for r in ROWS:
            xs = {k: torch.randn(r, k) for k in {k for _, k in LAYER}}
            for kern, fn in kernels.items():
                t0 = time.perf_counter()
                for k, pb, pv, s in stack:
                    fn(xs[k], pb, pv, s)
                if rep:
                    samples[(kern, r)].append(time.perf_counter() - t0)
    out = {"weights_mb": nbytes / 1e6, "threads": torch.get_num_threads(), "kernels": {}}
    print(f"\n{layers} Qwen3-0.6B layers of W4 g32 linears ({nbytes / 1e6:.0f} MB), {torch.get_num_threads()} "
          f"thread(s), median of {reps}")
    print(f"{'activations':<12}" + "".join(f"{f'{r} row(s)':>18}" for r in ROWS) + f"{'GB/s at 1':>11}")
    for kern in kernels:
        med = {r: statistics.median(samples[(kern, r)]) for r in ROWS}
        out["kernels"][kern] = {"ms": {r: med[r] * 1e3 for r in ROWS}, "steps": {r: med[r] / med[1] for r in ROWS},
                                "gb_s_one_row": nbytes / med[1] / 1e9}
        print(f"{kern:<12}" + "".join(f"{med[r] * 1e3:9.1f} ms {med[r] / med[1]:5.2f}" for r in ROWS)
              + f"{nbytes / med[1] / 1e9:11.1f}")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny-target,tiny-draft")
    ap.add_argument("--reference", default=None, help="the unquantized model when --models are W4 checkpoints")
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-quality", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if w4a8.FAMILY.library() is None or w4_bf16.FAMILY.library() is None:
        raise SystemExit(f"needs both native kernel families: w4a8 ({w4a8.FAMILY.why()}), w4_bf16 "
                         f"({w4_bf16.FAMILY.why()})")
    result = {"benchmark": "w4a8"}
    with torch.inference_mode():
        if not args.skip_quality:
            result["quality"] = quality(args.models.split(","), args.reference, args.group, args.samples,
                                        args.seq_len)
        if not args.skip_speed:
            result["speed"] = speed(args.layers, args.reps)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
