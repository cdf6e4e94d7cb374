#!/usr/bin/env bash
# Full-size MoE families on ONE H200 (139 GiB HBM, 128 GiB host) with vLLM's --load-format dummy
# (issue 15, item 3), in at most DEADLINE seconds (default 540) of wall time. Needs the kit
# installed and the project pip-installed into /tmp/site (research.md runbook), PYTHONPATH set,
# and the field plan (FIELD_PLAN, default .kit/strict30-v2-plan.json). No model download.
#
#   bash research/gpu/gpu_families.sh all   --out DIR     # the whole lane in the foreground
#   bash research/gpu/gpu_families.sh start --out DIR     # the same in the background (setsid)
#   bash research/gpu/gpu_families.sh wait SECONDS --out DIR   # progress; then $OUT/families.tgz
#   bash research/gpu/gpu_families.sh schedule            # print the schedule below (no GPU)
#   bash research/gpu/gpu_families.sh gptoss_full --out DIR    # GPT-OSS-20B bf16, all 24 layers (gpu_run.sh gptossfull)
#   bash research/gpu/gpu_families.sh mixtral_full --out DIR   # Mixtral-8x7B, all 32 layers (gpu_run.sh mixfull)
#   bash research/gpu/gpu_families.sh v3_deep --out DIR        # DeepSeek-V3 layer shape, 3 MoE layers, stock then reap (gpu_run.sh v3deep)
#   bash research/gpu/gpu_families.sh kimi_deep --out DIR      # Kimi-K2 layer shape, 1 MoE layer, stock then reap (gpu_run.sh kimideep)
#
# Results: DIR/<family>/{meta,reap,stock,family}.json + server logs, DIR/pin_bench.json,
# DIR/families.md (research/gpu/gpu_summarize.py --families DIR), DIR/<family>-<arm>.log, DIR/lane.log.
#
# Schedule (servers side by side where HBM and host memory allow; each arm its own process;
# estimates from run 8's Qwen3.5 log: dense 4.7 GiB, reap host peak 1.09 x experts + ~7 GiB):
#  t=0     B  qwen35 stock (every expert in HBM, CUDA graphs)              HBM ~70, host ~5
#          and the pin micro-bench (gpu_pin_bench.py, ~30 s): picks the pinned-allocator setting
#          of the reap-swap servers below (register8 only if its UVA check passed and it was faster)
#  then    A  qwen35 reap  (40 x 256, field plan unchanged, CUDA graphs)   HBM ~25, host ~67
#          C  mixtral_8x7b_d2 reap+stock, gpt_oss_20b_d2 reap+stock (eager, side by side)
#                                                       HBM ~15 + ~13, host ~14 + ~11
#             then deepseek_v2_lite reap (full 26 x 64 x 16.5 MiB = 26.8 GiB, eager)
#                                                       HBM ~30, host ~37
#          D  after B: deepseek_v2_lite stock                      HBM ~30, host ~4
#             after C: deepseek_v3_d2 reap (1 dense + 1 MoE layer of 256 x 84 MiB = 21 GiB; eager;
#             the engine holds that layer twice while re-homing it: host ~49; no stock twin)
#  Peaks: HBM ~126 of 140 GiB at t=0 (A+B+C); host ~107 of 126 GiB (A+B+V2-Lite reap), ~118
#  (A + V3 reap + V2-Lite stock if it still runs).
#  KV caches are fixed (--kv-cache-memory-bytes: 2 GiB Qwen3.5, 0.5 GiB the others), so vLLM never
#  sizes one from a neighbour's allocations; --gpu-memory-utilization 0.1 is only its start check.
#  A family whose cap would be under 60 s when its turn comes is skipped and recorded as such.
#  Host guard (MemAvailable): 5 GiB for C and D, 4 for B, 2.5 for A, so the small families are
#  killed first if the estimates above are wrong.
# What each arm proves: research.md "Families lane on one H200".
set -u
PY=${PY:-python3}
DEADLINE=${DEADLINE:-540}
FIELD_PLAN=${FIELD_PLAN:-.kit/strict30-v2-plan.json}
S=/tmp/fam
PINNED=""
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  [ "${args[$i]}" = "--out" ] && S=${args[$((i + 1))]}
done
T0=$(date +%s)
stamp() { date +%H:%M:%S; }
step() { echo "$(stamp) +$(( $(date +%s) - T0 ))s [$1] $2"; }
left() { echo $(( DEADLINE - ($(date +%s) - T0) - 30 )); }  # 20 s kill-after + merge
min() { [ "$1" -lt "$2" ] && echo "$1" || echo "$2"; }

