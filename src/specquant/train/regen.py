"""`specquant regen`: teacher-generated continuations, the training text for distillation.

Batched: prompts are grouped by token length (the decoder's static cache is batch-capable, with one position per
step for all rows, so rows of equal length need no padding or mask) and each group is cut into batches of
`--batch`. The bundled prompts all have `prompt_tokens` tokens, so they batch fully; a user's prompts of many
different lengths batch less well.
Resumable: lines are appended one batch at a time and flushed; a rerun skips prompt ids already in --out (a torn
last line from a killed run is dropped first). Batch i always holds the same prompts and samples with seed + i, so
a resumed file equals an uninterrupted one. An existing --out that is not regen output (a user's file) is never
touched, torn-line repair included, unless --overwrite, which starts the file over.
Each line: {"id", "prompt", "prompt_ids", "completion", "completion_ids", "sampling", "model", "model_sha256"}.

Bundled prompts come from the package's calibration text (training split of the corpus, src/specquant/data/
calib.txt): the first `prompt_tokens` tokens of every paragraph long enough. Never from heldout.txt, which
evaluation uses.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from specquant.util.flags import add_config_flags, config_from_args
from specquant.errors import SpecquantError
from specquant.train.config import RegenConfig


def bundled_prompts(tokenizer, prompt_tokens: int) -> list[dict]:
    """[{"id", "prompt_ids"}] from the bundled calibration text: each paragraph's first prompt_tokens tokens."""
    from specquant.quant.config import BUNDLED_CALIB

    prompts = []
    docs = [d.strip() for d in BUNDLED_CALIB.read_text(encoding="utf-8").split("\n\n\n") if d.strip()]
    for i, doc in enumerate(docs):
        for j, para in enumerate(p.strip() for p in doc.split("\n\n")):
            ids = tokenizer.encode(para, add_special_tokens=False, verbose=False)
            if len(ids) >= prompt_tokens:
                prompts.append({"id": f"calib-{i:04d}-{j:03d}", "prompt_ids": ids[:prompt_tokens]})
    return prompts


