"""llama.cpp as a measured engine: the ablation rows run by llama.cpp's own tools on our exported GGUF files.

Rows (all greedy, EOS ignored, the same prompts, interleaved prompt by prompt so machine noise hits every row):
  f32          the high-precision target written as F32 GGUF                         llama-completion
  q4_0_llama   llama.cpp's own Q4_0 of that F32 file (llama-quantize, round-to-nearest) llama-completion
  w4           our W4 target (AWQ/GPTQ/QAD codes) as Q4_0, exact                        llama-completion
  w4+draft     w4 + our high-precision draft (F32 GGUF)                                 llama-speculative-simple
  w4+w4draft   w4 + our W4 draft as Q4_0                                               llama-speculative-simple
with --block-draft, the block drafter as llama.cpp's dflash drafter (export/gguf_dflash.py), drafting its whole trained
block (k = block_size - 1, whatever --block-draft-len says: a shorter block is not what it was trained on):
  w4+blockdraft    w4 + our block drafter (F32 GGUF)                  llama-speculative-simple --spec-type draft-dflash
  w4+w4blockdraft  w4 + our W4 block drafter as Q4_0                  llama-speculative-simple --spec-type draft-dflash
tokens/s is each tool's own timing of its decode loop (llama-completion: `eval time` + `sampling time` over the
generated tokens; llama-speculative-simple: `decoded N tokens in T s`, which includes drafting and sampling);
acceptance is llama.cpp's n_accept / n_drafted. `match` is the fraction of generated tokens, from the start, equal
to the reference row's: to the f32 row for every row, and for speculative rows also to their own target alone (w4),
which greedy speculative decoding must reproduce.
"""

from __future__ import annotations

import re
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specquant.errors import SpecquantError
from specquant.export.gguf import source_from_checkpoint, write_gguf
from specquant.export.llama_cpp import find_tool  # noqa: F401  (re-exported for the bench CLI)
from specquant.runtime import child_env


@dataclass(frozen=True)
class RowSpec:
    id: str
    name: str
    target: str  # key of the GGUF files
    draft: str | None = None
    alone: str | None = None  # row id of the same target without a draft
    spec_type: str = "draft-simple"  # llama.cpp's --spec-type for the draft


ROWS = (
    RowSpec("f32", "F32 target", "target-f32"),
    RowSpec("q4_0_llama", "llama.cpp Q4_0 of the target (llama-quantize)", "target-q4_0-llama"),
    RowSpec("w4", "our W4 target as Q4_0", "target-w4"),
    RowSpec("w4+draft", "our W4 target + our draft", "target-w4", "draft-f32", alone="w4"),
    RowSpec("w4+w4draft", "our W4 target + our W4 draft", "target-w4", "draft-w4", alone="w4"),
)
BLOCK_ROWS = (  # with a block drafter
    RowSpec("w4+blockdraft", "our W4 target + our block drafter", "target-w4", "block-draft-f32", alone="w4",
            spec_type="draft-dflash"),
    RowSpec("w4+w4blockdraft", "our W4 target + our W4 block drafter", "target-w4", "block-draft-w4", alone="w4",
            spec_type="draft-dflash"),
)


