#!/usr/bin/env bash
# Run 32 (issue 42, after the kit's install call): the default device cache served on the GPU, in the
# background so it outlives a device call; poll with `tail /tmp/run/lease.log`, collect with `tar`.
#   1. equality: stock, the plan only (the default), a plan-only server sharing stock's compile cache,
#      the static plan set (quiet phase: the near-uniform speed reference)
#   2. the skew bench at 50 %: plan-cache (= the default form), resident, plan-static, plan-swap+cache
#   3. the swap guard, then the all-resident decode guard (one serve)
source "$(dirname "$0")/lease_env.sh"
say "eq start"
python3 research/gpu/gpu_cache_equality.py --model /tmp/model --out "$R/eq" \
  --arms "${EQ_ARMS:-stock,reap-default,reap-default+shared,reap-static+quiet}" > "$R/eq.log" 2>&1
say "eq rc $?"
timeout 660 python3 research/gpu/gpu_skew_bench.py --out "$R/skew" --no-25 --deadline 600 \
  --only cache50,resident,static50,swapcache50 > "$R/skew.log" 2>&1
say "skew rc $?"
run_guards
say "all done"
