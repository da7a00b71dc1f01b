"""llama.cpp as an engine: our GGUF export of the pair served by `llama-server` (the build cache's, built on first
use: export/llama_cpp_build.py). Its bench rows are its own (llama.cpp's Q4_0 of the F32 target beside ours:
bench/llama_cpp.py), so this file has no run_rows."""

from __future__ import annotations

from pathlib import Path

from specquant.engines import RowPair, Server
from specquant.errors import SpecquantError

NAME = "llama.cpp"
run_rows = None  # `specquant bench --engine llama.cpp` runs bench/llama_cpp.py's rows


def check() -> None:
    from specquant.export.llama_cpp import find_tool

    find_tool("llama-server")


def _gguf(src, out: Path, target=None) -> Path:
    """src as GGUF (dense tensors F32, W4 codes exact), kept when written before; a block drafter as llama.cpp's
    dflash drafter of target."""
    from specquant.export.gguf import source_from_checkpoint, write_gguf
    from specquant.export.gguf_dflash import write_dflash_gguf

    if not out.exists():
        if target is not None and _block(src):
            write_dflash_gguf(src, target, out)
        else:
            write_gguf(source_from_checkpoint(src), out, dense_dtype="f32")
    return out


def _block(src) -> bool:
    from specquant.spec_decode.drafters import kind_of_checkpoint

    return kind_of_checkpoint(src).name == "block"


def server(pair: RowPair, workdir: Path, port: int, host: str, threads: int = 0, context: int = 0) -> Server:
    from specquant.export.llama_cpp import find_tool

    if isinstance(pair.draft, str) and pair.draft in ("mtp", "model-free"):
        raise SpecquantError(f"--draft {pair.draft}: llama-server here drafts with a draft model only (an LM or "
                             "block drafter checkpoint)")
    workdir.mkdir(parents=True, exist_ok=True)
    argv = [str(find_tool("llama-server")), "-m", str(_gguf(pair.target, workdir / "target.gguf")), "--host", host,
            "--port", str(port), "--temp", "0", "--seed", "0", "--metrics", "-np", "1", "--alias", pair.id]
    if context:
        argv += ["-c", str(context)]
    if threads:
        argv += ["-t", str(threads)]
    if pair.draft is not None:
        argv += ["-md", str(_gguf(pair.draft, workdir / "draft.gguf", pair.target)), "--spec-draft-n-max",
                 str(pair.k)]
        if _block(pair.draft):
            argv += ["--spec-type", "draft-dflash"]
        if threads:
            argv += ["-td", str(threads)]
    return Server(argv, {}, f"llama-server ({pair.name})")
