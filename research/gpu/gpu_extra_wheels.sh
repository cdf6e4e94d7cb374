#!/usr/bin/env bash
# Wheels reap-swap needs on the GPU machine beyond shared/gpu-kit (its image lacks them):
# downloads them for CPython 3.12 / manylinux x86_64 into .kit/extra (git-ignored).
# On the device: python3 -m pip install --no-index --no-deps --target /tmp/site .kit/extra/*.whl
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .kit/extra
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .kit/extra orjson
ls -la .kit/extra