arm() {  # NAME ARM CAP ARGS... : one arm of one family in its own process, capped
  local name=$1 which=$2 cap=$3; shift 3
  if [ "$cap" -lt 60 ]; then
    step "$name/$which" "skipped: ${cap}s left of the ${DEADLINE}s lane"
    mkdir -p "$S/$name"; echo "{\"skipped\": \"${cap}s left of the ${DEADLINE}s lane\"}" > "$S/$name/$which.skipped.json"
    return
  fi
  step "$name/$which" "start (cap ${cap}s)"
  timeout --kill-after=20 "$cap" $PY research/gpu/gpu_families.py --name "$name" --out "$S" --arms "$which" \
    --pinned-conf "$PINNED" "$@" > "$S/$name-$which.log" 2>&1
  step "$name/$which" "exit $?"
  grep -E "healthy after|counters|README curl|FAILED|guard|Traceback" "$S/$name-$which.log" | cut -c1-240 | tail -6
}

prep() {  # NAME ARGS... : model folder, plan, meta.json once, before two arms read them
  local name=$1; shift
  $PY research/gpu/gpu_families.py --name "$name" --out "$S" --arms prepare "$@" > "$S/$name-prepare.log" 2>&1
}

pair() {  # NAME CAP ARGS... : reap and stock side by side, then family.json
  local name=$1 cap=$2; shift 2
  prep "$name" "$@"
  arm "$name" reap "$cap" "$@" &
  arm "$name" stock "$cap" "$@" &
  wait
  $PY research/gpu/gpu_families.py --name "$name" --out "$S" --arms merge > /dev/null 2>&1
}

qwen_args() {
  local plan=$FIELD_PLAN
  [ -f "$plan" ] || plan=../shared/fixtures/strict30-v2-plan.json
  [ -f "$plan" ] || return 1
  echo --config tests/data/qwen3_5_moe_35b_a3b_config.json --plan "$plan" --kv-gib 2 --gpu-util 0.1
}

qwen_stock() {  # needs no pinned memory: starts before the micro-bench
  local q; q=$(qwen_args) || { step qwen35 "no field plan (set FIELD_PLAN)"; touch "$S/qwen_stock.done"; return; }
  prep qwen35 $q
  arm qwen35 stock "${QWEN_CAP:-330}" $q --host-guard-gib 4
  touch "$S/qwen_stock.done"
}

qwen_reap_arm() {  # CAP QWEN_ARGS...: the reap arm with its host guard and QWEN_REAP_EXTRA (both schedules)
  local cap=$1; shift
  arm qwen35 reap "$cap" "$@" --host-guard-gib 2.5 ${QWEN_REAP_EXTRA:+--reap-extra "$QWEN_REAP_EXTRA"}
}

qwen_reap() {  # the critical path: every step is saved as it ends, so a cut run keeps the first ones
  local q; q=$(qwen_args) || return
  while [ ! -e "$S/qwen35/meta.json" ] && [ "$(left)" -ge 60 ]; do sleep 1; done
  qwen_reap_arm "$(left)" $q
  while [ ! -e "$S/qwen_stock.done" ] && [ "$(left)" -ge 0 ]; do sleep 2; done
  $PY research/gpu/gpu_families.py --name qwen35 --out "$S" --arms merge > /dev/null 2>&1
}

