#!/usr/bin/env bash
# Train the bundled tiny-block-draft (DFlash-style block drafter for tiny-target) on a CPU; every step resumes.
#
#   bash scripts/train_block_draft.sh [RUN_DIR] [EXPORT_DIR]      (defaults: runs/block-draft, no export)
#
# Rerun the same command after an interruption (even a SIGKILL): regen skips the prompts it has written, the W4
# target is reused from its cache, and `distill draft --resume` continues whichever stage stopped.
#  1. regen: tiny-target continues each of the 526 bundled calib prompts (32 tokens) for 224 tokens, once sampled
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
mkdir -p "$RUN"

"${SQ[@]}" regen --model tiny-target --out "$RUN/regen_t07.jsonl" --max-new-tokens 224 --temperature 0.7 \
    --top-p 0.8 --batch 64 --json
"${SQ[@]}" regen --model tiny-target --out "$RUN/regen_greedy.jsonl" --max-new-tokens 224 --temperature 0 \
    --batch 64 --json
cat "$RUN/regen_t07.jsonl" "$RUN/regen_greedy.jsonl" > "$RUN/regen_all.jsonl.tmp"
mv "$RUN/regen_all.jsonl.tmp" "$RUN/regen_all.jsonl"

W4=$("$PY" - "$RUN/demo-out" <<'PYEOF'
import sys
from specquant.bench.demo import demo_config
from specquant.bench.prepare import check_inputs, prepare_quantized
paths = check_inputs("tiny-target", "tiny-draft")
prepare_quantized(demo_config(sys.argv[1], quick=False), paths, log=lambda m: print(m, file=sys.stderr))
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
"${SQ[@]}" distill draft --kind block --stage1-target tiny-target --target "$W4" --data "$RUN/regen_all.jsonl" \
    --out "$RUN/draft" --steps "$STAGE1_STEPS" --stage2-steps "$STAGE2_STEPS" --seq-len 256 --batch 4 \
    --num-anchors 32 --lr "${LR:-1e-3}" --warmup 50 --eval-every 250 --save-every 100 --layers 2 \
    --target-layer-ids 1,3,5,6 --no-progress --json "${RESUME[@]}"

if [ -n "$EXPORT" ]; then
    rm -rf "$EXPORT.tmp" && cp -r "$RUN/draft/stage2/model" "$EXPORT.tmp" && rm -f "$EXPORT.tmp/.specquant-out"
    rm -rf "$EXPORT" && mv "$EXPORT.tmp" "$EXPORT"
    echo "exported $EXPORT" >&2
fi
