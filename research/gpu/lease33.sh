#!/usr/bin/env bash
# Run 33 (issue 42, after the kit's install call), in the background so it outlives a device call;
# poll with `tail /tmp/run/lease.log`, collect with `tar`.
#   1. equality (two drivers at once; equality is not a timing): stock then the plan-only default
#      sharing stock's compile cache (the one candidate cause runs 30-32 did not try), and beside
#      them the server without a plan (compared with this stock offline: same card, same prompts)
#   2. the skew bench at 50 %: plan-cache (= the default form), resident, plan-static, plan-swap+cache
#   3. the kit model (near-uniform routing) at 50 %: plan-cache vs plan-static vs resident, same bench
#   4. the swap guard, then the all-resident decode guard, if the lease lasts
source "$(dirname "$0")/lease_env.sh"
say "eq start"
python3 research/gpu/gpu_cache_equality.py --model /tmp/model --out "$R/eqB" --arms reap-noplan > "$R/eqB.log" 2>&1 &
B=$!
python3 research/gpu/gpu_cache_equality.py --model /tmp/model --out "$R/eqA" \
  --arms stock,reap-default+shared > "$R/eqA.log" 2>&1
say "eqA rc $?"
wait $B
say "eqB rc $?"
timeout 660 python3 research/gpu/gpu_skew_bench.py --out "$R/skew" --no-25 --deadline 600 \
  --only cache50,resident,static50,swapcache50 > "$R/skew.log" 2>&1
say "skew rc $?"
timeout 480 python3 research/gpu/gpu_skew_bench.py --out "$R/uniform" --skew /tmp/model --plan50 "$R/eqA/plan.json" \
  --no-25 --deadline 420 --only cache50,resident,static50 > "$R/uniform.log" 2>&1
say "uniform rc $?"
run_guards
say "all done"
