#!/usr/bin/env bash
# Reproduces the shipped tiny-target / tiny-draft exactly (deterministic given the seed and these phases).
# The target was trained in phases because the session's 2 shared CPU cores ran slower than planned: each phase
# resumes the previous checkpoint with a new step budget (the cosine schedule follows the current --steps).
# Every call is resumable: rerun the script after an interruption and each phase continues where it stopped.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
T="$PY scripts/train_bundled.py --role target --run-dir runs/target"
step() { $PY - "$1" <<'PYEOF'
import sys, pathlib
from safetensors import safe_open
p = pathlib.Path(sys.argv[1]) / "ckpt.safetensors"
print(int(safe_open(str(p), "pt").metadata()["step"]) if p.exists() else 0)
PYEOF
}
# phase: <stop at step> <args>
phase() { local stop=$1; shift; local s; s=$(step runs/target); [ "$s" -ge "$stop" ] || $T "$@" --stop-after $((stop - s)); }
phase 200 --steps 1400 --seq-len 256 --batch-size 8
phase 300 --steps 750 --seq-len 1024 --batch-size 2
phase 400 --steps 450 --seq-len 256 --batch-size 8
$T --steps 700 --seq-len 256 --batch-size 8 --export src/specquant/models/tiny-target
# the draft imitates the target: forward KL to its logits at T=1 over the full vocabulary
$PY scripts/train_bundled.py --role draft --teacher src/specquant/models/tiny-target --run-dir runs/draft \
    --steps 500 --seq-len 256 --batch-size 8 --lr 3e-3 --export src/specquant/models/tiny-draft
