#!/usr/bin/env bash
# Full-size MoE families on ONE H200 (139 GiB HBM, 128 GiB host) with vLLM's --load-format dummy
# (issue 15, item 3), in at most DEADLINE seconds (default 540) of wall time. Needs the kit
# installed and the project pip-installed into /tmp/site (research.md runbook), PYTHONPATH set,
# and the field plan (FIELD_PLAN, default .kit/strict30-v2-plan.json). No model download.
#
#   bash scripts/gpu_families.sh all   --out DIR     # the whole lane in the foreground
#   bash scripts/gpu_families.sh start --out DIR     # the same in the background (setsid)
#   bash scripts/gpu_families.sh wait SECONDS --out DIR   # progress; then $OUT/families.tgz
#   bash scripts/gpu_families.sh schedule            # print the schedule below (no GPU)
#
# Results: DIR/<family>/{meta,reap,stock,family}.json + server logs, DIR/pin_bench.json,
# DIR/families.md (scripts/gpu_summarize.py --families DIR), DIR/<family>-<arm>.log, DIR/lane.log.
#
# Schedule (servers side by side where HBM and host memory allow; each arm its own process):
#  t=0     pin micro-bench (gpu_pin_bench.py, ~20 s): picks the pinned-allocator setting of the
#          reap-swap servers below (register8 only if its UVA check passed and it was faster)
#  then    A  qwen35 reap  (40 x 256, field plan unchanged, CUDA graphs)   host ~67 GiB, HBM ~26
#          B  qwen35 stock (every expert in HBM, CUDA graphs)              host ~5,  HBM ~70
#          C  mixtral_8x7b_d2 reap+stock, gpt_oss_20b_d4 reap+stock (eager, side by side)
#             then deepseek_v3_d2 reap (1 dense + 1 MoE layer of 256 x 84 MiB = 21 GiB; eager;
#             no stock twin: HBM is taken by B until it ends)
#          D  after B and C: deepseek_v2_lite reap+stock (full 26 x 64, 26.8 GiB, eager)
#  A family whose cap would be under 60 s when its turn comes is skipped and recorded as such.
# What each arm proves: family.json / families.md (research.md "Families at full size").
set -u
PY=${PY:-python3}
DEADLINE=${DEADLINE:-540}
FIELD_PLAN=${FIELD_PLAN:-.kit/strict30-v2-plan.json}
S=/tmp/fam
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  [ "${args[$i]}" = "--out" ] && S=${args[$((i + 1))]}
done
T0=$(date +%s)
stamp() { date +%H:%M:%S; }
step() { echo "$(stamp) +$(( $(date +%s) - T0 ))s [$1] $2"; }
left() { echo $(( DEADLINE - ($(date +%s) - T0) - 15 )); }
min() { [ "$1" -lt "$2" ] && echo "$1" || echo "$2"; }

arm() {  # NAME ARM CAP ARGS... : one arm of one family in its own process, capped
  local name=$1 which=$2 cap=$3; shift 3
  if [ "$cap" -lt 60 ]; then
    step "$name/$which" "skipped: ${cap}s left of the ${DEADLINE}s lane"
    mkdir -p "$S/$name"; echo "{\"skipped\": \"${cap}s left of the ${DEADLINE}s lane\"}" > "$S/$name/$which.skipped.json"
    return
  fi
  step "$name/$which" "start (cap ${cap}s)"
  timeout --kill-after=20 "$cap" $PY scripts/gpu_families.py --name "$name" --out "$S" --arms "$which" \
    --pinned-conf "$PINNED" "$@" > "$S/$name-$which.log" 2>&1
  step "$name/$which" "exit $?"
  grep -E "healthy after|counters|README curl|FAILED|guard|Traceback" "$S/$name-$which.log" | cut -c1-240 | tail -6
}

prep() {  # NAME ARGS... : model folder, plan, meta.json once, before two arms read them
  local name=$1; shift
  $PY scripts/gpu_families.py --name "$name" --out "$S" --arms prepare "$@" > "$S/$name-prepare.log" 2>&1
}