hbm_gib() {  # the first GPU's memory in GiB (0 when nvidia-smi is missing or prints no number)
  local mib; mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
  [[ $mib =~ ^[0-9]+$ ]] || mib=0
  echo $(( mib / 1024 ))
}

SIDE_BY_SIDE_GIB=${SIDE_BY_SIDE_GIB:-120}  # HBM below which the qwen lane runs its arms one after the other
side_by_side() { [ "$(hbm_gib)" -ge "$SIDE_BY_SIDE_GIB" ]; }

qwen_one_after_the_other() {  # a card under SIDE_BY_SIDE_GIB (an H100's 80 GB): stock holds every
  # expert in HBM (65 GiB on run 26's H100), so reap-swap's pool (the plan's budget) did not fit beside
  # it and the reap arm's load was refused. Here the reap arm runs first (the critical one), stock after;
  # 3/5 of the lane to reap (on the H200, side by side, reap took ~500 s and stock ~330 s).
  local q; q=$(qwen_args) || { step qwen35 "no field plan (set FIELD_PLAN)"; return; }
  step qwen35 "$(hbm_gib) GiB card: reap first, then stock (side by side needs $SIDE_BY_SIDE_GIB)"
  prep qwen35 $q
  qwen_reap_arm "$(( $(left) * 3 / 5 ))" $q
  arm qwen35 stock "$(left)" $q --host-guard-gib 4
  $PY research/gpu/gpu_families.py --name qwen35 --out "$S" --arms merge > /dev/null 2>&1
}

V2=(--config tests/data/deepseek_v2_lite_config.json --eager --kv-gib 0.5 --host-guard-gib 5)

chain_c() {
  pair mixtral_8x7b_d2 "$(min 220 "$(left)")" --config tests/data/mixtral_8x7b_config.json --layers 2 --eager --kv-gib 0.5 --host-guard-gib 5 &
  pair gpt_oss_20b_d2 "$(min 220 "$(left)")" --config tests/data/gpt_oss_20b_bf16_config.json --layers 2 --eager --kv-gib 0.5 --host-guard-gib 5 &
  wait
  prep deepseek_v2_lite "${V2[@]}"
  touch "$S/v2_prepared"
  arm deepseek_v2_lite reap "$(min 260 "$(left)")" "${V2[@]}"
  touch "$S/v2_reap.done"
}

chain_d() {  # HBM: the stock V2-Lite only after the stock Qwen3.5; host: V3's 21 GiB layer only
  # after the V2-Lite reap server (the engine holds a layer twice while re-homing it)
  while { [ ! -e "$S/qwen_stock.done" ] || [ ! -e "$S/v2_prepared" ]; } && [ "$(left)" -ge 60 ]; do sleep 3; done
  arm deepseek_v2_lite stock "$(min 200 "$(left)")" "${V2[@]}"
  while [ ! -e "$S/v2_reap.done" ] && [ "$(left)" -ge 60 ]; do sleep 3; done
  $PY research/gpu/gpu_families.py --name deepseek_v2_lite --out "$S" --arms merge > /dev/null 2>&1
  arm deepseek_v3_d2 reap "$(min 200 "$(left)")" --config tests/data/deepseek_v3_bf16_depth2_config.json --eager --kv-gib 0.5 --host-guard-gib 5
  $PY research/gpu/gpu_families.py --name deepseek_v3_d2 --out "$S" --arms merge > /dev/null 2>&1
}

