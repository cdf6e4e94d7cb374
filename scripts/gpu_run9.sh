#!/usr/bin/env bash
# Run 9 on ONE H200 (issues 15, 16, 17), in the background so it outlives a 10-minute device call:
#   bash scripts/gpu_run9.sh start        # after the kit is installed and /tmp/model exists
#   bash scripts/gpu_run9.sh wait 530     # progress, then $OUT/run9.tgz
# Phases (sequential where a phase needs the whole GPU or measures free memory):
#  1. the device cache's policy-step timing (scripts/bench_device_cache.py), alone
#  2. families at full size (scripts/gpu_families.sh: the whole GPU, side-by-side servers)
#     || pytest tests/gpu (engine binding per format, device cache, counters, VMM)
#  3. --reap-budget auto at two --gpu-memory-utilization values (scripts/gpu_budget_auto.py: alone)
#  4. the device cache in the server for a plain client (gpu_e2e.py reap-cache vs reap-plan25)
#  5. quantized formats end to end (scripts/gpu_quant_e2e.py, a subset)
# SKIP="families quant" skips phases; everything lands in /tmp/run9.
set -u
R=/tmp/run9
PY=python3
export PYTHONPATH=$PWD:/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1  # the synced tree first
stamp() { date +%H:%M:%S; }
step() { echo "$(stamp) [$1] $2"; }
leftovers() {  # stop any server a timed-out phase left behind, then wait until its HBM is free (run 9b)
  pkill -TERM -f "vllm.entrypoints.openai.api_server|reap_swap.server|EngineCore" 2>/dev/null; sleep 5
  pkill -KILL -f "vllm.entrypoints.openai.api_server|reap_swap.server|EngineCore" 2>/dev/null
  for _ in $(seq 30); do
    used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
    [ "${used:-0}" -lt 2048 ] && break; sleep 2
  done
  step run9 "GPU memory in use before the next phase: ${used:-?} MiB"
}
skip() { case " ${SKIP:-} " in *" $1 "*) return 0 ;; esac; return 1; }

session() {
  if ! skip dcache; then
    step run9 "device-cache step bench (torch ops, compiled, fused Triton)"
    timeout 150 $PY scripts/bench_device_cache.py --log-dir $R/dcache > $R/dcache.log 2>&1
    tail -8 $R/dcache.log
  fi
  step run9 "pytest tests/gpu (background) || families"
  (timeout 420 $PY -m pytest -q -rs tests/gpu -p no:cacheprovider > $R/gpu_tests.log 2>&1) &
  tests=$!
  if ! skip families; then
    FIELD_PLAN=.kit/strict30-v2-plan.json DEADLINE=${FAM_DEADLINE:-500} \
      bash scripts/gpu_families.sh all --out $R/fam > $R/families.log 2>&1
    tail -5 $R/families.log
  fi
  wait $tests; tail -3 $R/gpu_tests.log
  leftovers
  if ! skip budget; then
    step run9 "budget auto"
    $PY -c "import sys; sys.path.insert(0, 'scripts'); from pathlib import Path; import gpu_e2e; \
gpu_e2e.make_plan(Path('/tmp/model'), 0.25, 8, Path('$R/budget.plan.json'), budget_fraction=0.5)"
    timeout 280 $PY scripts/gpu_budget_auto.py --model /tmp/model --plan $R/budget.plan.json --out $R/budget \
      --arms ${BUDGET_ARMS:-auto@0.5,auto@0.85,refused} > $R/budget.log 2>&1
    tail -5 $R/budget.log
    leftovers
  fi
  if ! skip cache; then
    step run9 "device cache in the server (plain client): reap-cache, reap-plan25"
    mkdir -p $R/cache  # stock-gpu's greedy text from run 8 (same kit, same seeded mk_model, same flags)
    $PY -c "import json; d=json.load(open('research-notes/h200-2026-12-01/run8-gpu_e2e.json')); \
json.dump({'stock-gpu': d['stock-gpu']}, open('$R/cache/gpu_e2e.json', 'w'))"
    timeout 300 $PY scripts/gpu_e2e.py --model /tmp/model --out $R/cache --moe-probe --arms reap-cache,reap-plan25 \
      > $R/cache.log 2>&1
    tail -5 $R/cache.log
    leftovers
  fi
  if ! skip quant; then
    step run9 "quant e2e (${QUANT_CASES:-bf16,fp8-block,fp8-tensor,fp8-online,awq})"
    timeout 400 $PY scripts/gpu_quant_e2e.py --out $R/quant --jobs 3 --cases ${QUANT_CASES:-bf16,fp8-block,fp8-tensor,fp8-online,awq} \
      > $R/quant.log 2>&1
    tail -5 $R/quant.log
  fi
  touch $R/all.done
  step run9 "all done"
}

case "${1:-}" in
  start)
    mkdir -p $R
    setsid nohup bash "$0" session > $R/main.log 2>&1 < /dev/null &
    sleep 2; step start "background run9 session started"
    ;;
  session) session ;;
  wait)  # packs $OUT/run9.tgz every 60 s too, so a call cut short still brings results back
    limit=${2:-530}; t0=$(date +%s); last=0
    mkdir -p "$OUT"
    while [ ! -e $R/all.done ] && [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do
      sleep 10
      if [ $(( $(date +%s) - last )) -ge 60 ]; then
        tar czf "$OUT/run9.tgz.tmp" --exclude='checkpoints' --exclude='*.safetensors' -C /tmp run9 $([ -d /tmp/fam ] && echo fam) 2>/dev/null \
          && mv "$OUT/run9.tgz.tmp" "$OUT/run9.tgz"; last=$(date +%s)
      fi
    done
    cat $R/main.log; free -g | head -2; nvidia-smi --query-gpu=memory.used --format=csv
    for f in dcache families quant budget cache; do [ -e $R/$f.log ] && { echo "== $f"; tail -6 $R/$f.log | cut -c1-300; }; done
    tar czf "$OUT/run9.tgz.tmp" --exclude='checkpoints' --exclude='*.safetensors' -C /tmp run9 $([ -d /tmp/fam ] && echo fam) 2>/dev/null \
      && mv "$OUT/run9.tgz.tmp" "$OUT/run9.tgz"
    ls -la "$OUT"
    ;;
  *) echo "usage: $0 start | wait SECONDS"; exit 2 ;;
esac
