#!/usr/bin/env bash
# gpu_run.sh's `extra` phase for run 20 (issue 17): why plan-cache at 25 % is not bitwise equal to stock.
# Runs 12 and 19 both measured plan-cache@25 with 7/8 tokens and 0/8 bitwise logprobs against the
# resident arm (d first logprob up to 1.6e-2), while every other arm, resident-2 and plan-cache@50 were
# bitwise. Four bench jobs on run 19's skewed model and 25 % plan, started together, each one server:
#   shadow      plan-cache, REAP_CACHE_SHADOW=bytes: every cached MoE step beside the uncached kernel,
#               every slot's bytes checked (reap_status.cache.shadow in bench.json): the cache's fault?
#   cache       plan-cache as in run 19 (control: does it reproduce?)
#   detcache    plan-cache, TORCHINDUCTOR_DETERMINISTIC=1 (run 12's hypothesis: per-process autotune)
#   detres      resident, TORCHINDUCTOR_DETERMINISTIC=1 (the reference for detcache)
# Usage: bash scripts/gpu_extra_phase.sh OUTDIR   (needs /tmp/model; makes /tmp/skew)
set -u
O=${1:?outdir}; mkdir -p "$O"
PLAN=research-notes/h200-2026-12-03/run19/skew25.plan.json
PY=${PY:-python3}
[ -f /tmp/skew/skew_construction.json ] || $PY scripts/make_skewed_moe.py /tmp/model /tmp/skew --workers 8 > "$O/skew.log" 2>&1
ENGINE=(--dtype bfloat16 --max-model-len 2048 --max-num-seqs 8 --gpu-memory-utilization 0.1
        --kv-cache-memory-bytes 2147483648 --moe-backend triton)
job() {  # NAME ARMS ENV...
  local name=$1 arms=$2; shift 2
  env "$@" timeout --kill-after=20 ${DIAG_CAP:-460} $PY -m reap_swap.cli bench --model /tmp/skew --plan $PLAN \
    --prompts data/corpus/heldout.jsonl --batch 8 --repeats 1 --no-progress --startup-timeout 400 \
    --budget-gib 3.375 --out "$O/$name" --arms "$arms" -- "${ENGINE[@]}" > "$O/$name.log" 2>&1
  echo "$(date +%T) $name exit $?" >> "$O/jobs.log"
}
job shadow plan-cache REAP_CACHE_SHADOW=bytes &
job cache plan-cache X=1 &
job detcache plan-cache TORCHINDUCTOR_DETERMINISTIC=1 &
job detres resident TORCHINDUCTOR_DETERMINISTIC=1 &
wait
