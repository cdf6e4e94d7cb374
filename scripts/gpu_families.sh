#!/usr/bin/env bash
# Full-size MoE families on the H200 with vLLM's --load-format dummy (issue 15, item 3): a session
# in the background like gpu_session.sh, one log and one result folder per family under /tmp/fam,
# packed into $OUT/families.tgz by `wait`. Needs the kit installed (research.md runbook) and the
# project pip-installed into /tmp/site; no model download, no /tmp/model.
#
#   bash scripts/gpu_families.sh start [LANES]   # LANES=1 (one GPU, sequential) or 2 (two GPUs)
#   bash scripts/gpu_families.sh wait 540        # progress, then $OUT/families.tgz
#
# Priority order (what runs first is what a short lease gets):
#   lane A: Qwen3.5-35B-A3B, full 40 x 256 (60 GiB of bf16 experts) with the field plan unchanged:
#           reap-swap (core filled at startup, counters, slices / 50 % / 100 % / core, probes),
#           then stock vLLM all-HBM (greedy + probe reference)
#   lane B: GPT-OSS-20B bf16 (24 x 32, biases), DeepSeek-V2-Lite (26 x 64, MLA), Mixtral-8x7B
#           at depth 16 (16 x 8 x 336 MiB = 42 GiB): reap-swap only (probe vs its own core phase)
# With LANES=1 lane B runs after lane A on the same GPU. Each family has a wall-clock cap.
# Host memory: see research.md "Host memory at real size": a reap-swap server of Qwen3.5 may need
# about twice the expert bytes of host memory at startup; the driver kills a server that drives
# MemAvailable under 3 GiB and records it (killed_by_guard) instead of letting the OOM killer act.
set -u
S=/tmp/fam
PY=python3
CAP_QWEN=${CAP_QWEN:-600}   # reap + stock, seconds
CAP_OTHER=${CAP_OTHER:-240} # each lane-B family (reap only)
FIELD_PLAN=${FIELD_PLAN:-}
stamp() { date +%H:%M:%S; }
step() { echo "$(stamp) [$1] $2"; }

field_plan() {
  for p in "$FIELD_PLAN" shared/fixtures/strict30-v2-plan.json ../shared/fixtures/strict30-v2-plan.json; do
    [ -n "$p" ] && [ -f "$p" ] && { echo "$p"; return; }
  done
}

family() {  # NAME CAP ARGS... : one family, its own log, capped
  local name=$1 cap=$2; shift 2
  step "$name" "start (cap ${cap}s)"
  timeout --kill-after=20 "$cap" $PY scripts/gpu_families.py --name "$name" --out $S/out "$@" \
    > $S/$name.log 2>&1
  step "$name" "exit $?"
  grep -E "healthy after|counters|probe vs|greedy vs|FAILED|guard" $S/$name.log | cut -c1-300 | tail -20
}

lane_a() {
  local plan; plan=$(field_plan)
  if [ -z "$plan" ]; then step qwen35 "no field plan found (set FIELD_PLAN)"; return; fi
  family qwen35 "$CAP_QWEN" --config tests/data/qwen3_5_moe_35b_a3b_config.json --plan "$plan" --arms reap,stock
}

lane_b() {
  family gpt_oss_20b "$CAP_OTHER" --config tests/data/gpt_oss_20b_bf16_config.json --arms reap
  family deepseek_v2_lite "$CAP_OTHER" --config tests/data/deepseek_v2_lite_config.json --arms reap
  family mixtral_8x7b_d16 "$CAP_OTHER" --config tests/data/mixtral_8x7b_config.json --layers 16 --arms reap
}

session() {
  local lanes=${1:-1}
  mkdir -p $S/out
  $PY -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" > $S/versions.txt 2>&1
  nvidia-smi --query-gpu=name,memory.total --format=csv >> $S/versions.txt 2>&1
  grep -E "MemTotal|MemAvailable" /proc/meminfo >> $S/versions.txt
  if [ "$lanes" = 2 ]; then
    (export CUDA_VISIBLE_DEVICES=0; lane_a) > $S/laneA.log 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1; lane_b) > $S/laneB.log 2>&1 &
    wait
  else
    export CUDA_VISIBLE_DEVICES=0
    lane_a > $S/laneA.log 2>&1
    lane_b > $S/laneB.log 2>&1
  fi
  touch $S/all.done
  step main "all done"
}

case "${1:-}" in
  start)
    mkdir -p $S
    setsid nohup bash "$0" session "${2:-1}" > $S/main.log 2>&1 < /dev/null &
    sleep 2; step start "background families session started (lanes ${2:-1})"
    ;;
  session) session "${2:-1}" ;;
  lane_a_only) mkdir -p $S/out; lane_a > $S/laneA.log 2>&1; cat $S/laneA.log ;;  # in the foreground
  wait)
    limit=${2:-540}; t0=$(date +%s)
    while [ ! -e $S/all.done ] && [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do sleep 10; done
    for f in main laneA laneB; do [ -e $S/$f.log ] && { echo "== $f"; tail -25 $S/$f.log | cut -c1-300; }; done
    mkdir -p "$OUT"
    tar czf "$OUT/families.tgz" --exclude='*.tmp' -C /tmp fam 2>/dev/null
    ls -la "$OUT"
    ;;
  *) echo "usage: $0 start [1|2] | wait SECONDS"; exit 2 ;;
esac
