"""llama.cpp export: target (and draft) as GGUF files, the command lines that serve them, and where llama.cpp's
tools are (built on first use by export/llama_cpp_build.py).

Drafters llama.cpp runs, one row each in DRAFT_GGUF: an LM drafter as a whole causal LM (export/gguf.py,
`--spec-type draft-simple`), a block drafter as llama.cpp's dflash architecture (export/gguf_dflash.py,
`--spec-type draft-dflash` with the whole trained block drafted per step).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specquant.errors import SpecquantError
from specquant.export import llama_cpp_build
from specquant.export.config import ExportConfig, check_out, write_marker
from specquant.export.gguf import source_from_checkpoint, write_gguf
from specquant.export.gguf_dflash import spec_draft_n_max, write_dflash_gguf
from specquant.model.block_draft import BlockDraftConfig
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


@dataclass(frozen=True)
class DraftGGUF:
    """How llama.cpp runs one drafter kind: its GGUF writer and its `--spec-type`."""

    spec_type: str
    # (draft dir, target dir, out path, dense_dtype, inexact) -> write_gguf's report
    write: Callable[..., dict]
    # (draft config.json, ExportConfig) -> --spec-draft-n-max
    n_max: Callable[[dict, ExportConfig], int]


def _write_lm(draft, target, out, dense_dtype, inexact) -> dict:
    return write_gguf(source_from_checkpoint(draft), out, dense_dtype, inexact)


DRAFT_GGUF = {
    "lm": DraftGGUF("draft-simple", _write_lm, lambda hf, cfg: cfg.num_speculative_tokens),
    # a shorter noise block would be a different bidirectional computation than the trained one (gguf_dflash.py)
    "block": DraftGGUF("draft-dflash", write_dflash_gguf,
                       lambda hf, cfg: spec_draft_n_max(BlockDraftConfig.from_hf(hf))),
}


def commands(target_gguf: Path, draft_gguf: Path | None, cfg: ExportConfig, ctx: int,
             spec_type: str = "draft-simple", n_max: int | None = None) -> dict[str, str]:
    """Ready-to-run llama-server and llama-speculative-simple command lines (greedy, n_max draft tokens; default
    cfg.num_speculative_tokens)."""
    server = ["llama-server", "-m", str(target_gguf), "-c", str(ctx), "--port", "8080"]
    out = {}
    if draft_gguf is not None:
        spec = ["-md", str(draft_gguf), "--spec-type", spec_type, "--spec-draft-n-max",
                str(cfg.num_speculative_tokens if n_max is None else n_max)]
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
    how = None
    if draft_path is not None:
        from specquant.export.vllm import check_pair, drafter_kind

        draft_hf = read_hf_config(draft_path)
        kind = drafter_kind(draft_hf)
        how = DRAFT_GGUF.get(kind.name)
        if how is None:
            raise SpecquantError(f"GGUF export of a {kind.title} is not implemented (llama.cpp runs the "
                                 f"{', '.join(DRAFT_GGUF)} drafter kinds); export the target alone, or --for vllm")
        check_pair(read_hf_config(target_path), draft_hf)
    target_src = source_from_checkpoint(target_path)
    ctx = cfg.ctx_size or target_src.config.max_position_embeddings
    draft_out = (out / "draft.gguf").resolve() if draft_path else None
    spec = {"spec_type": how.spec_type, "n_max": how.n_max(draft_hf, cfg)} if how else {}
    cmds = commands((out / "target.gguf").resolve(), draft_out, cfg, ctx, **spec)
    reports = {}
    with atomic_dir(out, overwrite=True) as tmp:  # check_out above is the stricter rule
        reports["target"] = write_gguf(target_src, tmp / "target.gguf", cfg.dense_dtype, cfg.inexact)
        reports["target"]["source"] = str(target_path)
        if draft_path is not None:
            reports["draft"] = how.write(draft_path, target_path, tmp / "draft.gguf", cfg.dense_dtype, cfg.inexact)
            reports["draft"]["source"] = str(draft_path)
        for role, r in reports.items():
            r["path"] = str(out / f"{role}.gguf")
        report = {"engine": "llama.cpp", "out": str(out), "files": reports, "commands": cmds}
        write_marker(tmp, report)
    return report
