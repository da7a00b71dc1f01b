#!/usr/bin/env python3
"""Train the byte-level BPE tokenizer (vocab 8192) for the bundled tiny models.

Uses the Hugging Face ``tokenizers`` library on ``data/corpus/train.txt``
(built by scripts/build_corpus.py) and writes ``tokenizer.json`` and
``tokenizer_config.json`` into ``--out`` (default
``src/specquant/models/tiny-target``), optionally copying them to further
directories with ``--copy-to``.

Design:
* no normaliser, ByteLevel pre-tokenizer (add_prefix_space=False, GPT-2 regex)
  and ByteLevel decoder, with the full 256-byte initial alphabet, so
  ``decode(encode(text)) == text`` for any UTF-8 string;
* special tokens ``<|endoftext|>`` (id 0), ``<|im_start|>`` (1), ``<|im_end|>`` (2),
  ``<|pad|>`` (3);
* determinism: the BPE trainer has no random component; for a fixed input file,
  settings and ``tokenizers`` version it produces the same merges (ties are
  broken deterministically), so the output is reproducible.  Each line of the
  training file is one training sequence.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
VOCAB_SIZE = 8192
MODEL_MAX_LENGTH = 2048

ROUND_TRIP_SAMPLES = [
    "Hello, world!",
    "naïve café — 東京",
    "  leading spaces,\ttabs\nand\n\nnewlines   ",
    "def f(x):\n    return x ** 2  # square\n",
    "Emoji 🙂 and ünïcödé ßtraße, Ελληνικά, русский, العربية, 한국어",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|endoftext|>",
    "To be, or not to be, that is the question:",
    "",
    " ",
    "\u0000\u0001 control \x7f chars",
]


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def tokenizer_config() -> dict:
    added = {str(i): {"content": t, "lstrip": False, "rstrip": False, "normalized": False,
                      "single_word": False, "special": True}
             for i, t in enumerate(SPECIAL_TOKENS)}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|pad|>",
        "unk_token": None,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "added_tokens_decoder": added,
        "model_max_length": MODEL_MAX_LENGTH,
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
    }


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify(out_dir: str) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
    assert len(tok) == VOCAB_SIZE, len(tok)
    assert tok.convert_tokens_to_ids("<|endoftext|>") == 0
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 0
    assert tok.pad_token == "<|pad|>" and tok.pad_token_id == 3
    assert tok.bos_token is None
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.convert_tokens_to_ids(t) == i, t
    raw = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json"))
    for s in ROUND_TRIP_SAMPLES:
        ids = tok.encode(s, add_special_tokens=False)
        back = tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        assert back == s, (s, ids, back)
        assert raw.encode(s).ids == ids, s
        assert raw.decode(ids, skip_special_tokens=False) == s, s
        assert all(0 <= i < VOCAB_SIZE for i in ids)
    ids = tok.encode("<|im_start|>x<|im_end|><|endoftext|>", add_special_tokens=False)
    assert ids[0] == 1 and ids[-2:] == [2, 0], ids
    print(f"verified {out_dir}: AutoTokenizer loads offline ({type(tok).__name__}), "
          f"{len(ROUND_TRIP_SAMPLES)} exact round trips")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--train", default=os.path.join(ROOT, "data", "corpus", "train.txt"))
    ap.add_argument("--out", default=os.path.join(ROOT, "src", "specquant", "models", "tiny-target"))
    ap.add_argument("--copy-to", action="append", default=[],
                    help="also copy tokenizer.json/tokenizer_config.json here (repeatable)")
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    ap.add_argument("--min-frequency", type=int, default=2)
    args = ap.parse_args()
    if not os.path.exists(args.train):
        sys.exit(f"{args.train} missing: run scripts/build_corpus.py first")

    tok = build_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        min_frequency=args.min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    t0 = time.time()
    tok.train([args.train], trainer)
    print(f"trained BPE on {args.train} in {time.time() - t0:.1f}s; vocab {tok.get_vocab_size()}")
    assert tok.get_vocab_size() == args.vocab_size, tok.get_vocab_size()
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))

    os.makedirs(args.out, exist_ok=True)
    tok_path = os.path.join(args.out, "tokenizer.json")
    tok.save(tok_path, pretty=True)
    with open(os.path.join(args.out, "tokenizer_config.json"), "w", encoding="utf-8") as fh:
        json.dump(tokenizer_config(), fh, indent=2, ensure_ascii=False)
        fh.write("\n")
    print(f"wrote {tok_path} (sha256 {sha256_file(tok_path)})")
    verify(args.out)
    for d in args.copy_to:
        os.makedirs(d, exist_ok=True)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(os.path.join(args.out, f), os.path.join(d, f))
        verify(d)


if __name__ == "__main__":
    main()