# Full depth (branch fulldepth; sizes from research/gpu/fulldepth_budget.py, research.md "fulldepth").
# GPT-OSS-20B: 24 x 32 x 47.5 MiB = 35.6 GiB of experts; reap (HBM ~41, host ~42) and stock (HBM ~41,
# host ~4) side by side. Mixtral-8x7B: 32 x 8 x 336 MiB = 84 GiB; reap (HBM ~89 with the 100 % pool,
# host ~93) and stock (HBM ~89) do not fit one H200 together: stock first, then reap once the HBM
# is free again. Mixtral's 0 % points read ~21 GiB per decoded token over PCIe (~0.7 s), hence
# fewer prompts and decode tokens there (MIX_PROMPTS, MIX_DECODE). MIX_LAYERS: a shallower depth.
hbm_free_wait() {  # GIB SECONDS: until nvidia-smi reports GIB free (no nvidia-smi: return at once)
  command -v nvidia-smi > /dev/null || return 0
  local free
  for _ in $(seq "$(( $2 / 2 ))"); do
    free=$(nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits | head -1)
    [ "${free:-0}" -ge $(( $1 * 1024 )) ] && { step hbm "${free} MiB free"; return 0; }
    sleep 2
  done
  step hbm "only ${free:-?} MiB free after $2 s (wanted $1 GiB)"
}

# GPTOSS_REPEATS: timed decode runs per point (default 1); GPTOSS_ARGS: more gpu_families.py flags
# (plan, depth); GPTOSS_REAP_EXTRA: more reap-server flags (e.g. "--reap-cache-device on").
# GPTOSS_SERIAL=1: stock alone, then reap
# alone (as Mixtral), so neither arm's decode is timed beside the other's start-up (run 13's eager
# 34.1 vs 24.2 tok/s pair was one run each, stock beside reap's load: research.md "eager decode gap").
gptoss_full() {
  local g=(--config tests/data/gpt_oss_20b_bf16_config.json --kv-gib 0.5 --host-guard-gib 5
           --prompts "${GPTOSS_PROMPTS:-8}" --decode-tokens "${GPTOSS_DECODE:-64}"
           --decode-repeats "${GPTOSS_REPEATS:-1}")
  [ "${GPTOSS_GRAPHS:-0}" = 1 ] || g+=(--eager)
  g+=(${GPTOSS_ARGS:-})  # more gpu_families.py flags for prep and both arms, e.g. "--plan-core 0.25 --plan-budget 0.5"
  # GPTOSS_REAP_EXTRA: more reap-server flags (the stock arm ignores them), e.g. the device cache
  [ -n "${GPTOSS_REAP_EXTRA:-}" ] && g+=(--reap-extra "$GPTOSS_REAP_EXTRA")
  if [ "${GPTOSS_SERIAL:-0}" = 1 ]; then
    prep gpt_oss_20b "${g[@]}"
    arm gpt_oss_20b stock "$(min "${GPTOSS_STOCK_CAP:-200}" "$(left)")" "${g[@]}"
    arm gpt_oss_20b reap "$(left)" "${g[@]}"
    $PY research/gpu/gpu_families.py --name gpt_oss_20b --out "$S" --arms merge > /dev/null 2>&1
  else
    pair gpt_oss_20b "$(left)" "${g[@]}"
  fi
}

mixtral_full() {
  local layers=${MIX_LAYERS:-32} name=mixtral_8x7b
  [ "$layers" = 32 ] || name=mixtral_8x7b_d$layers
  local m=(--config tests/data/mixtral_8x7b_config.json --layers "$layers" --kv-gib 0.5 --host-guard-gib 5
           --prompts "${MIX_PROMPTS:-4}" --decode-tokens "${MIX_DECODE:-16}")
  [ "${MIX_GRAPHS:-0}" = 1 ] || m+=(--eager)
  prep "$name" "${m[@]}"
  arm "$name" stock "$(min "${MIX_STOCK_CAP:-240}" "$(left)")" "${m[@]}"
  hbm_free_wait "${MIX_REAP_HBM_GIB:-95}" 90
  arm "$name" reap "$(left)" "${m[@]}"
  $PY research/gpu/gpu_families.py --name "$name" --out "$S" --arms merge > /dev/null 2>&1
}

