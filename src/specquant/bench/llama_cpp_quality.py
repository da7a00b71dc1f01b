"""Quality measured by llama.cpp's own tool: `llama-perplexity --kl-divergence` of each W4 GGUF against the F32
model's logits on the held-out text, our AWQ / GPTQ codes (exported exactly as Q4_0) beside llama.cpp's own Q4_0,
without and with an importance matrix computed by llama-imatrix on the same calibration text our quantizers use.

Reported as llama.cpp prints them: Mean PPL(Q), Mean KLD (± its uncertainty), Same top p (top-token agreement, %).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from specquant.bench.llama_cpp import llama_quantize, run_tool
from specquant.errors import SpecquantError
from specquant.export.llama_cpp import find_tool

DATA = Path(__file__).resolve().parent.parent / "data"
HELDOUT, CALIB = DATA / "heldout.txt", DATA / "calib.txt"

_NUM = r"([-\d.eE+]+)"
PATTERNS = {  # llama-perplexity's summary lines (tools/perplexity/perplexity.cpp)
    "ppl": rf"Mean PPL\(Q\)\s*:\s*{_NUM}\s*±\s*{_NUM}",
    "ppl_base": rf"Mean PPL\(base\)\s*:\s*{_NUM}\s*±\s*{_NUM}",
    "kld": rf"Mean\s+KLD:\s*{_NUM}\s*±\s*{_NUM}",
    "kld_99": rf"99\.0%\s+KLD:\s*{_NUM}",
    "same_top_p": rf"Same top p:\s*{_NUM}\s*±\s*{_NUM}\s*%",
}


@dataclass(frozen=True)
class Variant:
    id: str
    name: str


def parse_kl(stdout: str) -> dict:
    """{ppl, ppl_base, kld, kld_err, kld_99, same_top_p, same_top_p_err} from llama-perplexity's summary."""
    out = {}
    for key, pattern in PATTERNS.items():
        m = re.search(pattern, stdout)
        if not m:
            raise SpecquantError(f"llama-perplexity output lacks its {key!r} line; the tool's format changed")
        out[key] = float(m.group(1))
        if m.lastindex and m.lastindex > 1 and key in ("kld", "same_top_p", "ppl"):
            out[f"{key}_err"] = float(m.group(2))
    return out


def base_logits(f32: Path, out: Path, text: Path, ctx: int, chunks: int, threads: int, bin_dir=None) -> Path:
    """llama-perplexity --kl-divergence-base: the F32 model's logits saved once, the reference of every row."""
    if not out.exists():
        tmp = out.with_name(f".{out.name}.tmp")
        run_tool([find_tool("llama-perplexity", bin_dir), "-m", f32, "-f", text, "-c", ctx, "--chunks", chunks,
                  "-t", threads, "--kl-divergence-base", tmp])
        tmp.rename(out)
    return out


# llama-perplexity (0.3.36) sometimes exits 0 before its last log lines are written, to the pipe and to --log-file
# alike (its logger's queue is not drained at exit: seen in 1 of 8 runs here, cut anywhere in the summary); a run
# whose summary is incomplete is repeated (the result is deterministic), and a third miss is the error it was
KL_ATTEMPTS = 3


def kl_divergence(model: Path, base: Path, text: Path, ctx: int, chunks: int, threads: int, bin_dir=None) -> dict:
    cmd = [find_tool("llama-perplexity", bin_dir), "-m", model, "-f", text, "-c", ctx, "--chunks", chunks,
           "-t", threads, "--kl-divergence-base", base, "--kl-divergence"]
    for attempt in range(KL_ATTEMPTS):
        proc = run_tool(cmd)
        try:
            return parse_kl(proc.stdout + proc.stderr)
        except SpecquantError:
            if attempt == KL_ATTEMPTS - 1:
                raise


def importance_matrix(f32: Path, out: Path, text: Path, ctx: int, chunks: int, threads: int, bin_dir=None) -> Path:
    """llama-imatrix on the calibration text (GGUF imatrix format)."""
    if not out.exists():
        tmp = out.with_name(f".{out.name}.tmp.gguf")
        run_tool([find_tool("llama-imatrix", bin_dir), "-m", f32, "-f", text, "-c", ctx, "--chunks", chunks,
                  "-t", threads, "-o", tmp, "--no-ppl"])
        tmp.rename(out)
    return out


def llama_cpp_variants(f32: Path, workdir: Path, calib: Path, ctx: int, chunks: int, threads: int,
                       bin_dir=None) -> dict[str, tuple[str, Path]]:
    """llama.cpp's own Q4_0 files: default recipe (token_embd as llama-quantize picks it), + imatrix, and + imatrix
    with token_embd kept F32 (the same dense tensors as our exports, so only the quantized Linears differ)."""
    imatrix = importance_matrix(f32, workdir / "imatrix.gguf", calib, ctx, chunks, threads, bin_dir)
    q = llama_quantize(f32, workdir / "llama-q4_0.gguf", "Q4_0", bin_dir=bin_dir)
    qi = llama_quantize(f32, workdir / "llama-q4_0-imatrix.gguf", "Q4_0", imatrix=imatrix, bin_dir=bin_dir)
    qie = workdir / "llama-q4_0-imatrix-f32embd.gguf"
    if not qie.exists():
        tmp = qie.with_name(f".{qie.name}.tmp")
        run_tool([find_tool("llama-quantize", bin_dir), "--imatrix", imatrix, "--token-embedding-type", "f32",
                  "--output-tensor-type", "f32", f32, tmp, "Q4_0"])
        tmp.rename(qie)
    return {"llama_q4_0": ("llama.cpp Q4_0 (llama-quantize)", q),
            "llama_q4_0_imatrix": ("llama.cpp Q4_0 + imatrix", qi),
            "llama_q4_0_imatrix_f32embd": ("llama.cpp Q4_0 + imatrix, F32 embeddings", qie)}


def format_table(rows: list[dict]) -> str:
    lines = [f"{'model':<46} {'Mean KLD':>20} {'PPL(Q)':>10} {'same top p':>16} {'99% KLD':>9} {'MiB':>6}"]
    for r in rows:
        lines.append(f"{r['name']:<46} {r['kld']:>9.6f} ± {r['kld_err']:<8.6f} {r['ppl']:>10.4f} "
                     f"{r['same_top_p']:>7.3f} ± {r['same_top_p_err']:<5.3f}% {r['kld_99']:>9.5f} "
                     f"{r['bytes'] / 2**20:>6.1f}")
    return "\n".join(lines)
