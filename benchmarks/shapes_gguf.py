"""The GGUF files `benchmarks/shapes.py --llama-cpp DIR` reads: DIR/shapes/<shape>-<f32|bf16|q4_0>.gguf.

A random-init model of the shape (shapes.py's SHAPES and random_model, so the values its rows run; speed does not
depend on weight values or token strings), written by specquant's GGUF export (the Qwen3 shapes as llama.cpp's
qwen3 arch, the Qwen3.5 hybrids as qwen35) with the bundled tiny-target tokenizer (ids past its 8192 tokens become
unused padding entries):
  <shape>-bf16.gguf  the bf16 model (shapes.py's bf16 row), matrices BF16, 1-D tensors F32; always written;
  <shape>-f32.gguf   the fp32 model (the fp32 row), only below F32_MAX_PARAMETERS unless --f32 always: at the
                     2B / 4B shapes an fp32 model and file would need 9-17 GB of RAM and of disk;
  <shape>-q4_0.gguf  `llama-quantize <shape>-bf16.gguf ... Q4_0`: the bf16 values shapes.py's W4 rows quantize.
llama-quantize does not make every tensor Q4_0: the tied embedding/output gets its default output type (Q6_K at the
real shapes), and what it does not quantize keeps the source's type: the 1-D tensors and, on qwen35,
the causal conv kernel (ssm_conv1d, which our export writes F32). It does quantize the DeltaNet in_proj_a / in_proj_b
(ssm_alpha / ssm_beta), which our W4 keeps dense. Its log is kept as <shape>-q4_0.log, and the JSON line gives, per
Q4_0 file, every matrix pattern in another type and the weight bytes per step (shapes.gguf_weights, the figure
shapes.py prints beside ours).
DIR must hold llama.cpp's binaries in DIR/bin (a symlink to
${SPECQUANT_CACHE:-~/.cache/specquant}/llama.cpp-<version>/bin is enough). Existing files are kept.
Usage: python benchmarks/shapes_gguf.py DIR [--shapes qwen3-0.6b,qwen3.5-0.8b] [--f32 auto|always|never]
       [--threads N] [--overwrite]   (one JSON line: the files and the Q4_0 files' types)
Needs the `gguf` package (`pip install -e '.[export]'`). The model is built and written one file at a time: the peak
RAM is about the model in that dtype plus the DeltaNet matrices llama.cpp's value-head order copies (a quarter of a
hybrid's weights), and llama-quantize reads its source through mmap.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from specquant.bench.llama_cpp import llama_quantize
from specquant.bench.shapes import SHAPES, gguf_weights, random_model
from specquant.errors import SpecquantError
from specquant.export.gguf import source_from_model, write_gguf
from specquant.model.decoder import Transformer
from specquant.util.files import claim_out_dir

# shapes with more parameters get no f32 file by default (--f32 auto): Qwen3-1.7B and Qwen3.5-0.8B do, 2B / 4B not
F32_MAX_PARAMETERS = 2_000_000_000
SOURCE_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def parameters(shape: str) -> int:
    with torch.device("meta"):
        return Transformer(SHAPES[shape]()).num_parameters()


def write_source(out: Path, shape: str, kind: str) -> Path:
    """<shape>-<kind>.gguf from the random model in that dtype (kept when present; a complete file or none)."""
    path = out / f"{shape}-{kind}.gguf"
    if not path.exists():
        model = random_model(SHAPES[shape](), SOURCE_DTYPES[kind]).eval()  # the weights shapes.py's rows run
        write_gguf(source_from_model(model, "tiny-target", name=shape), path, dense_dtype=kind)  # atomic
        del model
    return path


def make(root: Path, shape: str, f32: str = "auto", threads: int | None = None) -> dict:
    """The shape's files ({"files": [...], "q4_0": shapes.gguf_weights of the Q4_0 file})."""
    if shape not in SHAPES:
        raise SpecquantError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    out = root / "shapes"  # claimed by main
    files = []
    if f32 == "always" or (f32 == "auto" and parameters(shape) < F32_MAX_PARAMETERS):
        files.append(write_source(out, shape, "f32"))
    bf16 = write_source(out, shape, "bf16")
    q4 = llama_quantize(bf16, out / f"{shape}-q4_0.gguf", "Q4_0", bin_dir=root / "bin", threads=threads,
                        log=out / f"{shape}-q4_0.log")
    files += [bf16, q4]
    return {"files": [str(f) for f in files], "q4_0": gguf_weights(q4)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path, help="the DIR later given to shapes.py --llama-cpp")
    ap.add_argument("--shapes", default="qwen3-0.6b")
    ap.add_argument("--f32", default="auto", choices=["auto", "always", "never"],
                    help=f"also write <shape>-f32.gguf: auto = below {F32_MAX_PARAMETERS:.0e} parameters")
    ap.add_argument("--threads", type=int, default=None, help="llama-quantize's threads (default: all cores)")
    ap.add_argument("--overwrite", action="store_true",
                    help="write into DIR/shapes even when it is a non-empty folder specquant did not create")
    args = ap.parse_args()
    try:  # the --out policy of every command (util/files.py), before any work
        claim_out_dir(args.root / "shapes", args.overwrite, "DIR/shapes")
        made = {shape: make(args.root, shape, args.f32, args.threads) for shape in args.shapes.split(",")}
    except SpecquantError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"files": [f for m in made.values() for f in m["files"]],
                      "q4_0": {shape: m["q4_0"] for shape, m in made.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