# The DeepSeek-V3 / Kimi-K2 layer shape at the depth that fits the H200 machine's host (issue 15 item 3),
# stock first, alone (every expert in HBM), then reap alone once the HBM is free, as mixtral_full.
# Host, reap: vLLM's UVA offload pins each layer's w13 and w2 with pin_memory(), which PyTorch rounds up
# to a power of two (torch 2.11 on the H200: research-notes/pinned-round; torch 2.11 has no
# pinned_max_round_threshold_mb: PYTORCH_CUDA_ALLOC_CONF with it fails at CUDA init), and the engine
# copies the layer it re-homes: all rounded layers + one layer + ~3.5 GiB (research/gpu/fulldepth_budget.py
# pinned_host_gib; run 13's Mixtral 102 GiB in use). The launcher refuses before loading when that
# (+ 6 GiB) exceeds MemAvailable (~124.5 GiB there), and the arm's 5 GiB host guard stops what comes closer
# than 5 GiB to the host's 125.9 GiB, so:
#   v3_deep   deepseek_v3_bf16_depth5_config.json at V3DEEP_LAYERS=6: 3 dense + 3 MoE layers of 256 x 84 MiB
#             = 63 GiB of experts, pinned as 3 x (16 + 8) = 72 GiB, host ~97 GiB; stock HBM ~72 (7 layers,
#             4 MoE layers, would pass the launcher at 123 GiB but peak ~121 GiB: inside the guard's margin)
#   kimi_deep kimi_k2_bf16_depth3_config.json at KIMI_LAYERS=2: 1 dense + 1 MoE layer of 384 x 84 MiB =
#             31.5 GiB, pinned as 32 + 16 = 48 GiB, host ~83 GiB (depth 3 pins 96 GiB for 63: the
#             launcher refuses it on this host)
# Since run 18 the launcher's default (REAP_SWAP_EXACT_PINNING auto) turns exact pinning on for both shapes
# (v3_deep measured 67.9 GiB in use with it); REAP_SWAP_EXACT_PINNING=0 in the environment gives run 16's path.
# Knobs (PREFIX = V3DEEP or KIMI): PREFIX_EXACT=1 (the reap arm with REAP_SWAP_EXACT_PINNING=1: vLLM's copies
# registered at their exact size, whatever auto decides; the family is named ..._exact), PREFIX_STOCK_CAP (240 s), PREFIX_GRAPHS=1 (CUDA graphs; default eager),
# PREFIX_PROMPTS (4), PREFIX_DECODE (32), PREFIX_REPEATS (1), PREFIX_REAP_HBM_GIB (75: nvidia-smi free
# before reap starts, <= 90 s wait).
_deep_knob() {  # PREFIX NAME DEFAULT: ${PREFIX_NAME:-DEFAULT}
  local n="${1}_$2"; echo "${!n:-$3}"
}
deep_pair() {  # NAME CONFIG PREFIX LAYERS
  local name=$1 config=$2 p=$3 layers=$4
  local k=(--config "$config" --layers "$layers" --kv-gib 0.5 --host-guard-gib 5
           --prompts "$(_deep_knob "$p" PROMPTS 4)" --decode-tokens "$(_deep_knob "$p" DECODE 32)"
           --decode-repeats "$(_deep_knob "$p" REPEATS 1)")
  [ "$(_deep_knob "$p" GRAPHS 0)" = 1 ] || k+=(--eager)
  prep "$name" "${k[@]}"
  arm "$name" stock "$(min "$(_deep_knob "$p" STOCK_CAP 240)" "$(left)")" "${k[@]}"
  hbm_free_wait "$(_deep_knob "$p" REAP_HBM_GIB 75)" 90  # whole GiB
  if [ "$(_deep_knob "$p" EXACT 0)" = 1 ]; then  # the reap server with --reap-exact-pinning (compat/pinning.py)
    REAP_SWAP_EXACT_PINNING=1 arm "$name" reap "$(left)" "${k[@]}"
  else
    arm "$name" reap "$(left)" "${k[@]}"
  fi
  $PY research/gpu/gpu_families.py --name "$name" --out "$S" --arms merge > /dev/null 2>&1
}
kimi_deep() {
  local layers=${KIMI_LAYERS:-2}
  local name="kimi_k2_d$layers"; [ "${KIMI_EXACT:-0}" = 1 ] && name+=_exact
  deep_pair "$name" tests/data/kimi_k2_bf16_depth3_config.json KIMI "$layers"
}
v3_deep() {
  local layers=${V3DEEP_LAYERS:-6}
  local name="deepseek_v3_d$layers"; [ "${V3DEEP_EXACT:-0}" = 1 ] && name+=_exact
  deep_pair "$name" tests/data/deepseek_v3_bf16_depth5_config.json V3DEEP "$layers"
}

