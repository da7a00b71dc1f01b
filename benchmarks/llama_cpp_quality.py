"""W4 quality measured by llama.cpp: `llama-perplexity --kl-divergence` against the F32 model's logits.

Rows: our AWQ and GPTQ W4 targets exported exactly as Q4_0 (specquant export, no re-quantization) and llama.cpp's
own Q4_0 of the same F32 model: plain, with an importance matrix (llama-imatrix on the bundled calibration text, the
text our AWQ/GPTQ calibrate on), and with imatrix + F32 embeddings (the same dense tensors as our exports).
Text: the package's held-out text (src/specquant/data/heldout.txt), --ctx tokens per chunk, --chunks chunks.
Missing W4 checkpoints are quantized into --out/cache (AWQ / GPTQ, --group-size, reused when unchanged).
Usage: python benchmarks/llama_cpp_quality.py [--target tiny-target] [--awq DIR] [--gptq DIR] [--group-size 32]
       [--ctx 512] [--chunks 100] [--threads 2] [--llama-cpp BIN_DIR] [--out runs/llama_cpp_quality] [--overwrite]
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specquant.bench.llama_cpp_quality import (CALIB, HELDOUT, base_logits, format_table, kl_divergence,
                                               llama_cpp_variants)
from specquant.errors import SpecquantError
from specquant.export.gguf import source_from_checkpoint, write_gguf
from specquant.model.checkpoint import resolve
from specquant.util.files import claim_out_dir


def our_w4(args, method: str, given: str | None, cache: Path) -> Path:
    if given:
        return resolve(given)
    from specquant.bench.prepare import quantized_checkpoint

    path, _ = quantized_checkpoint(resolve(args.target), f"target-{method}-g{args.group_size}", method,
                                   {"group_size": args.group_size}, cache)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="tiny-target", help="high-precision target (directory or bundled name)")
    ap.add_argument("--awq", default=None, help="our AWQ W4 checkpoint of --target (default: produce it)")
    ap.add_argument("--gptq", default=None, help="our GPTQ W4 checkpoint of --target (default: produce it)")
    ap.add_argument("--group-size", type=int, default=32, help="group size when producing AWQ/GPTQ (32 = Q4_0's)")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-cpp", default=None, help="directory of the llama.cpp binaries (default: the build cache)")
    ap.add_argument("--out", default="runs/llama_cpp_quality",
                    help="output folder: gguf/ and cache/, reused by a rerun (default: runs/llama_cpp_quality)")
    ap.add_argument("--overwrite", action="store_true",
                    help="write into --out even when it is a non-empty folder specquant did not create")
    args = ap.parse_args(argv)
    try:
        run(args)
    except SpecquantError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def run(args):
    # the --out policy of every command (util/files.py), before any work: a user's non-empty folder is refused
    out = claim_out_dir(args.out, args.overwrite)
    work = out / "gguf"
    work.mkdir(exist_ok=True)
    bins = args.llama_cpp
    f32 = work / "target-f32.gguf"
    if not f32.exists():
        write_gguf(source_from_checkpoint(args.target), f32)
    ours = {}
    for method, given in (("awq", args.awq), ("gptq", args.gptq)):
        ckpt = our_w4(args, method, given, out / "cache")
        path = work / f"ours-{method}.gguf"
        report = write_gguf(source_from_checkpoint(ckpt), path)  # F32 dense tensors, exact W4 codes
        assert report["inexact_tensors"] == 0
        ours[f"ours_{method}"] = (f"ours {method.upper()} W4 as Q4_0 (exact export)", path)
    base = base_logits(f32, work / "f32.kld", HELDOUT, args.ctx, args.chunks, args.threads, bins)
    variants = {**llama_cpp_variants(f32, work, CALIB, args.ctx, args.chunks, args.threads, bins), **ours}
    rows = []
    for vid, (name, path) in variants.items():
        r = kl_divergence(path, base, HELDOUT, args.ctx, args.chunks, args.threads, bins)
        rows.append({"id": vid, "name": name, "file": str(path), "bytes": path.stat().st_size, **r})
    print(format_table(rows))
    print(f"(llama-perplexity --kl-divergence vs F32 logits; {args.chunks} chunks x {args.ctx} tokens of "
          f"{HELDOUT.name}; PPL(base) = {rows[0]['ppl_base']:.4f})")
    best_ours = min((r for r in rows if r["id"].startswith("ours")), key=lambda r: r["kld"])
    llama_im = next(r for r in rows if r["id"] == "llama_q4_0_imatrix")
    print(json.dumps({"benchmark": "llama_cpp_quality", "target": args.target, "ctx": args.ctx,
                      "chunks": args.chunks, "group_size": args.group_size, "rows": rows,
                      "best_ours": best_ours["id"],
                      "ours_kld_below_llama_imatrix": best_ours["kld"] < llama_im["kld"]}))


if __name__ == "__main__":
    sys.exit(main())
