"""`specquant export`: target (and draft) for vLLM or llama.cpp, with the command line that serves them.

vLLM: the compressed-tensors checkpoints + `vllm serve --speculative-config`. llama.cpp: GGUF files whose W4 tensors
are our codes and scales as Q4_0 / Q4_1 (exact, never re-quantized) + `llama-server` / `llama-speculative-simple`.
"""

from __future__ import annotations

from pathlib import Path

from specquant.export.config import ENGINES, ExportConfig
from specquant.util.flags import add_config_flags, config_from_args, print_json


def add_parser(sub):
    p = sub.add_parser("export", help="export target/draft for vLLM or llama.cpp and print the serve command",
                       description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="target checkpoint directory or bundled name (dense or W4)")
    p.add_argument("--draft", default=None, help="draft checkpoint directory or bundled name (dense or W4)")
    p.add_argument("--out", required=True, help="output directory (written atomically)")
    p.add_argument("--for", dest="engine", required=True, choices=ENGINES, help="serving engine")
    add_config_flags(p, ExportConfig)
    p.add_argument("--overwrite", action="store_true", help="replace an earlier export in --out")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the summary")
    return p


def _print_llama_cpp(report: dict):
    for role, r in report["files"].items():
        print(f"{role}: {r['path']}  {r['file_type']}, {r['tensors']} tensors, {r['bytes'] / 2**20:.1f} MiB, "
              f"max |error| quantized {r['max_abs_error_quantized']:.3g}, dense {r['max_abs_error_dense']:.3g}")
    for name, cmd in report["commands"].items():
        print(f"\n{name}:\n  {cmd}")
    # the export itself needs no llama.cpp binary (gguf-py writes the files), so it builds none; it says where
    # they are, or how to get them, for the commands above
    from specquant.export import llama_cpp_build

    bin_dir = llama_cpp_build.install_dir() / "bin"
    if llama_cpp_build.missing_tools(bin_dir):
        print(f"\nllama.cpp's tools are not built here: {llama_cpp_build.HOW} into {bin_dir} (or use your own)")
    else:
        print(f"\nllama.cpp's tools: {bin_dir}")


def _print_vllm(report: dict):
    print(f"target: {report['target']}")
    if report["draft"]:
        print(f"draft:  {report['draft']}")
    for note in report["notes"]:
        print(f"note: {note}")
    print(f"\nvllm serve:\n  {report['command']}")


def run(args) -> int:
    from specquant.export.llama_cpp import export_llama_cpp
    from specquant.export.vllm import export_vllm

    cfg = config_from_args(ExportConfig, args).validate()
    export = export_vllm if cfg.engine == "vllm" else export_llama_cpp
    report = export(args.target, args.draft, Path(args.out).expanduser(), cfg, args.overwrite)
    if args.json:
        print_json(report)
    elif cfg.engine == "vllm":
        _print_vllm(report)
    else:
        _print_llama_cpp(report)
    return 0
