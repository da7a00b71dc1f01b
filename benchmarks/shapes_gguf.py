"""The GGUF files `benchmarks/shapes.py --llama-cpp DIR` reads: DIR/shapes/<shape>-f32.gguf and -q4_0.gguf.

A random-init model of the shape (the same SHAPES table as shapes.py; speed does not depend on weight values or
token strings), written by specquant's GGUF export with the bundled tiny-target tokenizer (ids past its 8192 tokens
become unused padding entries), then `llama-quantize ... Q4_0` (llama.cpp keeps its default Q6_K for a tied
embedding/output). DIR must hold llama.cpp's binaries in DIR/bin (a symlink to
${SPECQUANT_CACHE:-~/.cache/specquant}/llama.cpp-<version>/bin is enough). Existing files are kept.
Usage: python benchmarks/shapes_gguf.py DIR [--shapes qwen3-0.6b] [--overwrite]   (one JSON line: the files)
Needs the `gguf` package (`pip install -e '.[export]'`); about a minute and 3.5 GB of disk for qwen3-0.6b.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import SHAPES, random_model  # noqa: E402

from specquant.bench.llama_cpp import llama_quantize  # noqa: E402
from specquant.errors import SpecquantError  # noqa: E402
from specquant.export.gguf import source_from_model, write_gguf  # noqa: E402
from specquant.util.files import claim_out_dir  # noqa: E402


def make(root: Path, shape: str) -> list[str]:
    out = root / "shapes"  # claimed by main
    f32 = out / f"{shape}-f32.gguf"
    if not f32.exists():
        model = random_model(SHAPES[shape]()).eval()  # the same weights shapes.py times
        tmp = out / f".{f32.name}.tmp"
        write_gguf(source_from_model(model, "tiny-target", name=shape), tmp)
        tmp.rename(f32)  # complete files only: shapes.py treats a present file as usable
        del model
    q4 = llama_quantize(f32, out / f"{shape}-q4_0.gguf", "Q4_0", bin_dir=root / "bin")
    return [str(f32), str(q4)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path, help="the DIR later given to shapes.py --llama-cpp")
    ap.add_argument("--shapes", default="qwen3-0.6b")
    ap.add_argument("--overwrite", action="store_true",
                    help="write into DIR/shapes even when it is a non-empty folder specquant did not create")
    args = ap.parse_args()
    try:  # the --out policy of every command (util/files.py), before any work
        claim_out_dir(args.root / "shapes", args.overwrite, "DIR/shapes")
    except SpecquantError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    files = [f for shape in args.shapes.split(",") for f in make(args.root, shape)]
    print(json.dumps({"files": files}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
