"""llama.cpp export: target (and draft) as GGUF files, the command lines that serve them, and where llama.cpp's
tools are (built on first use by export/llama_cpp_build.py)."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from specquant.errors import SpecquantError
from specquant.export import llama_cpp_build
from specquant.export.config import ExportConfig, check_out, write_marker
from specquant.export.gguf import source_from_checkpoint, write_gguf
from specquant.model.checkpoint import read_hf_config, resolve
from specquant.util.files import atomic_dir


def default_bin_dir() -> Path:
    """Where llama_cpp_build puts the binaries (its SPECQUANT_CACHE root, default ~/.cache/specquant)."""
    return llama_cpp_build.install_dir() / "bin"


def find_tool(name: str, bin_dir: str | os.PathLike | None = None) -> Path:
    """Path of a llama.cpp tool (llama-bench, llama-perplexity, ...). Without `bin_dir`, the build cache's, built
    there first when absent (minutes, with progress on stderr); a given `bin_dir` is never built into."""
    if bin_dir:
        path = Path(bin_dir).expanduser() / name
        if not os.access(path, os.X_OK):
            raise SpecquantError(f"llama.cpp tool {name!r} not found in --llama-cpp {str(path.parent)!r}; pass the "
                                 "directory holding llama.cpp's binaries, or omit --llama-cpp to use the build cache "
                                 f"{str(default_bin_dir())!r} (built on first use)")
        return path
    path = llama_cpp_build.ensure_built() / name
    if not os.access(path, os.X_OK):
        raise SpecquantError(f"llama.cpp tool {name!r} is not one the build cache holds "
                             f"({', '.join(llama_cpp_build.TOOLS)}); pass --llama-cpp DIR holding it")
    return path


def commands(target_gguf: Path, draft_gguf: Path | None, cfg: ExportConfig, ctx: int) -> dict[str, str]:
    """Ready-to-run llama-server and llama-speculative-simple command lines (greedy, k draft tokens)."""
    server = ["llama-server", "-m", str(target_gguf), "-c", str(ctx), "--port", "8080"]
    out = {}
    if draft_gguf is not None:
        spec = ["-md", str(draft_gguf), "--spec-type", "draft-simple", "--spec-draft-n-max",
                str(cfg.num_speculative_tokens)]
        out["llama-server"] = shlex.join(server + spec)
        out["llama-speculative-simple"] = shlex.join(
            ["llama-speculative-simple", "-m", str(target_gguf), *spec, "-c", str(ctx), "--temp", "0", "-n", "128",
             "-p", "The quick brown fox"])
    else:
        out["llama-server"] = shlex.join(server)
        out["llama-completion"] = shlex.join(["llama-completion", "-m", str(target_gguf), "-c", str(ctx), "--temp",
                                              "0", "-n", "128", "-no-cnv", "-p", "The quick brown fox"])
    return out


def export_llama_cpp(target, draft, out: Path, cfg: ExportConfig, overwrite: bool = False) -> dict:
    """Write out/target.gguf (and out/draft.gguf) atomically; return the report with the command lines."""
    check_out(out, overwrite)
    target_path = resolve(target)
    draft_path = resolve(draft) if draft else None
    if draft_path is not None:
        from specquant.export.vllm import check_pair, drafter_kind

        draft_hf = read_hf_config(draft_path)
        kind = drafter_kind(draft_hf)
        if not kind.standalone:  # our GGUF writer converts whole causal LMs only
            raise SpecquantError(f"GGUF export of a {kind.title} is not implemented: llama.cpp reads it through its "
                                 "own converter (convert_hf_to_gguf.py --target-model-dir), which the "
                                 "llama-cpp-python sdist does not ship; export the pair --for vllm instead")
        check_pair(read_hf_config(target_path), draft_hf)
    sources = {"target": source_from_checkpoint(target_path)}
    if draft_path is not None:
        sources["draft"] = source_from_checkpoint(draft_path)
    reports = {}
    ctx = cfg.ctx_size or sources["target"].config.max_position_embeddings
    cmds = commands((out / "target.gguf").resolve(), (out / "draft.gguf").resolve() if draft_path else None, cfg, ctx)
    with atomic_dir(out, overwrite=True) as tmp:  # check_out above is the stricter rule
        for role, src in sources.items():
            reports[role] = write_gguf(src, tmp / f"{role}.gguf", cfg.dense_dtype, cfg.inexact)
            reports[role]["path"] = str(out / f"{role}.gguf")
            reports[role]["source"] = str(src.tokenizer_dir)
        report = {"engine": "llama.cpp", "out": str(out), "files": reports, "commands": cmds}
        write_marker(tmp, report)
    return report
