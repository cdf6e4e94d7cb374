#!/usr/bin/env bash
# gpu_run.sh's `extra` phase (issue 17): plan-cache at 25 % beside stock, with and without Inductor's
# on-device autotuning. Run 20 (this script at 4689d30: jobs cache, detcache, detres, shadow=bytes) found
# plan-cache@25 bitwise equal to stock under TORCHINDUCTOR_DETERMINISTIC=1 and moving per process without
# it; its `bytes` shadow failed vLLM's graph capture (fixed in 551953d). This version (lease C2 of
# research.md "Next leases (after run 20)") asks whether the moving process's MoE layers still equal their
# uncached kernel at every step, and repeats the deterministic pair. Jobs (DIAG_JOBS picks, all by default),
# each one `reap-swap bench` server on run 19's skewed model and 25 % plan, started together:
#   shadowout   plan-cache, REAP_CACHE_SHADOW=out: the uncached kernel beside every cached step (cheap)
#   shadowbytes plan-cache, REAP_CACHE_SHADOW=bytes: also every slot's bytes every step (the capture fix)
#   detcache    plan-cache, TORCHINDUCTOR_DETERMINISTIC=1 (a second sample of run 20's bitwise result)
#   detres      resident, TORCHINDUCTOR_DETERMINISTIC=1 (its reference)
# reap_status.cache.shadow in each bench.json holds the shadow's per-layer report.
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
  case " ${DIAG_JOBS:-shadowout shadowbytes detcache detres} " in *" $name "*) ;; *) return 0 ;; esac
  env "$@" timeout --kill-after=20 ${DIAG_CAP:-460} $PY -m reap_swap.cli bench --model /tmp/skew --plan $PLAN \
    --prompts data/corpus/heldout.jsonl --batch 8 --repeats 1 --no-progress --startup-timeout 400 \
    --budget-gib 3.375 --out "$O/$name" --arms "$arms" -- "${ENGINE[@]}" > "$O/$name.log" 2>&1
  echo "$(date +%T) $name exit $?" >> "$O/jobs.log"
}
job shadowout plan-cache REAP_CACHE_SHADOW=out &
job shadowbytes plan-cache REAP_CACHE_SHADOW=bytes &
job detcache plan-cache TORCHINDUCTOR_DETERMINISTIC=1 &
job detres resident TORCHINDUCTOR_DETERMINISTIC=1 &
wait
