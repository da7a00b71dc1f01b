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
# phase: <run dir> <stop at step> <command...>
phase() { local dir=$1 stop=$2; shift 2; local s; s=$(step "$dir"); [ "$s" -ge "$stop" ] || "$@" --stop-after $((stop - s)); }
phase runs/target 200 $T --steps 1400 --seq-len 256 --batch-size 8
phase runs/target 300 $T --steps 750 --seq-len 1024 --batch-size 2
phase runs/target 400 $T --steps 450 --seq-len 256 --batch-size 8
$T --steps 700 --seq-len 256 --batch-size 8 --export src/specquant/models/tiny-target
# the draft imitates the target: forward KL to its logits at T=1 over the full vocabulary
D="$PY scripts/train_bundled.py --role draft --teacher src/specquant/models/tiny-target --run-dir runs/draft"
phase runs/draft 200 $D --steps 500 --seq-len 256 --batch-size 8 --lr 3e-3
$D --steps 300 --seq-len 256 --batch-size 8 --lr 3e-3 --export src/specquant/models/tiny-draft
