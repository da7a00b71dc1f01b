#!/usr/bin/env bash
# Trains the bundled tiny-hybrid (a Qwen3.5-style target: Gated DeltaNet + gated attention, 3:1) on the corpus with
# tiny-target's tokenizer, deterministically given the seed. Resumable: the run checkpoints every 100 steps under
# runs/hybrid, and rerunning this script continues from the last checkpoint (CHUNK=N: stop, checkpointed, after N
# more steps, so the run can be spread over several calls). Needs data/corpus/ (docs/CORPUS.md, build_corpus.py).
#
# Held-out set: src/specquant/data/heldout.txt, the first documents of the corpus split tiny-target was trained
# against, which tiny-target never saw. A corpus rebuilt today can shuffle into another split (Debian's
# postgresql-doc-15 moved on), so the training tokens here are every corpus document except those, and the
# held-out tokens are those documents: both models are measured on text neither was trained on, with the same
# windows (train_bundled.py's evaluate: 8 x 8 windows of 256 tokens, seed + 999).
#   EVAL ONLY:  .venv/bin/python scripts/train_bundled.py --evaluate tiny-target --tokens data/tokens-heldout
# The MTP layer is trained afterwards against the frozen exported target (`mtp` below), not jointly.
#
#   scripts/train_tiny_hybrid.sh              the target -> src/specquant/models/tiny-hybrid
#   scripts/train_tiny_hybrid.sh block-draft  its block drafter in the two stages (scripts/train_block_draft.sh
#                                             with PAIR=hybrid: regen of tiny-hybrid's own text, stage 1 against the
#                                             fp32 target, stage 2 against the demo's W4 + QAD tiny-hybrid) ->
#                                             src/specquant/models/tiny-hybrid-block-draft
#   scripts/train_tiny_hybrid.sh mtp          its MTP layer (distill draft --kind mtp), written into
#                                             src/specquant/models/tiny-hybrid (mtp.* tensors)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
if [ "${1:-target}" = block-draft ]; then
  PAIR=hybrid exec bash scripts/train_block_draft.sh runs/hybrid-block-draft src/specquant/models/tiny-hybrid-block-draft
fi
if [ "${1:-target}" = mtp ]; then
  # corpus text (every document but the held-out ones; the file name is the one the shipped layer was trained from)
  mkdir -p runs
  TEXT=runs/hybrid-block-draft.txt  # beside the run, not in it: distill's --out must hold only its own files
  if [ ! -f $TEXT ]; then
    $PY - $TEXT <<'PYEOF'
import sys
from pathlib import Path
held = set(Path("src/specquant/data/heldout.txt").read_text().split("\n\n\n"))
docs, size = [], 0
for d in Path("data/corpus/train.txt").read_text().split("\n\n\n"):
    if d not in held and size < 3_000_000:  # ~0.9M tokens: more than the run reads (400 x 8 x 128)
        docs.append(d)
        size += len(d)
Path(sys.argv[1]).write_text("\n\n\n".join(docs))
PYEOF
  fi
  # KL to the frozen target over the full vocabulary, 3 chained drafts per position; the first run writes a copy
  # of the target with the trained mtp.* tensors, whose weights and config then replace the bundled ones
  RUN=runs/tiny-hybrid-mtp
  RESUME=()
  if [ -d $RUN/checkpoints ]; then RESUME=(--resume); elif [ -d $RUN/model ]; then RESUME=(--overwrite); fi
  $PY -m specquant.cli distill draft --kind mtp --target src/specquant/models/tiny-hybrid \
      --data $TEXT --out $RUN --steps ${MTP_STEPS:-400} --seq-len 128 --batch 8 --lr 1e-3 \
      --warmup 40 --eval-every 100 --save-every 50 --mtp-steps 3 --mtp-into-target runs/tiny-hybrid-with-mtp \
      --no-progress --json "${RESUME[@]}"
  cp runs/tiny-hybrid-with-mtp/config.json runs/tiny-hybrid-with-mtp/model.safetensors src/specquant/models/tiny-hybrid/
  echo "wrote the MTP layer into src/specquant/models/tiny-hybrid" >&2
  exit 0
fi
TOK=data/tokens-heldout
if [ ! -f $TOK/meta.json ]; then
  $PY - $TOK <<'PYEOF'
import json, sys
from pathlib import Path
import numpy as np
from tokenizers import Tokenizer
out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
tok = Tokenizer.from_file("src/specquant/models/tiny-target/tokenizer.json")
held = Path("src/specquant/data/heldout.txt").read_text().split("\n\n\n")
skip = set(held)
docs = [d for split in ("train", "val") for d in Path(f"data/corpus/{split}.txt").read_text().split("\n\n\n")
        if d not in skip]
def encode(ds):  # as tokenize_corpus.py: each document's tokens, then the end-of-text id 0
    return np.array([t for e in tok.encode_batch(ds, add_special_tokens=False) for t in e.ids + [0]], np.uint16)
for name, ds in (("train", docs), ("val", held)):
    encode(ds).tofile(out / f"{name}.bin")
json.dump({"vocab_size": tok.get_vocab_size(with_added_tokens=True), "train_docs": len(docs),
           "val_docs": len(held), "val": "src/specquant/data/heldout.txt"}, open(out / "meta.json", "w"), indent=1)
PYEOF
fi
T="$PY scripts/train_bundled.py --role hybrid --tokens $TOK --run-dir runs/hybrid --eval-every 100"
step() { $PY - "$1" <<'PYEOF'
import sys, pathlib
from safetensors import safe_open
p = pathlib.Path(sys.argv[1]) / "ckpt.safetensors"
print(int(safe_open(str(p), "pt").metadata()["step"]) if p.exists() else 0)
PYEOF
}
# Phases, as the shipped model was trained: the first 100 steps ran under a 900-step cosine schedule sized from a
# throughput measured while the run had a small share of the shared CPU; with its share restored the run resumed
# with the budget that fits (the cosine follows the current --steps).
# phase <run dir> <stop at step> <command...>: run a phase unless its checkpoint is already there.
phase() { local dir=$1 stop=$2; shift 2; local s; s=$(step "$dir"); [ "$s" -ge "$stop" ] || "$@" --stop-after $((stop - s)); }
phase runs/hybrid 100 $T --steps 900
$T --steps ${STEPS:-1200} ${CHUNK:+--stop-after $CHUNK} --export src/specquant/models/tiny-hybrid
rm -f src/specquant/models/tiny-hybrid/.specquant-out  # the output marker is not part of the bundled model