pair() {  # NAME CAP ARGS... : reap and stock side by side, then family.json
  local name=$1 cap=$2; shift 2
  prep "$name" "$@"
  arm "$name" reap "$cap" "$@" &
  arm "$name" stock "$cap" "$@" &
  wait
  $PY scripts/gpu_families.py --name "$name" --out "$S" --arms merge > /dev/null 2>&1
}

qwen() {
  local plan=$FIELD_PLAN
  [ -f "$plan" ] || plan=../shared/fixtures/strict30-v2-plan.json
  if [ ! -f "$plan" ]; then step qwen35 "no field plan (set FIELD_PLAN)"; touch "$S/qwen_stock.done"; return; fi
  local q=(--config tests/data/qwen3_5_moe_35b_a3b_config.json --plan "$plan" --kv-gib 4 --gpu-util 0.1)
  prep qwen35 "${q[@]}"
  (arm qwen35 stock 330 "${q[@]}"; touch "$S/qwen_stock.done") &
  arm qwen35 reap "$(left)" "${q[@]}"
  wait
  $PY scripts/gpu_families.py --name qwen35 --out "$S" --arms merge > /dev/null 2>&1
}

chain_c() {
  pair mixtral_8x7b_d2 "$(min 220 "$(left)")" --config tests/data/mixtral_8x7b_config.json --layers 2 --eager &
  pair gpt_oss_20b_d4 "$(min 220 "$(left)")" --config tests/data/gpt_oss_20b_bf16_config.json --layers 4 --eager &
  wait
  arm deepseek_v3_d2 reap "$(min 200 "$(left)")" --config tests/data/deepseek_v3_bf16_depth2_config.json --eager
  $PY scripts/gpu_families.py --name deepseek_v3_d2 --out "$S" --arms merge > /dev/null 2>&1
  touch "$S/chain_c.done"
}

chain_d() {
  while [ ! -e "$S/qwen_stock.done" ] || [ ! -e "$S/chain_c.done" ]; do
    [ "$(left)" -lt 60 ] && break
    sleep 3
  done
  pair deepseek_v2_lite "$(min 260 "$(left)")" --config tests/data/deepseek_v2_lite_config.json --eager
}

lane() {
  mkdir -p "$S"
  rm -f "$S/qwen_stock.done" "$S/chain_c.done" "$S/all.done"
  {
    $PY -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" 2>&1
    nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv 2>&1
    grep -E "MemTotal|MemAvailable" /proc/meminfo
    git rev-parse HEAD 2>/dev/null
  } > "$S/versions.txt"
  step pin "micro-bench"
  timeout 90 $PY scripts/gpu_pin_bench.py --out "$S" --gib 4 > "$S/pin_bench.log" 2>&1
  PINNED=$($PY -c "import json; print(json.load(open('$S/pin_bench.json')).get('chosen_conf') or '')" 2>/dev/null)
  step pin "reap-swap servers use PYTORCH_CUDA_ALLOC_CONF='${PINNED}'"
  export PINNED
  qwen &
  chain_c &
  chain_d &
  wait
  $PY scripts/gpu_summarize.py --families "$S" > "$S/families.md" 2> "$S/summarize.err"
  touch "$S/all.done"
  step main "all done (families.md)"
}

case "${1:-}" in
  all) mkdir -p "$S"; lane 2>&1 | tee "$S/lane.log" ;;
  session) lane ;;
  start)
    mkdir -p "$S"
    setsid nohup bash "$0" session --out "$S" > "$S/lane.log" 2>&1 < /dev/null &
    sleep 2; echo "$(stamp) background families lane started: $S/lane.log"
    ;;
  wait)
    limit=${2:-540}; t0=$(date +%s)
    while [ ! -e "$S/all.done" ] && [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do sleep 10; done
    tail -40 "$S/lane.log" | cut -c1-240
    [ -e "$S/families.md" ] && cat "$S/families.md"
    mkdir -p "${OUT:-/tmp/out}"
    tar czf "${OUT:-/tmp/out}/families.tgz" --exclude='*.tmp' -C "$(dirname "$S")" "$(basename "$S")" 2>/dev/null
    ls -la "${OUT:-/tmp/out}"
    ;;
  schedule) sed -n '/^# Schedule/,/^# What each/p' "$0" ;;
  *) echo "usage: $0 all|start --out DIR | wait SECONDS --out DIR | schedule"; exit 2 ;;
esac
