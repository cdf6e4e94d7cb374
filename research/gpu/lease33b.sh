#!/usr/bin/env bash
# Run 33, second lease (the first machine was taken back mid-run, its results lost): the benches
# first, every server of a bench started at once (short lease), then the shared-compile-cache
# equality arm, quiet phase, if the lease lasts. Poll calls tar /tmp/run into $OUT each time.
source "$(dirname "$0")/lease_env.sh"
say "skew start"
timeout 560 python3 research/gpu/gpu_skew_bench.py --out "$R/skew" --no-25 --deadline 520 --all-at-once \
  --only cache50,resident,static50,swapcache50 > "$R/skew.log" 2>&1
say "skew rc $?"
python3 -c "import sys; sys.path.insert(0, 'research/gpu'); import gpu_e2e; from pathlib import Path; gpu_e2e.make_plan(Path('/tmp/model'), 0.25, 8, Path('$R/uniform.plan.json'), budget_fraction=0.5)" >> "$R/lease.log" 2>&1
timeout 400 python3 research/gpu/gpu_skew_bench.py --out "$R/uniform" --skew /tmp/model --plan50 "$R/uniform.plan.json" \
  --no-25 --deadline 360 --only cache50,static50 > "$R/uniform.log" 2>&1
say "uniform rc $?"
python3 research/gpu/gpu_cache_equality.py --model /tmp/model --out "$R/eq" \
  --arms stock,reap-default+shared+quiet > "$R/eq.log" 2>&1
say "eq rc $?"
say "all done"