def run_tool(cmd: list, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run a llama.cpp tool; a non-zero exit raises with the tail of its stderr."""
    try:
        # stdin closed: llama-completion reads an inherited stdin's EOF as "stop" and exits before its timings
        proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, errors="replace", env=child_env())
    except subprocess.TimeoutExpired:
        raise SpecquantError(f"{Path(str(cmd[0])).name} ran past {timeout:.0f} s: {' '.join(map(str, cmd))}") from None
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise SpecquantError(f"{Path(str(cmd[0])).name} exited with {proc.returncode}: {tail}")
    return proc


# --- files -----------------------------------------------------------------------------------------------------


def export_files(paths: dict[str, Path], workdir: Path, bin_dir=None, log=print) -> dict[str, Path]:
    """The GGUF files of every row: our exports (F32 dense, W4 exact with BF16 dense tensors, which the bf16 bundled
    checkpoints hold exactly) plus llama.cpp's own Q4_0 of the F32 target. Reused when already written."""
    workdir.mkdir(parents=True, exist_ok=True)
    plan = {"target-f32": (paths["target"], "f32"), "target-w4": (paths["quantized_target"], "bf16"),
            "draft-f32": (paths["draft"], "f32"), "draft-w4": (paths["quantized_draft"], "bf16")}
    files = {}
    for key, (src, dense) in plan.items():
        out = workdir / f"{key}.gguf"
        if not out.exists():
            report = write_gguf(source_from_checkpoint(src), out, dense_dtype=dense)
            log(f"exported {src} -> {out} ({report['file_type']}, max |error| quantized "
                f"{report['max_abs_error_quantized']:.3g})")
        files[key] = out
    files["target-q4_0-llama"] = llama_quantize(files["target-f32"], workdir / "target-q4_0-llama.gguf", "Q4_0",
                                                bin_dir=bin_dir)
    files.update(export_block_files(paths, workdir, log))
    return files


def export_block_files(paths: dict[str, Path], workdir: Path, log=print) -> dict[str, Path]:
    """The block drafter's dflash GGUFs (F32, and its W4 as Q4_0 when paths has one), when paths has a block drafter.
    The bench's GPTQ keeps the drafter's fp32 scales, which fp16 GGUF blocks round: that error is logged, not hidden."""
    from specquant.export.gguf_dflash import write_dflash_gguf

    files = {}
    for key, role, dense, inexact in (("block-draft-f32", "block_draft", "f32", "error"),
                                      ("block-draft-w4", "quantized_block_draft", "bf16", "warn")):
        if role not in paths:
            continue
        out = workdir / f"{key}.gguf"
        if not out.exists():
            report = write_dflash_gguf(paths[role], paths["target"], out, dense_dtype=dense, inexact=inexact)
            log(f"exported {paths[role]} -> {out} (dflash {report['file_type']}, max |error| quantized "
                f"{report['max_abs_error_quantized']:.3g} in {report['inexact_tensors']} tensors)")
        files[key] = out
    return files


def llama_quantize(src: Path, out: Path, kind: str = "Q4_0", imatrix: Path | None = None, bin_dir=None,
                   threads: int | None = None, log: Path | None = None) -> Path:
    """llama-quantize src -> out (kept when out exists); threads: its thread count (default: all cores); log: a
    file for its output, whose per-tensor lines say which tensors it kept in another type than kind."""
    if not out.exists():
        tmp = out.with_name(f".{out.name}.tmp")
        cmd = [find_tool("llama-quantize", bin_dir)]
        if imatrix is not None:
            cmd += ["--imatrix", imatrix]
        proc = run_tool(cmd + [src, tmp, kind] + ([threads] if threads else []))
        if log is not None:
            log.write_text(proc.stdout + proc.stderr)
        tmp.rename(out)
    return out


# --- our logits as llama-perplexity's base ---------------------------------------------------------------------


def kl_base_rows(logits) -> np.ndarray:
    """Log-probabilities [n, vocab] (fp32 logits) -> llama-perplexity's stored rows uint16 [n, nv]: per row the fp32
    pair (scale, min log-prob), then each log-prob as round((logit - min_logit) / scale), clipped 16 nats below the
    top (tools/perplexity/perplexity.cpp, log_softmax with a log_prob argument). The format is llama.cpp's own; it
    is re-implemented here so that `--kl-divergence` measures llama.cpp against our engine, not against itself."""
    x = np.asarray(logits, dtype=np.float32)
    n, vocab = x.shape
    top = x.max(1, keepdims=True)
    low = np.maximum(x.min(1, keepdims=True), top - np.float32(16))
    lse = np.log(np.exp(x - top, dtype=np.float32).sum(1, dtype=np.float64, keepdims=True)).astype(np.float32)
    min_log_prob = (low - top - lse).astype(np.float32)
    scale = ((top - low) / np.float32(65535)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(x > low, np.rint((x - low) * (np.float32(1) / scale)), 0)
    q = np.where(scale > 0, q, 0).astype(np.uint16)
    nv = 2 * ((vocab + 1) // 2) + 4
    rows = np.zeros((n, nv), dtype=np.uint16)
    rows[:, :4] = np.concatenate([scale, min_log_prob], 1).astype(np.float32).view(np.uint16)
    rows[:, 4:4 + vocab] = q
    return rows


def write_kl_base(path: Path, tokens, logits_fn, vocab: int) -> Path:
    """A `--kl-divergence-base` file from our model: tokens [chunks, ctx] (int), logits_fn(chunk ids [ctx]) ->
    fp32 logits [ctx, vocab] of one fresh forward. llama-perplexity scores each chunk's second half (positions
    ctx//2 .. ctx-2, each predicting the next token), so only those rows are stored."""
    tokens = np.asarray(tokens, dtype=np.int32)
    chunks, ctx = tokens.shape
    first = ctx // 2
    with open(path, "wb") as f:
        f.write(b"_logits_")
        f.write(np.array([ctx], dtype=np.uint32).tobytes())
        f.write(np.array([vocab, chunks], dtype=np.int32).tobytes())
        f.write(tokens.tobytes())
        for c in range(chunks):
            logits = np.asarray(logits_fn(tokens[c]), dtype=np.float32)
            if logits.shape != (ctx, vocab):
                raise SpecquantError(f"logits_fn gave shape {list(logits.shape)}; expected [{ctx}, {vocab}]")
            f.write(kl_base_rows(logits[first:ctx - 1]).tobytes())
    return path


# --- one generation --------------------------------------------------------------------------------------------


@dataclass
class Generation:
    text: str
    tokens_per_s: float
    n_drafted: int = 0
    n_accept: int = 0


_EVAL = re.compile(r"(?<!prompt )eval time =\s*([\d.]+) ms /\s*(\d+) runs.*?([\d.]+) tokens per second")
TRIES = 8
_SAMPLING = re.compile(r"sampling time =\s*([\d.]+) ms")
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s")
_DRAFTED, _ACCEPTED = re.compile(r"n_drafted\s*=\s*(\d+)"), re.compile(r"n_accept\s*=\s*(\d+)")


def _run_until(cmd: list, needed: tuple[re.Pattern, ...]) -> tuple[subprocess.CompletedProcess, list]:
    """Run a tool until its stderr has every `needed` line. This llama.cpp build's tools sometimes (about 2 runs in
    5 here, same inputs) exit 0 early, before their timings and with the text cut short; such runs are repeated."""
    for _ in range(TRIES):
        proc = run_tool(cmd)
        found = [p.search(proc.stderr) for p in needed]
        if all(found):
            return proc, found
    raise SpecquantError(f"{Path(str(cmd[0])).name} printed no {' / '.join(p.pattern[:20] for p in needed)} line "
                         f"in {TRIES} runs (its format changed?); stderr ends: {proc.stderr[-300:]!r}")


# What each tool prints to stdout after the generated text, whatever it generated (LOG("\n\n") before its timings
# in tools/completion/completion.cpp; once before the timings and once before exiting in speculative-simple.cpp).
# Left on, they re-tokenize into the last tokens and understate `match`.
COMPLETION_TRAILER, SPECULATIVE_TRAILER = "\n\n", "\n\n\n\n"


def generate(bin_dir, target: Path, prompt_file: Path, n: int, threads: int, ctx: int,
             draft: Path | None = None, draft_len: int = 3, spec_type: str = "draft-simple") -> Generation:
    """Greedy continuation of the prompt by llama.cpp (with a draft: llama-speculative-simple --spec-type
    spec_type)."""
    common = ["-m", target, "-f", prompt_file, "-n", n, "--temp", "0", "--ignore-eos", "-t", threads, "-c", ctx,
              "--seed", "0"]
    if draft is None:
        proc, (m, ms) = _run_until([find_tool("llama-completion", bin_dir), *common, "-no-cnv",
                                    "--no-display-prompt", "--simple-io"], (_EVAL, _SAMPLING))
        # decode forwards + sampling, as llama-speculative-simple's `decoded` time also counts its sampling
        seconds = (float(m.group(1)) + float(ms.group(1))) / 1e3
        return Generation(proc.stdout.removesuffix(COMPLETION_TRAILER), int(m.group(2)) / seconds)
    proc, (m, drafted, accepted) = _run_until(
        [find_tool("llama-speculative-simple", bin_dir), *common, "-md", draft, "--spec-type", spec_type,
         "--spec-draft-n-max", draft_len, "-td", threads], (_DECODED, _DRAFTED, _ACCEPTED))
    return Generation(_strip_prompt(proc.stdout, prompt_file).removesuffix(SPECULATIVE_TRAILER), float(m.group(3)),
                      int(drafted.group(1)), int(accepted.group(1)))


def _strip_prompt(stdout: str, prompt_file: Path) -> str:
    """llama-speculative-simple prints "\\n\\n", the prompt, then the continuation."""
    out = stdout.removeprefix("\n\n")
    prompt = prompt_file.read_text().removesuffix("\n")  # as llama.cpp reads -f
    if out.startswith(prompt):
        return out[len(prompt):]
    # the echo is the prompt's tokens printed piece by piece, which can differ from the file's text in a few bytes
    # (e.g. a prompt cut inside a multi-byte character); its last characters still mark where generation starts
    tail = prompt[-48:]
    at = out.find(tail, max(0, len(prompt) - 256))
    if at < 0:
        raise SpecquantError("llama-speculative-simple did not echo the prompt first; its output format changed")
    return out[at + len(tail):]


def match_fraction(encode, text: str, reference: str) -> float:
    """Fraction of the reference's tokens (encode: str -> ids) reproduced from the start (1.0 = identical).
    llama-speculative-simple stops once it has more than -n tokens, so a speculative text can run past its
    reference by up to k tokens; a text that starts with the whole reference reproduces all of it (re-tokenizing
    the longer text could merge the reference's last token with the next characters)."""
    if text.startswith(reference):
        return 1.0
    a, b = encode(text), encode(reference)
    if not b:
        return 1.0
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n / len(b)


# --- the rows --------------------------------------------------------------------------------------------------


@dataclass
class RowResult:
    spec: RowSpec
    tokens_per_s: list[float] = field(default_factory=list)  # per prompt: median over runs
    drafted: int = 0
    accepted: int = 0
    texts: list[str] = field(default_factory=list)


def run_rows(files: dict[str, Path], prompts: list[tuple[str, str]], encode, *, bin_dir=None,
             max_new_tokens: int = 128, runs: int = 3, warmup: int = 1, threads: int = 2, ctx: int = 2048,
             draft_len: int = 3, rows=ROWS, block_draft_len: int | None = None, log=print) -> dict:
    """Every row on every (id, text) prompt; returns the table rows as dicts. draft-dflash rows draft
    block_draft_len tokens (the drafter's block_size - 1), the others draft_len."""
    results = {r.id: RowResult(r) for r in rows}
    if block_draft_len is None and any(r.spec_type == "draft-dflash" for r in rows):
        raise SpecquantError("block-drafter rows need block_draft_len (the drafter's block_size - 1)")

    def k_of(r: RowSpec) -> int:
        return block_draft_len if r.spec_type == "draft-dflash" else draft_len

    with tempfile.TemporaryDirectory(prefix="specquant-llama-") as tmp:
        for pid, text in prompts:
            prompt_file = Path(tmp) / f"{pid}.txt"
            prompt_file.write_text(text.rstrip("\n"))  # llama.cpp's -f drops a trailing newline itself
            speeds = {r.id: [] for r in rows}
            for rep in range(warmup + runs):
                for r in rows:  # interleaved: each run visits every row before the next run
                    g = generate(bin_dir, files[r.target], prompt_file, max_new_tokens, threads, ctx,
                                 files[r.draft] if r.draft else None, k_of(r), r.spec_type)
                    if rep < warmup:
                        continue
                    speeds[r.id].append(g.tokens_per_s)
                    if rep == warmup:  # greedy: every run generates the same text
                        res = results[r.id]
                        res.texts.append(g.text)
                        res.drafted += g.n_drafted
                        res.accepted += g.n_accept
            for r in rows:
                results[r.id].tokens_per_s.append(statistics.median(speeds[r.id]))
            log(f"llama.cpp: prompt {pid} done ({time.strftime('%H:%M:%S')})")
    base = results[rows[0].id]
    table = []
    for r in rows:
        res = results[r.id]
        tps = statistics.mean(res.tokens_per_s)
        row = {"id": r.id, "name": r.name, "target": files[r.target].name,
               "draft": files[r.draft].name if r.draft else None, "tokens_per_s": round(tps, 1),
               "speedup_vs_f32": round(tps / statistics.mean(base.tokens_per_s), 3),
               "match_vs_f32": round(statistics.mean(match_fraction(encode, t, b) for t, b in
                                                     zip(res.texts, base.texts)), 4)}
        if r.draft:
            alone = results[r.alone]
            row["acceptance"] = round(res.accepted / res.drafted, 4) if res.drafted else None
            row["n_drafted"], row["n_accept"] = res.drafted, res.accepted
            row["draft_len"] = k_of(r)
            row["speedup_vs_target_alone"] = round(tps / statistics.mean(alone.tokens_per_s), 3)
            row["match_vs_target_alone"] = round(statistics.mean(
                match_fraction(encode, t, b) for t, b in zip(res.texts, alone.texts)), 4)
        table.append(row)
    return {"engine": "llama.cpp", "prompts": [p for p, _ in prompts], "max_new_tokens": max_new_tokens,
            "runs": runs, "threads": threads, "draft_len": draft_len, "rows": table}


def format_table(result: dict) -> str:
    lines = [f"{'row':<44} {'tok/s':>8} {'vs f32':>7} {'vs alone':>9} {'accept':>7} {'match f32':>10} "
             f"{'match alone':>12}"]
    for r in result["rows"]:
        def f(key, fmt):
            v = r.get(key)
            return "-" if v is None else format(v, fmt)
        lines.append(f"{r['name']:<44} {r['tokens_per_s']:>8.1f} {f('speedup_vs_f32', '.2f'):>7} "
                     f"{f('speedup_vs_target_alone', '.2f'):>9} {f('acceptance', '.1%'):>7} "
                     f"{f('match_vs_f32', '.1%'):>10} {f('match_vs_target_alone', '.1%'):>12}")
    block_k = {r["draft_len"] for r in result["rows"] if r["id"] in {b.id for b in BLOCK_ROWS}}
    lines.append(f"({len(result['prompts'])} prompts x {result['max_new_tokens']} new tokens, median of "
                 f"{result['runs']} runs, {result['threads']} threads, k={result['draft_len']}"
                 + (f", block drafter k={block_k.pop()}" if block_k else "") + ")")
    return "\n".join(lines)


def run_bench(cfg, target, draft, quantized_target=None, quantized_draft=None, bin_dir=None, log=print,
              block_draft=None, quantized_block_draft=None) -> dict:
    """`specquant bench --engine llama.cpp`: the same checked inputs as our bench (bench/prepare.py; W4 checkpoints
    not given are quantized into --out/cache), exported to --out/llama.cpp/, every row run on the bench prompts
    (with block_draft, the BLOCK_ROWS too); writes llama_cpp.json / llama_cpp.md into --out. Greedy only."""
    import json
    import os

    from specquant.bench.prepare import prepare_quantized, target_prompts, validate
    from specquant.bench.prompts import encode as encode_ids
    from specquant.model.checkpoint import read_config, read_hf_config
    from specquant.util.files import atomic_write, claim_out_dir

    if cfg.sampling.temperature != 0:
        raise SpecquantError(f"--temperature {cfg.sampling.temperature}: the llama.cpp rows are greedy; use 0")
    paths = validate(cfg, target, draft, quantized_target, quantized_draft, "cpu",
                     block_draft=block_draft, quantized_block_draft=quantized_block_draft)
    for tool in ("llama-completion", "llama-speculative-simple", "llama-quantize"):  # bad input fails before a build
        find_tool(tool, bin_dir)
    out = claim_out_dir(cfg.out, cfg.overwrite)
    prepare_quantized(cfg, paths, log)
    threads = cfg.runtime.threads or os.cpu_count() or 1
    files = export_files(paths, out / "llama.cpp", bin_dir, log)
    tokenizer, prompts = target_prompts(cfg, paths["target"])
    context = read_config(paths["target"]).max_position_embeddings
    texts = [(p.id, tokenizer.decode(p.ids)) for p in prompts]
    block_len = None
    if "block_draft" in paths:
        from specquant.export.gguf_dflash import spec_draft_n_max
        from specquant.model.block_draft import BlockDraftConfig

        block_len = spec_draft_n_max(BlockDraftConfig.from_hf(read_hf_config(paths["block_draft"])))
    result = run_rows(files, texts, lambda t: encode_ids(tokenizer, t), bin_dir=bin_dir,
                      max_new_tokens=cfg.max_new_tokens, runs=cfg.runs, warmup=cfg.warmup, threads=threads,
                      ctx=context, draft_len=cfg.spec.draft_len, rows=ROWS + (BLOCK_ROWS if block_len else ()),
                      block_draft_len=block_len, log=log)
    result["files"] = {k: str(v) for k, v in files.items()}
    atomic_write(out / "llama_cpp.json", json.dumps(result, indent=2) + "\n")
    atomic_write(out / "llama_cpp.md", "```\n" + format_table(result) + "\n```\n")
    return result
