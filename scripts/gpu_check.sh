#!/usr/bin/env bash
# The whole GPU check in one command (docs/GPU.md), sized for one lent GPU's 15 minutes of device time:
#   1. environment (GPU, torch, triton) -> $OUT/env.txt
#   2. the kernel and CUDA-graph tests on the GPU (tests/test_triton_w4.py compiled, tests/test_graphs.py with real
#      graphs, eager and torch.compile'd) -> $OUT/tests.log
#   3. benchmarks/gpu.py on the Qwen3-4B / 0.6B shapes -> $OUT/gpu.json, $OUT/bench.log
#   4. if time is left, the same benchmark with the target torch.compile'd first -> $OUT/compiled/
# Uses the machine's python3 (it must hold a CUDA torch and triton; transformers, tokenizers, safetensors, pytest)
# with src/ on PYTHONPATH: nothing is installed or downloaded. Each step has its own time limit, and gpu.json is
# rewritten after every section, so a step cut short still leaves its numbers. Exit status: non-zero if a step
# failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu}
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET_S:-560}  # seconds for the whole script (one device command may run 600)
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
start=$SECONDS
left() { echo $((BUDGET - (SECONDS - start))); }
status=0

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv 2>&1
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/env.txt" || status=1

echo "== tests on the GPU (limit 150 s)"
timeout 150 "$PY" -m pytest -q -p no:cacheprovider tests/test_triton_w4.py tests/test_graphs.py 2>&1 \
  | tee "$OUT/tests.log" || status=1

echo "== benchmarks/gpu.py (limit $(( $(left) - 30 )) s)"
timeout $(( $(left) - 30 )) "$PY" benchmarks/gpu.py --device cuda --out "$OUT/eager" 2>&1 | tee "$OUT/bench.log" || status=1

if [ "$(left)" -gt 150 ]; then
  echo "== benchmarks/gpu.py --compile (limit $(( $(left) - 10 )) s)"
  timeout $(( $(left) - 10 )) "$PY" benchmarks/gpu.py --device cuda --compile --out "$OUT/compiled" 2>&1 \
    | tee "$OUT/compiled.log" || status=1
else
  echo "== skipped the --compile run: $(left) s left"
fi
exit $status