def file_prompts(path: Path, tokenizer) -> list[dict]:
    """Prompts from .jsonl ({"id", "prompt"} per line) or text (one prompt per non-empty line, id = line number)."""
    if not path.is_file():
        raise SpecquantError(f"prompts file {str(path)!r} does not exist; pass a file or `bundled`")
    prompts, seen = [], set()
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            try:
                row = json.loads(line)
                pid, text = str(row["id"]), row["prompt"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise SpecquantError(f"{path}:{n} is not a JSON object with id and prompt ({e}); fix the line") \
                    from None
        else:
            pid, text = f"line-{n}", line
        if pid in seen:
            raise SpecquantError(f"{path}:{n} repeats prompt id {pid!r}; ids must be unique (resume relies on them)")
        seen.add(pid)
        ids = tokenizer.encode(text, add_special_tokens=False, verbose=False)
        if not ids:
            raise SpecquantError(f"{path}:{n} tokenizes to nothing; remove the line")
        prompts.append({"id": pid, "prompt_ids": ids})
    if not prompts:
        raise SpecquantError(f"prompts file {str(path)!r} has no prompt; give at least one")
    return prompts


def make_batches(prompts: list[dict], batch: int) -> list[list[dict]]:
    """Fixed batches: prompts grouped by length (stable order inside a group), then cut into `batch` rows."""
    by_len: dict[int, list[dict]] = {}
    for p in prompts:
        by_len.setdefault(len(p["prompt_ids"]), []).append(p)
    return [group[i : i + batch] for n in sorted(by_len) for group in [by_len[n]]
            for i in range(0, len(group), batch)]


LINE_START = b'{"id": '  # json.dumps of a regen row begins so: how a torn last line is recognised as ours


def _rows(raw: bytes) -> tuple[list[dict] | None, bytes]:
    """(the complete lines' rows, the torn tail) when `raw` is regen output, else (None, b"")."""
    cut = raw.rfind(b"\n") + 1
    keep, tail = raw[:cut], raw[cut:]
    if tail and not (tail.startswith(LINE_START) or LINE_START.startswith(tail)):
        return None, b""
    rows = []
    for line in keep.decode("utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not {"id", "sampling", "model_sha256"} <= set(row):
                return None, b""
        except json.JSONDecodeError:
            return None, b""
        rows.append(row)
    return rows, tail


def is_regen_file(path: Path) -> bool:
    """True when `path` holds only regen lines (and at most a torn last one): a file this command may resume."""
    return _rows(path.read_bytes())[0] is not None


def read_done(out: Path, sampling: dict, sha: str) -> set[str]:
    """Prompt ids already in `out`; drops a torn last line; refuses a file from another model or settings, and
    changes nothing in a file that is not regen output (the caller checked that with is_regen_file)."""
    if not out.exists():
        return set()
    raw = out.read_bytes()
    rows, tail = _rows(raw)
    if rows is None:
        raise SpecquantError(f"--out {str(out)!r} is not `specquant regen` output; pass a new path, or --overwrite to "
                             "replace it")
    for n, row in enumerate(rows, 1):
        if row["model_sha256"] != sha or row["sampling"] != sampling:
            raise SpecquantError(f"{out} holds lines from another model or other sampling settings (line {n}); "
                                 "write to a new --out, rerun with the same model and flags to resume, or pass "
                                 "--overwrite to start over")
    if tail:  # a killed run's partial last line: it is regenerated
        with out.open("r+b") as f:
            f.truncate(len(raw) - len(tail))
    return {row["id"] for row in rows}


def regen(model_dir: str, prompts: str, out, cfg: RegenConfig, draft: str | None = None, device: str = "cpu",
          progress: bool | str = True, overwrite: bool = False) -> dict:
    """Write continuations for every prompt not yet in `out` (every prompt, replacing `out`, with overwrite);
    returns counts and tokens/s. progress: util/progress.py's True, BAR_ONLY or False."""
    import time

    from specquant.spec_decode.engine import generate
    from specquant.decode.sampling import SamplingConfig
    from specquant.loader import load_model
    from specquant.model.checkpoint import load_tokenizer, resolve
    from specquant.train.qad import fingerprint
    from specquant.util.files import check_out_file

    cfg.validate()
    out = check_out_file(out, overwrite, ours=is_regen_file, what="`specquant regen` .jsonl")
    sampling = SamplingConfig(temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed).validate()
    path = resolve(model_dir)
    tokenizer = load_tokenizer(path)
    items = bundled_prompts(tokenizer, cfg.prompt_tokens) if prompts == "bundled" else \
        file_prompts(Path(prompts).expanduser(), tokenizer)
    if cfg.limit:
        items = items[: cfg.limit]
    sha = fingerprint(path)
    settings = {"temperature": cfg.temperature, "top_p": cfg.top_p, "seed": cfg.seed,
                "max_new_tokens": cfg.max_new_tokens, "batch": cfg.batch, "draft": draft}
    done = set() if overwrite else read_done(out, settings, sha)
    model = load_model(path, device=device)
    vocab = model.config.vocab_size
    engine = None
    if draft is not None:
        engine = _spec_engine(model, draft, tokenizer, device)
    batches = make_batches(items, 1 if engine is not None else cfg.batch)
    todo = [(i, b) for i, b in enumerate(batches) if any(p["id"] not in done for p in b)]
    for _, b in todo:
        for p in b:
            if max(p["prompt_ids"]) >= vocab:
                raise SpecquantError(f"prompt {p['id']!r} has token ids beyond the model's vocab {vocab}")
            if len(p["prompt_ids"]) + cfg.max_new_tokens > model.config.max_position_embeddings:
                raise SpecquantError(f"prompt {p['id']!r} ({len(p['prompt_ids'])} tokens) + --max-new-tokens "
                                     f"{cfg.max_new_tokens} exceeds the model's context; shorten either")
    out.parent.mkdir(parents=True, exist_ok=True)
    if overwrite:
        out.unlink(missing_ok=True)  # every input is checked: start the file over
    from specquant.util.progress import progress_for

    bar = progress_for(progress, sum(len(b) for _, b in todo), "regen", "prompt")
    new_tokens, t0, written = 0, time.perf_counter(), 0
    with bar, out.open("a", encoding="utf-8") as f:
        for i, batch in todo:
            ids = torch.tensor([p["prompt_ids"] for p in batch], device=device)
            batch_sampling = dataclasses.replace(sampling, seed=cfg.seed + i)
            if engine is not None:
                rows = engine.generate(ids, cfg.max_new_tokens, batch_sampling).token_ids
            else:
                rows = generate(model, ids, cfg.max_new_tokens, batch_sampling).token_ids
            lines = []
            for p, completion in zip(batch, rows):
                if p["id"] in done:
                    continue
                lines.append(json.dumps({
                    "id": p["id"], "prompt": tokenizer.decode(p["prompt_ids"]), "prompt_ids": p["prompt_ids"],
                    "completion": tokenizer.decode(completion), "completion_ids": completion,
                    "sampling": settings, "model": str(path), "model_sha256": sha}) + "\n")
                new_tokens += len(completion)
            f.write("".join(lines))
            f.flush()
            os.fsync(f.fileno())
            written += len(lines)
            bar.update(len(batch))
    seconds = time.perf_counter() - t0
    return {"out": str(out), "prompts": len(items), "skipped": len(done), "written": written,
            "new_tokens": new_tokens, "seconds": seconds, "tokens_per_s": new_tokens / seconds if seconds else 0.0}


def _spec_engine(model, draft: str, tokenizer, device: str):
    """Speculative generation (one prompt at a time): the emitted tokens follow the target's distribution."""
    from specquant.loader import load_model
    from specquant.model.checkpoint import load_tokenizer
    from specquant.spec_decode.engine import SpecEngine
    return SpecEngine(model, load_model(draft, device=device), target_tokenizer=tokenizer,
                      draft_tokenizer=load_tokenizer(draft))


def add_parser(subparsers):
    p = subparsers.add_parser("regen", help="teacher-generated continuations (distillation data), batched, "
                                            "resumable", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="the teacher: checkpoint directory or bundled name")
    p.add_argument("--prompts", default="bundled", help="prompts .jsonl ({id, prompt}) or .txt (one per line), or "
                                                        "`bundled` (from the calibration text; default)")
    p.add_argument("--out", required=True, help="output .jsonl (appended; ids already there are skipped)")
    p.add_argument("--overwrite", action="store_true",
                   help="start --out over: replace it even when it holds other lines or is not regen output")
    p.add_argument("--draft", default=None, help="draft checkpoint: speculative generation (one prompt at a time)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_config_flags(p, RegenConfig)
    return p


def run(args) -> int:
    cfg = config_from_args(RegenConfig, args)
    result = regen(args.model, args.prompts, args.out, cfg, draft=args.draft, device=args.device,
                   progress=not args.json, overwrite=args.overwrite)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['written']} prompts written, {result['skipped']} already there; {result['new_tokens']} "
              f"tokens in {result['seconds']:.1f} s ({result['tokens_per_s']:.0f} tokens/s) -> {result['out']}")
    return 0
