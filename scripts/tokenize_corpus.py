#!/usr/bin/env python3
"""Tokenize data/corpus/{train,val}.txt into flat uint16 token files.

Documents in the corpus files are separated by two blank lines ("\\n\\n\\n", see
scripts/build_corpus.py).  Each document is encoded with the tiny-model
tokenizer (no special tokens added) and followed by the end-of-text id 0.
Output: ``data/tokens/train.bin``, ``data/tokens/val.bin`` (numpy uint16, raw,
native little-endian; load with ``np.memmap(path, dtype=np.uint16, mode="r")``)
and ``data/tokens/meta.json``.

Also writes the small packaged texts ``src/specquant/data/heldout.txt`` (first
~300 KB of whole documents of val.txt) and ``src/specquant/data/calib.txt``
(first ~300 KB of whole documents of train.txt), unless --no-package-data.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

import numpy as np
from tokenizers import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC_SEP = "\n\n\n"
EOS_ID = 0
BATCH_DOCS = 1024
PACKAGE_BYTES = 300_000


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_docs(path: str) -> list[str]:
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    if text.endswith("\n"):
        text = text[:-1]
    return [d for d in text.split(DOC_SEP) if d]


def encode_docs(tok: Tokenizer, docs: list[str]) -> np.ndarray:
    parts = []
    for i in range(0, len(docs), BATCH_DOCS):
        for enc in tok.encode_batch(docs[i:i + BATCH_DOCS], add_special_tokens=False):
            ids = enc.ids
            ids.append(EOS_ID)
            parts.append(np.asarray(ids, dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def take_docs(docs: list[str], budget: int) -> str:
    out, size = [], 0
    for d in docs:
        if size >= budget:
            break
        out.append(d)
        size += len(d.encode("utf-8")) + len(DOC_SEP)
    return DOC_SEP.join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", default=os.path.join(ROOT, "data", "corpus"))
    ap.add_argument("--tokenizer", default=os.path.join(ROOT, "src", "specquant", "models",
                                                         "tiny-target", "tokenizer.json"))
    ap.add_argument("--out", default=os.path.join(ROOT, "data", "tokens"))
    ap.add_argument("--package-data", default=os.path.join(ROOT, "src", "specquant", "data"))
    ap.add_argument("--no-package-data", action="store_true")
    args = ap.parse_args()

    tok = Tokenizer.from_file(args.tokenizer)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    assert vocab <= 65536, "uint16 storage needs vocab <= 65536"
    assert tok.token_to_id("<|endoftext|>") == EOS_ID
    os.makedirs(args.out, exist_ok=True)

    meta: dict = {
        "vocab_size": vocab,
        "dtype": "uint16",
        "eos_id": EOS_ID,
        "doc_separator_in_text": "\\n\\n\\n",
        "tokenizer": os.path.relpath(args.tokenizer, ROOT),
        "tokenizer_sha256": sha256_file(args.tokenizer),
        "splits": {},
    }
    split_docs = {}
    for split in ("train", "val"):
        src = os.path.join(args.corpus, f"{split}.txt")
        t0 = time.time()
        docs = read_docs(src)
        split_docs[split] = docs
        arr = encode_docs(tok, docs)
        dst = os.path.join(args.out, f"{split}.bin")
        arr.tofile(dst + ".tmp")
        os.replace(dst + ".tmp", dst)
        n_chars = sum(len(d) for d in docs)
        n_bytes = sum(len(d.encode("utf-8")) for d in docs)
        n_text_tokens = int(arr.size) - len(docs)
        meta["splits"][split] = {
            "tokens": int(arr.size),
            "documents": len(docs),
            "text_tokens_excluding_eos": n_text_tokens,
            "chars": n_chars,
            "bytes": n_bytes,
            "chars_per_token": round(n_chars / max(1, n_text_tokens), 4),
            "corpus_sha256": sha256_file(src),
            "bin_sha256": sha256_file(dst),
        }
        print(f"{split}: {arr.size} tokens ({len(docs)} docs, {n_chars} chars, "
              f"{n_chars / max(1, n_text_tokens):.3f} chars/token) -> {dst} "
              f"[{time.time() - t0:.1f}s]")
    with open(os.path.join(args.out, "meta.json"), "w", encoding="utf-8") as fh:
        json.dump(meta, fh, indent=2)
        fh.write("\n")

    if not args.no_package_data:
        os.makedirs(args.package_data, exist_ok=True)
        for name, split in (("heldout.txt", "val"), ("calib.txt", "train")):
            p = os.path.join(args.package_data, name)
            with open(p, "w", encoding="utf-8", newline="\n") as fh:
                fh.write(take_docs(split_docs[split], PACKAGE_BYTES))
            print(f"wrote {p}: {os.path.getsize(p)} bytes (from {split}.txt)")


if __name__ == "__main__":
    main()
