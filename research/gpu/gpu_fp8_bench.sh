#!/usr/bin/env bash
# Issue 16's FP8 bench on ONE H200 (vLLM 0.26.0 kit installed, project in /tmp/site, /tmp/model
# from mk_model.py or made here): the skewed model in block FP8, observe -> plan, then
# `reap-swap bench` at 25 % and 50 % of the FP8 expert bytes against stock UVA of the same
# checkpoint and stock all-resident, servers started side by side, measured one at a time.
#
#   bash research/gpu/gpu_fp8_bench.sh run   --out DIR      # foreground (~8 min, see below)
#   bash research/gpu/gpu_fp8_bench.sh start --out DIR      # the same in the background (setsid)
#   bash research/gpu/gpu_fp8_bench.sh wait SECONDS --out DIR   # progress; packs $OUT/fp8bench.tgz
#
# Phases (times estimated from runs 3, 8, 9 on the H200; none of this has run yet):
#  1. scripts/make_skewed_moe.py /tmp/model /tmp/skew-fp8 --format fp8-block (12 layers x 128
#     experts, 6.75 GiB of FP8 experts; reused when its skew_construction.json says fp8-block)  ~40 s
#  2. reap-swap observe (calibration corpus, 400 records, eager)                                ~90 s
#     reap-swap plan --budget-ratio 0.5 --core-fraction 0.48 (as runs 3/4)                      ~5 s
#  3. one `reap-swap bench` per server, all at once, each with a fixed 2 GiB KV cache and
#     --gpu-memory-utilization 0.1 (only vLLM's start check): resident, stock-uva@25 %,
#     stock-uva@50 %, plan-swap@25 %, plan-swap@50 %, and plan-swap at 37.5 % (HBM_MATCHED=1,
#     default: its 6 MiB units then take about the HBM stock UVA's 50 % keeps; 25 % has no such
#     twin, the plan's core is 24 %). A lock held by this script until every server is healthy
#     (or STARTUP_CAP), then --measure-lock: one bench measures at a time, on a quiet GPU.
#     Start-ups ~120-180 s side by side, then ~30-45 s of measurement per arm              ~5 min
#  4. reap-swap bench --merge, then research/gpu/fp8_bench_summary.py -> DIR/merged/fp8_bench.{md,png}
# HBM: ~12 GiB per server (weights <= 7.3, KV 2, graphs); host: <= 6.75 GiB pinned per server.
# SIGTERM/INT: every bench this script started gets SIGTERM (each stops its own server).
set -u
PY=${PY:-python3}
S=/tmp/fp8bench
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do [ "${args[$i]}" = "--out" ] && S=${args[$((i + 1))]}; done
SRC=${SRC_MODEL:-/tmp/model}
DST=${FP8_MODEL:-/tmp/skew-fp8}
REPEATS=${REPEATS:-3}
STARTUP_CAP=${STARTUP_CAP:-300}
BENCH_CAP=${BENCH_CAP:-560}
export PYTHONPATH=${PYTHONPATH:-$PWD:/tmp/site} VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1
ENGINE=(--dtype bfloat16 --max-model-len 2048 --max-num-seqs 8 --gpu-memory-utilization 0.1
  --kv-cache-memory-bytes 2147483648 --moe-backend triton)
T0=$(date +%s)
step() { echo "$(date +%H:%M:%S) +$(($(date +%s) - T0))s [$1] $2"; }
PIDS=()
stop_all() {
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done
  wait
  exit 143
}

write_model() {
  if grep -q '"format": "fp8-block"' "$DST/skew_construction.json" 2>/dev/null; then
    step write "reusing $DST"; return 0
  fi
  [ -f "$SRC/config.json" ] || { step write "no $SRC: mk_model.py"; $PY /tmp/kit/tools/mk_model.py "$SRC" > "$S/mk_model.log" 2>&1; }
  step write "make_skewed_moe --format fp8-block $SRC -> $DST"
  $PY scripts/make_skewed_moe.py "$SRC" "$DST" --format fp8-block --workers 8 > "$S/skew.log" 2>&1 \
    || { tail -20 "$S/skew.log"; return 1; }
  tail -1 "$S/skew.log"; cp "$DST/skew_construction.json" "$DST/config.json" "$S/" 2>/dev/null
}

observe_plan() {
  step observe "reap-swap observe (eager)"
  timeout --kill-after=20 300 $PY -m reap_swap.cli observe --model "$DST" --corpus data/corpus/calibration.jsonl \
    --out "$S/skewfp8.obs.pt" --no-progress "${ENGINE[@]}" --enforce-eager > "$S/observe.log" 2>&1 \
    || { tail -30 "$S/observe.log"; return 1; }
  step plan "reap-swap plan"
  $PY -m reap_swap.cli plan --observations "$S/skewfp8.obs.pt" --model "$DST" --budget-ratio 0.5 \
    --core-fraction 0.48 --out "$S/skewfp8.plan.json" > "$S/plan.log" 2>&1 || { tail -30 "$S/plan.log"; return 1; }
  tail -3 "$S/plan.log"
}

