"""llama.cpp export: target (and draft) as GGUF files, the command lines that serve them, and where the binaries
built by scripts/build_llama_cpp.sh live."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from specquant.errors import SpecquantError
from specquant.export.config import ExportConfig, check_out, write_marker
from specquant.export.gguf import source_from_checkpoint, write_gguf
from specquant.model.checkpoint import read_hf_config, resolve
from specquant.util.files import atomic_dir

LLAMA_CPP_VERSION = "0.3.36"  # llama-cpp-python sdist whose vendored llama.cpp scripts/build_llama_cpp.sh builds
BUILD_SCRIPT = "scripts/build_llama_cpp.sh"


def default_bin_dir() -> Path:
    """Where scripts/build_llama_cpp.sh puts the binaries (its SPECQUANT_CACHE root, default ~/.cache/specquant)."""
    root = os.environ.get("SPECQUANT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "specquant")
    return Path(root) / f"llama.cpp-{LLAMA_CPP_VERSION}" / "bin"


def find_tool(name: str, bin_dir: str | os.PathLike | None = None) -> Path:
    """Path of a llama.cpp tool (llama-bench, llama-perplexity, ...); raises naming the build command if absent."""
    base = Path(bin_dir).expanduser() if bin_dir else default_bin_dir()
    path = base / name
    if not os.access(path, os.X_OK):
        raise SpecquantError(f"llama.cpp tool {name!r} not found in {base}; build it with `bash {BUILD_SCRIPT}` "
                             "(or pass --llama-cpp DIR holding the binaries)")
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
