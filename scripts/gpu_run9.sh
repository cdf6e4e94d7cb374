#!/usr/bin/env bash
# Run 9 on ONE H200 (issues 15, 16, 17), in the background so it outlives a 10-minute device call:
#   bash scripts/gpu_run9.sh start        # after the kit is installed and /tmp/model exists
#   bash scripts/gpu_run9.sh wait 530     # progress, then $OUT/run9.tgz
# Phases (sequential where a phase needs the whole GPU or measures free memory):
#  1. pytest tests/gpu (engine binding per format, device cache, counters, VMM)  || quant checkpoints written (CPU)
#     then the device cache's policy-step timing (scripts/bench_device_cache.py)
#  2. families at full size (scripts/gpu_families.sh: the whole GPU, side-by-side servers)
#  3. quantized formats end to end (scripts/gpu_quant_e2e.py: 5 small servers at a time)
#  4. --reap-budget auto at two --gpu-memory-utilization values (scripts/gpu_budget_auto.py: alone)
# SKIP="families quant" skips phases; everything lands in /tmp/run9.
set -u
R=/tmp/run9
PY=python3
export PYTHONPATH=$PWD:/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1  # the synced tree first
stamp() { date +%H:%M:%S; }
step() { echo "$(stamp) [$1] $2"; }
skip() { case " ${SKIP:-} " in *" $1 "*) return 0 ;; esac; return 1; }

session() {
  step run9 "pytest tests/gpu || quant checkpoints"
  (timeout 600 $PY scripts/make_quant_checkpoint.py --out $R/quant/checkpoints --plain-attention 1 \
     > $R/quant_ckpt.log 2>&1; echo "ckpt exit $?" >> $R/quant_ckpt.log) &
  ckpt=$!
  timeout 420 $PY -m pytest -q -rs tests/gpu -p no:cacheprovider > $R/gpu_tests.log 2>&1
  tail -5 $R/gpu_tests.log
  if ! skip dcache; then
    step run9 "device-cache step bench"
    timeout 300 $PY scripts/bench_device_cache.py --log-dir $R/dcache > $R/dcache.log 2>&1
    tail -5 $R/dcache.log
  fi
  if ! skip families; then
    step run9 "families"
    FIELD_PLAN=.kit/strict30-v2-plan.json DEADLINE=${FAM_DEADLINE:-540} \
      bash scripts/gpu_families.sh all --out $R/fam > $R/families.log 2>&1
    tail -5 $R/families.log
  fi
  wait $ckpt
  if ! skip quant; then
    step run9 "quant e2e"
    timeout 480 $PY scripts/gpu_quant_e2e.py --out $R/quant --jobs 5 > $R/quant.log 2>&1
    tail -5 $R/quant.log
  fi
  if ! skip budget; then
    step run9 "budget auto"
    $PY -c "import sys; sys.path.insert(0, 'scripts'); from pathlib import Path; import gpu_e2e; \
gpu_e2e.make_plan(Path('/tmp/model'), 0.25, 8, Path('$R/budget.plan.json'), budget_fraction=0.5)"
    timeout 360 $PY scripts/gpu_budget_auto.py --model /tmp/model --plan $R/budget.plan.json --out $R/budget \
      > $R/budget.log 2>&1
    tail -5 $R/budget.log
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
  wait)
    limit=${2:-530}; t0=$(date +%s)
    while [ ! -e $R/all.done ] && [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do sleep 10; done
    cat $R/main.log; free -g | head -2; nvidia-smi --query-gpu=memory.used --format=csv
    for f in dcache families quant budget; do [ -e $R/$f.log ] && { echo "== $f"; tail -6 $R/$f.log | cut -c1-300; }; done
    mkdir -p "$OUT"
    tar czf "$OUT/run9.tgz" --exclude='checkpoints' --exclude='*.safetensors' -C /tmp run9 2>/dev/null
    ls -la "$OUT"
    ;;
  *) echo "usage: $0 start | wait SECONDS"; exit 2 ;;
esac