bench() {  # NAME ARGS... : one bench (one server) in the background
  local name=$1; shift
  timeout --kill-after=20 "$BENCH_CAP" $PY -m reap_swap.cli bench --model "$DST" --plan "$S/skewfp8.plan.json" \
    --prompts data/corpus/heldout.jsonl --batch 8 --repeats "$REPEATS" --no-progress \
    --startup-timeout "$STARTUP_CAP" --measure-lock "$S/measure.lock" --out "$S/b-$name" "$@" -- "${ENGINE[@]}" \
    > "$S/b-$name.log" 2>&1 &
  PIDS+=($!)
}

benches() {
  local b25 b50 b37 names n
  read -r b25 b50 b37 < <($PY -c "from reap_swap.sizing.model_shape import read_model_shape as r; \
t = r('$DST').total_expert_bytes / 2**30; print(t * 0.25, t * 0.5, t * 0.375)")
  step bench "budgets 25 % = $b25 GiB, 50 % = $b50 GiB (FP8 bytes); HBM-matched plan-swap at $b37 GiB"
  rm -f "$S/measure.lock" "$S/release"
  # hold the measure lock until every server is up (a python holder: flock(1) may be missing)
  $PY -c "import fcntl, os, sys, time; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX); \
open(sys.argv[2] + '.held', 'w').close(); t = time.time(); \
[time.sleep(1) for _ in iter(lambda: os.path.exists(sys.argv[2]) or time.time() - t > $STARTUP_CAP + 30, True)]" \
    "$S/measure.lock" "$S/release" &
  local holder=$!
  while [ ! -e "$S/release.held" ]; do sleep 0.2; done
  names=(resident uva25 uva50 swap25 swap50)
  bench resident --arms resident
  bench uva25 --arms stock-uva --budget-gib "$b25"
  bench uva50 --arms stock-uva --budget-gib "$b50"
  bench swap25 --arms plan-swap --budget-gib "$b25"
  bench swap50 --arms plan-swap --budget-gib "$b50"
  if [ "${HBM_MATCHED:-1}" = 1 ]; then names+=(swap37); bench swap37 --arms plan-swap --budget-gib "$b37"; fi
  while :; do  # until every bench's server is healthy or its bench has ended
    n=0
    for x in "${names[@]}"; do
      grep -q "healthy after\|FAILED\|^error" "$S/b-$x.log" 2>/dev/null && n=$((n + 1))
    done
    [ "$n" -ge "${#names[@]}" ] && break
    kill -0 "$holder" 2>/dev/null || break
    sleep 2
  done
  step bench "$n/${#names[@]} servers up or done; measuring one at a time"
  touch "$S/release"; wait "$holder"
  for p in "${PIDS[@]}"; do wait "$p"; done
  for x in "${names[@]}"; do step "bench/$x" "$(grep -E 'healthy after|hit rate|FAILED|^error' "$S/b-$x.log" | tail -2 | cut -c1-200 | tr '\n' ' ')"; done
}

lane() {
  mkdir -p "$S"; rm -f "$S/all.done"
  trap stop_all TERM INT
  { $PY -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" 2>&1
    nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv 2>&1
    grep -E "MemTotal|MemAvailable" /proc/meminfo; git rev-parse HEAD 2>/dev/null; } > "$S/versions.txt"
  if write_model && observe_plan; then
    benches
    local dirs=()
    for d in "$S"/b-*/; do [ -f "$d/bench.json" ] && dirs+=("$d"); done
    step merge "${#dirs[@]} reports"
    $PY -m reap_swap.cli bench --merge "${dirs[@]}" --out "$S/merged" > "$S/merge.log" 2>&1 || tail -5 "$S/merge.log"
    $PY research/gpu/fp8_bench_summary.py "$S/merged/bench.json" > "$S/summary.log" 2>&1 || tail -5 "$S/summary.log"
    cat "$S/merged/fp8_bench.md" 2>/dev/null
  fi
  touch "$S/all.done"
  step main "all done"
}

case "${1:-}" in
  run) mkdir -p "$S"; lane 2>&1 | tee "$S/lane.log" ;;
  session) lane ;;
  start)
    mkdir -p "$S"
    setsid nohup bash "$0" session --out "$S" > "$S/lane.log" 2>&1 < /dev/null &
    sleep 2; echo "$(date +%H:%M:%S) background FP8 bench started: $S/lane.log"
    ;;
  wait)
    limit=${2:-540}; t0=$(date +%s); mkdir -p "${OUT:-/tmp/out}"
    while [ ! -e "$S/all.done" ] && [ $(($(date +%s) - t0)) -lt "$limit" ]; do sleep 10; done
    tail -30 "$S/lane.log" | cut -c1-300
    tar czf "${OUT:-/tmp/out}/fp8bench.tgz" --exclude='*.pt' --exclude='*.safetensors' \
      -C "$(dirname "$S")" "$(basename "$S")" 2>/dev/null
    ls -la "${OUT:-/tmp/out}"
    ;;
  *) echo "usage: $0 run|start --out DIR | wait SECONDS --out DIR"; exit 2 ;;
esac
