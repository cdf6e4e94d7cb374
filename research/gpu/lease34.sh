#!/usr/bin/env bash
# Run 34 (one lease, in order of what is cheapest to finish): the GPU tests (issue 43: the renamed
# step="triton" tests and the folded VMM stores), the skew bench (issue 42: the step kernel with its
# run-time slot count: startup time, no torch fallback), the equality driver at 25 % on the kit model
# and on the skewed model with swaps in flight, then the two guards. Poll calls tar /tmp/run into $OUT.
source "$(dirname "$0")/lease_env.sh"
python3 -c "import pytest; print('pytest', pytest.__version__)" >> "$R/lease.log" 2>&1
say "gpu tests start"
timeout 480 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu > "$R/pytest_gpu.log" 2>&1
say "gpu tests rc $?"
timeout 560 python3 research/gpu/gpu_skew_bench.py --out "$R/skew" --no-25 --deadline 500 --all-at-once \
  --only cache50,resident,static50 > "$R/skew.log" 2>&1
say "skew rc $?"
grep -rh "runs the torch policy step\|step kernel" "$R/skew" 2>/dev/null | head -20 >> "$R/lease.log"
timeout 420 python3 research/gpu/gpu_cache_equality.py --model /tmp/model --out "$R/eq25" --budget 0.25 --core 0.125 \
  --arms stock,reap-default > "$R/eq25.log" 2>&1
say "eq25 rc $?"
timeout 420 python3 research/gpu/gpu_cache_equality.py --model /tmp/skew --out "$R/eqskew" \
  --arms stock,reap-default > "$R/eqskew.log" 2>&1
say "eqskew rc $?"
run_guards
say "all done"
