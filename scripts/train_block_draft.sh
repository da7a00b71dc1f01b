#!/usr/bin/env bash
# Train a bundled block drafter (DFlash-style) on a CPU; every step resumes.
#
#   bash scripts/train_block_draft.sh [RUN_DIR] [EXPORT_DIR]      (defaults: runs/block-draft, no export)
#   PAIR=hybrid bash scripts/train_block_draft.sh runs/hybrid-block-draft src/specquant/models/tiny-hybrid-block-draft
#
# PAIR=qwen3 (default): tiny-block-draft for tiny-target, taps 1,3,5,6. PAIR=hybrid: tiny-hybrid-block-draft for
# tiny-hybrid, taps by DFlash's rule for a hybrid (model/block_draft.py: [1, 2, 3, 4, 5] at 8 layers), stage 2
# against the demo hybrid section's W4 + QAD tiny-hybrid. Same recipe, same schedule for both.
#
# Rerun the same command after an interruption (even a SIGKILL): regen skips the prompts it has written, the W4
# target is reused from its cache, and `distill draft --resume` continues whichever stage stopped.
#  1. regen: the target continues each of the 526 bundled calib prompts (32 tokens) for 224 tokens, once sampled
#     (T=0.7, top-p 0.8, the reference's settings) and once greedily; the two files together are the training
#     text (the target's own generations, the reference recipe's data; labels = the data tokens).
#  2. the W4 target the demo's draft rows run against: `specquant demo`'s full preset (AWQ, then QAD), built by the
#     bench's own prepare step into RUN_DIR/demo-out/cache (`specquant demo --out RUN_DIR/demo-out` reuses it).
#  3. distill draft --kind block: stage 1 against fp32 tiny-target, stage 2 (a fresh, shorter schedule) against
#     the W4 + QAD target; OUT/stage2/model is the drafter. Budget: 1600 + 250 steps at ~1.4 s, about 45 minutes
#     on one core.
#  4. EXPORT_DIR (optional): a copy of stage 2's best model, bf16 as trained (src/specquant/models/tiny-block-draft).
set -euo pipefail
RUN=${1:-runs/block-draft}
EXPORT=${2:-}
PY=${PY:-.venv/bin/python}
SQ=(${PY} -m specquant.cli)
STAGE1_STEPS=${STAGE1_STEPS:-1600}
STAGE2_STEPS=${STAGE2_STEPS:-250}
PAIR=${PAIR:-qwen3}
case "$PAIR" in
  qwen3) TARGET=tiny-target; TAPS=(--target-layer-ids 1,3,5,6) ;;
  hybrid) TARGET=tiny-hybrid; TAPS=() ;;
  *) echo "PAIR=${PAIR} is not a bundled pair; use PAIR=qwen3 or PAIR=hybrid" >&2; exit 2 ;;
esac
mkdir -p "$RUN"

"${SQ[@]}" regen --model "$TARGET" --out "$RUN/regen_t07.jsonl" --max-new-tokens 224 --temperature 0.7 \
    --top-p 0.8 --batch 64 --json
"${SQ[@]}" regen --model "$TARGET" --out "$RUN/regen_greedy.jsonl" --max-new-tokens 224 --temperature 0 \
    --batch 64 --json
cat "$RUN/regen_t07.jsonl" "$RUN/regen_greedy.jsonl" > "$RUN/regen_all.jsonl.tmp"
mv "$RUN/regen_all.jsonl.tmp" "$RUN/regen_all.jsonl"

W4=$("$PY" - "$RUN/demo-out" "$PAIR" "$TARGET" <<'PYEOF'
import sys
from specquant.bench.demo import demo_config, hybrid_config
from specquant.bench.prepare import check_inputs, prepare_quantized
out, pair, target = sys.argv[1:4]
cfg = hybrid_config(out, "full", {}) if pair == "hybrid" else demo_config(out, "full")
paths = check_inputs(target, "tiny-draft")
prepare_quantized(cfg, paths, log=lambda m: print(m, file=sys.stderr))
print(paths["qad_target"])
PYEOF
)
echo "stage-2 target: $W4" >&2

RESUME=()  # continue from the newest checkpoint; a run killed before its first one starts over (--overwrite)
if [ -d "$RUN/draft/stage1/checkpoints" ]; then
    RESUME=(--resume)
elif [ -d "$RUN/draft" ]; then
    RESUME=(--overwrite)
fi
"${SQ[@]}" distill draft --kind block --stage1-target "$TARGET" --target "$W4" --data "$RUN/regen_all.jsonl" \
    --out "$RUN/draft" --steps "$STAGE1_STEPS" --stage2-steps "$STAGE2_STEPS" --seq-len 256 --batch 4 \
    --num-anchors 32 --lr "${LR:-1e-3}" --warmup 50 --eval-every 250 --save-every 100 --layers 2 \
    "${TAPS[@]}" --no-progress --json "${RESUME[@]}"

if [ -n "$EXPORT" ]; then
    rm -rf "$EXPORT.tmp" && cp -r "$RUN/draft/stage2/model" "$EXPORT.tmp" && rm -f "$EXPORT.tmp/.specquant-out"
    rm -rf "$EXPORT" && mv "$EXPORT.tmp" "$EXPORT"
    echo "exported $EXPORT" >&2
fi