lane() {
  mkdir -p "$S"
  rm -f "$S/qwen_stock.done" "$S/v2_prepared" "$S/v2_reap.done" "$S/all.done"
  {
    $PY -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" 2>&1
    nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv 2>&1
    grep -E "MemTotal|MemAvailable" /proc/meminfo
    git rev-parse HEAD 2>/dev/null
  } > "$S/versions.txt"
  qwen_stock &
  step pin "micro-bench"
  timeout 75 $PY research/gpu/gpu_pin_bench.py --out "$S" --gib 2 --timeout 35 > "$S/pin_bench.log" 2>&1
  PINNED=$($PY -c "import json; print(json.load(open('$S/pin_bench.json')).get('chosen_conf') or '')" 2>/dev/null)
  step pin "reap-swap servers use PYTORCH_CUDA_ALLOC_CONF='${PINNED}'"
  export PINNED
  qwen_reap &
  chain_c &
  chain_d &
  wait
  $PY research/gpu/gpu_summarize.py --families "$S" > "$S/families.md" 2> "$S/summarize.err"
  touch "$S/all.done"
  step main "all done (families.md)"
}

case "${1:-}" in
  all) mkdir -p "$S"; lane 2>&1 | tee "$S/lane.log" ;;
  session) lane ;;
  lane_a_only)  # gpu_followups.sh (run 8's lease): only Qwen3.5, side by side, in the foreground
    mkdir -p "$S"; rm -f "$S/qwen_stock.done"
    if side_by_side; then qwen_stock & qwen_reap; wait
    else qwen_one_after_the_other; fi ;;
  side_by_side) side_by_side ;;  # exit 0 where lane_a_only serves both arms at once (gpu_run.sh's cap)
  v2lite_only)  # gpu_run.sh's v2lite phase: full-size DeepSeek-V2-Lite alone, reap and stock side by side
    mkdir -p "$S"; pair deepseek_v2_lite "$(left)" "${V2[@]}" ;;
  v3_only)  # gpu_run.sh's v3layer phase: the DeepSeek-V3 / Kimi-K2 layer shape, reap and stock side by side
    # (run 13 ran reap alone: "no stock arm"; stock holds its 21 GiB of experts in HBM, ~47 + ~25 GiB fit)
    mkdir -p "$S"; pair deepseek_v3_d2 "$(left)" --config tests/data/deepseek_v3_bf16_depth2_config.json --eager --kv-gib 0.5 --host-guard-gib 5 ;;
  gptoss_full) mkdir -p "$S"; gptoss_full ;;
  mixtral_full) mkdir -p "$S"; mixtral_full ;;
  kimi_deep) mkdir -p "$S"; kimi_deep ;;  # gpu_run.sh's kimideep phase
  v3_deep) mkdir -p "$S"; v3_deep ;;  # gpu_run.sh's v3deep phase
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
  *) echo "usage: $0 all|start|lane_a_only|side_by_side|v2lite_only|v3_only|gptoss_full|mixtral_full|kimi_deep|v3_deep --out DIR | wait SECONDS --out DIR | schedule"; exit 2 ;;
esac
