"""`specquant distill prune-head`: the token map of a vocabulary-pruned draft head (spec_decode/drafters/
pruned_head.py), counted on text with the target's tokenizer, and the drafter checkpoint copy that carries it.

A training-stage step (it reads training text through train/data.py), so it lives here, above the decoding layer
that only reads the map back.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from specquant.errors import SpecquantError
from specquant.model.checkpoint import load_tokenizer, read_hf_config, resolve
from specquant.quant.config import BUNDLED_CALIB
from specquant.quant.prune_vocab import most_frequent
from specquant.spec_decode.drafters.pruned_head import CONFIG_KEY
from specquant.train.data import load_blocks
from specquant.util.files import atomic_dir


def count_tokens(stream: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Occurrences [vocab] of each id in a token stream [T]."""
    return torch.bincount(stream.flatten(), minlength=vocab_size)[:vocab_size]


def write_pruned_checkpoint(src, out, token_ids: torch.Tensor, source: str, overwrite: bool = False) -> Path:
    """A copy of the draft checkpoint src in out (the --out policy, written atomically) with the map in its
    config.json; the weights are untouched: the head is cut when the drafter is built. Returns out."""
    src, out = Path(resolve(src)), Path(out).expanduser()
    if out.exists() and out.resolve() == src.resolve():
        raise SpecquantError(f"--out {str(out)!r} is the draft checkpoint itself; write the pruned copy elsewhere")
    hf = json.loads((src / "config.json").read_text(encoding="utf-8"))
    hf[CONFIG_KEY] = {"token_ids": [int(t) for t in token_ids], "source": source}
    with atomic_dir(out, overwrite) as tmp:
        for f in src.iterdir():
            if f.is_file() and f.name != "config.json":
                shutil.copy2(f, tmp / f.name)
        (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n", encoding="utf-8")
    return out


def build_token_map(draft, keep: int, data=None, tokenizer_from=None) -> tuple[torch.Tensor, dict]:
    """The `keep` most frequent ids of data (a .txt file or `specquant regen` .jsonl; default the bundled
    calibration text), tokenized with tokenizer_from's tokenizer (default: the draft checkpoint's own), plus every
    special token. Returns (ids [keep] ascending, a summary: tokens counted, coverage of the kept ids on data)."""
    hf = read_hf_config(resolve(draft))
    vocab = int(hf["vocab_size"])
    path = Path(data).expanduser() if data else BUNDLED_CALIB
    tokenizer = load_tokenizer(tokenizer_from or draft)
    stream = load_blocks(path, tokenizer, 1, vocab)  # [T, 1]: every token of the file, in order
    counts = count_tokens(stream, vocab)
    eos = hf.get("eos_token_id")
    always = (*([] if eos is None else [eos] if isinstance(eos, int) else eos), *tokenizer.all_special_ids)
    ids = most_frequent(counts, keep, always)
    total = int(counts.sum())
    return ids, {"vocab_size": vocab, "kept": int(ids.numel()), "tokens_counted": total, "data": str(path),
                 "coverage": float(counts[ids].sum()) / total, "distinct_seen": int((counts > 0).sum())}
