"""Training token blocks and their order.

Sources: a text file (documents split at "\\n\\n\\n", each tokenized and followed by EOS, as calibration text is) or a
JSONL file written by `specquant regen` (each line's prompt_ids + completion_ids, then EOS). The token stream is cut
into non-overlapping blocks of seq_len tokens (a partial tail is dropped).

Order: sample i of the run (counting over every step, micro-batch and process) is row perm_e[i mod N] with
e = i // N and perm_e a permutation seeded by (seed, e). So the data position is one integer, `samples_consumed`,
which a checkpoint stores; a resumed run, or one with more processes and the same global batch, reads the same rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specquant.errors import SpecquantError


def _text_stream(tokenizer, path: Path) -> list[int]:
    text = path.read_text(encoding="utf-8", errors="strict")
    docs = [d.strip() for d in text.split("\n\n\n") if d.strip()]
    stream: list[int] = []
    for doc in docs:
        stream.extend(tokenizer.encode(doc, add_special_tokens=False, verbose=False))
        if tokenizer.eos_token_id is not None:
            stream.append(tokenizer.eos_token_id)
    return stream


def _jsonl_stream(path: Path, eos: int | None) -> list[int]:
    stream: list[int] = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ids = list(row["prompt_ids"]) + list(row["completion_ids"])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise SpecquantError(f"{path}:{n} is not a `specquant regen` line with prompt_ids and completion_ids "
                                     f"({type(e).__name__}: {e}); regenerate the file") from None
            if not all(isinstance(t, int) and t >= 0 for t in ids):
                raise SpecquantError(f"{path}:{n} has token ids that are not non-negative integers; regenerate it")
            stream.extend(ids)
            if eos is not None and (not ids or ids[-1] != eos):
                stream.append(eos)
    return stream


def load_blocks(path, tokenizer, seq_len: int, vocab_size: int) -> torch.Tensor:
    """Token blocks [N, seq_len] int64 from a .txt or .jsonl file; raises SpecquantError on bad input."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise SpecquantError(f"training data {str(path)!r} does not exist; pass a .txt or `specquant regen` .jsonl "
                             "file (--data)")
    try:
        if path.suffix == ".jsonl":
            stream = _jsonl_stream(path, tokenizer.eos_token_id)
        else:
            stream = _text_stream(tokenizer, path)
    except UnicodeDecodeError as e:
        raise SpecquantError(f"training data {str(path)!r} is not UTF-8 text ({e}); pass a text or JSONL file") \
            from None
    if len(stream) < seq_len:
        raise SpecquantError(f"training data {str(path)!r} has {len(stream)} tokens, fewer than one sequence of "
                             f"seq_len={seq_len}; use more data or a smaller --seq-len")
    top = max(stream)
    if top >= vocab_size:
        raise SpecquantError(f"training data {str(path)!r} holds token id {top} >= the model's vocab_size "
                             f"{vocab_size}; it was tokenized for another model")
    n = len(stream) // seq_len
    return torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)


class BlockOrder:
    """Deterministic, epoch-shuffled order over token blocks [N, seq_len]; rows(i, n) = samples i .. i+n-1."""

    def __init__(self, blocks: torch.Tensor, seed: int):
        self.blocks, self.seed = blocks, seed
        self._perm: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.blocks)

    def _epoch_perm(self, epoch: int) -> torch.Tensor:
        perm = self._perm.get(epoch)
        if perm is None:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            perm = self._perm[epoch] = torch.randperm(len(self.blocks), generator=g)
            if len(self._perm) > 2:  # only the current and next epoch are ever needed
                self._perm.pop(min(self._perm))
        return perm

    def rows(self, start: int, n: int) -> torch.Tensor:  # -> [n, seq_len]
        n_blocks = len(self.blocks)
        idx = [int(self._epoch_perm(i // n_blocks)[i % n_blocks]) for i in range(start, start + n)]
        return self.blocks[idx]
