"""Benchmark prompts: a JSONL file of {"id", "category", "text"}, tokenized with the target tokenizer at load time.

Three kinds of category:
- length categories (BenchConfig.lengths: short / medium / long): latency is measured on them; each prompt is cut to
  exactly the category's token count (its first N tokens, like LongBench prefixes), so every row and every run
  sees the same length.
- content sets (prose / code / qa, or any other category name): acceptance is reported per set; a prompt is used
  as written, keeping its last `content_max_tokens` tokens when longer (the end is where a question sits).
- filler sets (BenchConfig.filler_sets: filler): text that repeats, cut as content sets are, reported apart from
  them: a drafter copying earlier text (suffix decoding) accepts nearly everything there, which says nothing of
  real text. The packaged one is the competition's latency prompt, "The quick brown fox jumps over the lazy dog. "
  x (tokens // 10), at 64 and 2048 tokens (../shared/REFERENCE.md §5).

The packaged file (bench/prompts/default.jsonl) is built from the held-out text shipped in the package plus a few
hand-written code snippets; see docs/PROTOCOL.md for sources and licences.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specquant.errors import SpecquantError

DEFAULT_PROMPTS = Path(__file__).resolve().parent / "prompts" / "default.jsonl"


@dataclass
class Prompt:
    id: str
    category: str
    kind: str  # "length", "content" or "filler"
    ids: list[int]  # target token ids, already cut

    def to_json(self) -> dict:
        return {"id": self.id, "category": self.category, "kind": self.kind, "tokens": len(self.ids)}


def read_jsonl(path: Path) -> list[dict]:
    """Rows of a prompts file, each checked for string id / category / text; errors name the line."""
    if not path.is_file():
        raise SpecquantError(f"prompts file {str(path)!r} does not exist; pass a JSONL file of "
                             '{"id", "category", "text"} objects (--prompts)')
    rows, seen = [], set()
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecquantError(f"{path}:{n} is not valid JSON ({e.msg}); one object per line") from None
        if not isinstance(row, dict):
            raise SpecquantError(f"{path}:{n} is a JSON {type(row).__name__}; expected an object")
        for key in ("id", "category", "text"):
            if not isinstance(row.get(key), str) or not row[key]:
                raise SpecquantError(f'{path}:{n} needs a non-empty string "{key}"')
        if row["id"] in seen:
            raise SpecquantError(f"{path}:{n} repeats prompt id {row['id']!r}; ids must be unique")
        seen.add(row["id"])
        rows.append(row)
    if not rows:
        raise SpecquantError(f"prompts file {str(path)!r} holds no prompts")
    return rows


def fit_lengths(lengths: dict[str, int], context: int, max_new_tokens: int) -> dict[str, int]:
    """Category lengths, all shrunk by one factor when the longest + max_new_tokens exceeds the model context."""
    room = context - max_new_tokens
    if room < 1:
        raise SpecquantError(f"max_new_tokens {max_new_tokens} leaves no room for a prompt in the model's context of "
                             f"{context} tokens; lower --max-new-tokens")
    scale = min(1.0, room / max(lengths.values()))
    return {name: max(1, int(n * scale)) for name, n in lengths.items()}


def encode(tokenizer, text: str) -> list[int]:
    # through the fast backend: transformers warns on every text longer than model_max_length, and cutting is ours
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.encode(text, add_special_tokens=False).ids
    return tokenizer.encode(text, add_special_tokens=False)


PACKAGED_LENGTHS = ("short", "medium", "long")  # the length categories of DEFAULT_PROMPTS


def load_prompts(tokenizer, lengths: dict[str, int], content_sets: tuple[str, ...], per_length: int, per_set: int,
                 content_max_tokens: int, path: str | Path | None = None,
                 filler_sets: tuple[str, ...] = ()) -> list[Prompt]:
    """The benchmark prompts, tokenized and cut; `lengths` already fitted to the model (fit_lengths).

    A custom file may use any category names: those in `lengths` are length categories, those in filler_sets
    filler sets, every other one is a content set (content_sets only orders the packaged ones first). It needs at
    least one length category.
    """
    path = Path(path).expanduser() if path else DEFAULT_PROMPTS
    rows = read_jsonl(path)
    by_cat: dict[str, list[dict]] = {}
    for row in rows:
        by_cat.setdefault(row["category"], []).append(row)
    missing = [c for c in lengths if c not in by_cat]
    if len(missing) == len(lengths):
        raise SpecquantError(f"prompts file {str(path)!r} has no prompt in the length categories "
                             f"{', '.join(lengths)}; latency is measured on those")
    order = [c for c in lengths if c in by_cat] + [c for c in (*content_sets, *filler_sets) if c in by_cat]
    # the packaged file's length categories that this run leaves out (the demo's default runs short and long) are
    # left out, not read as content sets
    unused = set(PACKAGED_LENGTHS) - set(lengths) if path == DEFAULT_PROMPTS else set()
    order += sorted(c for c in by_cat if c not in order and c not in unused)
    prompts = []
    for cat in order:
        is_length = cat in lengths
        for row in by_cat[cat][: per_length if is_length else per_set]:
            ids = encode(tokenizer, row["text"])
            if is_length:
                need = lengths[cat]
                if len(ids) < need:
                    raise SpecquantError(f"prompt {row['id']!r} has {len(ids)} tokens, fewer than the {need} of "
                                         f"category {cat!r}; give it a longer text")
                ids = ids[:need]
            else:
                ids = ids[-content_max_tokens:]
            kind = "length" if is_length else "filler" if cat in filler_sets else "content"
            prompts.append(Prompt(row["id"], cat, kind, ids))
    return prompts
