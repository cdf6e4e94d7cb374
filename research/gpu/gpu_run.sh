#!/usr/bin/env bash
# A GPU run on ONE H200 (issues 15, 16, 17), in the background so it outlives a 10-minute device call:
#   PHASES="budget cache+quant" bash research/gpu/gpu_run.sh start   # after the kit is installed, /tmp/model exists
#   bash research/gpu/gpu_run.sh wait 560                             # progress, then $OUT/run.tgz
# PHASES is a space-separated sequence; "a+b" runs a and b side by side (only for phases whose
# servers fit together: fixed KV bytes, small --gpu-memory-utilization); between groups every
# leftover server is killed and the HBM must be free again (run 9b's lesson). Phases:
#   dcache    the device cache's policy-step timing (research/gpu/bench_device_cache.py), alone
#   tests     pytest tests/gpu (TESTS_K: a -k filter; TESTS_CAP s, 420: the whole suite wants ~540)
#   budget    --reap-budget auto at two --gpu-memory-utilization values (gpu_budget_auto.py: alone)
#   cache     the device cache in the server for a plain client (gpu_e2e.py reap-cache vs reap-plan25;
#             CACHE_ARMS, CACHE_CAP, CACHE_EXTRA e.g. "--cache-shadow out"; CACHE_STOCK=auto (run 8's H200 stock
#             text on an H200, else a stock-gpu serve first: run 24's H100 did not reproduce H200 bits) | run8 | serve)
#   quant     quantized formats end to end (gpu_quant_e2e.py, QUANT_CASES; QUANT_EXTRA: more of its
#             flags, e.g. "--decode-tokens 64 --serial-arms --case-timeout 600" with QUANT_JOBS=1 and a
#             QUANT_CAP of at least cases x case-timeout + ~60 s: serial cases add up)
#   quant2    a second quant configuration after the first (QUANT2_CASES, QUANT2_EXTRA, QUANT2_JOBS, QUANT2_CAP;
#             results in $R/quant2): e.g. online FP8 without groups, then INT4 with --reap-group-size auto
#   qwen      full-size Qwen3.5-35B-A3B, field plan, reap-swap and stock side by side (QWEN_CAP s each;
#             QWEN_REAP_EXTRA: more reap-server flags, e.g. "--reap-cache lfu --reap-cache-device on");
#             on a card under 120 GiB (H100) one after the other, reap first, QWEN_CAP 900 by default there
#   families  the whole families lane (gpu_families.sh, FAM_DEADLINE)
#   v2lite    full-size DeepSeek-V2-Lite, reap-swap and stock side by side, eager
#   v3layer   the DeepSeek-V3 / Kimi-K2 layer shape at depth 2, reap-swap and stock side by side, eager (HBM ~73 GiB)
#   fp8bench  issue 16's FP8 bench (research/gpu/gpu_fp8_bench.sh run, ~8 min, FP8_CAP)
#   count     exact router counts on full-size Qwen3.5 (gpu_families.py --arms count, ~8 min)
#   mlacount  exact router counts on full-size DeepSeek-V2-Lite (all attention MLA) under CUDA graphs
#             (--arms count WITHOUT --eager: padded piecewise prefills, padded concurrent decodes; ~6 min)
#   gptossfull GPT-OSS-20B bf16 at full depth (24 x 32 experts, biases), reap-swap and stock side by side,
#             eager, 0/25/50/100 %/0 vs stock (gpu_families.sh gptoss_full; ~6 min, GPTOSS_CAP=420 s;
#             HBM ~83 GiB, host ~46 GiB: may run beside mlacount, not beside v3layer (now with its stock arm), mixfull or v2lite)
#   mixfull   Mixtral-8x7B at full depth (32 x 8 x 336 MiB = 84 GiB): stock, THEN reap-swap (both need
#             ~89 GiB HBM; reap's host ~93 GiB), eager, 4 prompts (gpu_families.sh mixtral_full;
#             ~12 min, MIX_CAP=780 s; MIX_LAYERS for a shallower depth): alone
#   v3deep    the DeepSeek-V3 layer shape at the depth that fits the host (V3DEEP_LAYERS=6: 3 dense + 3 MoE layers of
#             256 x 84 MiB = 63 GiB): stock, THEN reap-swap, eager, 0/25/50/100 %/0 vs stock, 4 prompts
#             (gpu_families.sh v3_deep; V3DEEP_CAP=660 s; V3DEEP_STOCK_CAP, _PROMPTS, _DECODE, _REPEATS, _GRAPHS):
#             alone. HBM ~72 GiB each; host: reap ~97 GiB (vLLM's pinned w13/w2 rounded up to powers of two
#             by PyTorch: 72 GiB for 63, + the 21 GiB layer being re-homed)
#   kimideep  the Kimi-K2 layer shape (KIMI_LAYERS=2: 1 dense + 1 MoE layer of 384 x 84 MiB = 31.5 GiB), as v3deep
#             (gpu_families.sh kimi_deep; KIMI_CAP=600 s): alone; host ~83 GiB. Depth 3 pins 96 GiB for 63 and
#             the launcher refuses it on the H200 machine's host (torch 2.11 cannot switch the rounding off)
#   hybridauto --reap-budget auto on full-size Qwen3.5 (hybrid attention), HYB_ARMS=auto@0.5,auto@0.85
#             one server after the other (gpu_budget_auto.py --config; ~16 min, HYB_CAP=1200 s): alone
#   extra     bash research/gpu/gpu_extra_phase.sh $R/extra (a phase a branch ships for this run)
#   skewbench issue 17's skew bench, alone (research/gpu/gpu_skew_bench.py, ~10-11 min, SKEW_CAP=780 s hard):
#             the vLLM-routed trace, plan-cache / plan-swap / plan-static / stock UVA / resident at
#             50 % then 25 %, then resident2 (a second stock resident: stock's own text spread); nothing
#             measures while another group starts (SKEW_EXTRA="--no-25" for 50 % only, "--inductor-
#             deterministic" for TORCHINDUCTOR_DETERMINISTIC=1 in every arm); $R/skewbench/skew_bench.md
#   int4      issue 16's INT4 groups (int4perm: identity order, the default): tests/gpu/test_int4_groups.py (INT4_KERNEL=0: skipped), then gpu_quant_e2e.py
#             --cases awq,gptq,ct-w4a16 --reap-group-size auto (~8 min, small models: fits beside cache)
#   qcache    the device cache on quantized checkpoints (slot rows for per-expert scales): per format of
#             QCACHE_FORMATS (fp8-block fp8-tensor), a 2-layer Qwen3-30B-A3B-shaped checkpoint
#             (make_quant_checkpoint.py), then gpu_e2e.py --arms QCACHE_ARMS (stock-gpu,reap-cache,reap-cache-seeded)
#             --moe-probe --no-prefix-caching: greedy text and MoE digests against stock, cache status; QCACHE_CAP s
#             per format (420); QCACHE_FORMATS may name fp8-online (the bf16 checkpoint, --quantization fp8
#             in every arm); QCACHE_EXTRA: more gpu_e2e.py flags, e.g. "--cache-shadow out" (every cached
#             MoE step beside the uncached one, in the server: run 29's open question)
#   swapguard only the swap half of guards (gpu_swap_guard.py, no server, ~1-2 min): alone
#   vmmprobe  where a swap's driver time goes (gpu_vmm_probe.py: unmap/map/access per unit, one unmap over
#             a run, remaps from threads, copies with remaps running; no server, < 1 min): alone
#   guards    issue 17's guards, alone (<= 10.5 min, ~9): research/gpu/gpu_swap_guard.py (1 GiB swap >= 50 GB/s,
#             publish_every 0 vs 8 vs -1 (idle) vs -2 (ahead), ~1-2 min) then research/gpu/gpu_guards.py (stock vs reap-swap all
#             resident vs + the device cache ENGAGED on an 8-slot tail per layer beyond every expert,
#             GUARD_SERVES x GUARD_ROUNDS x GUARD_TOKENS (2 x 12 x 512), single stream, GUARD_CAP s;
#             ~150-200 s a serve: the issue's >= 5 serves want GUARD_SERVES=5 GUARD_CAP=1000)
# Knobs (old defaults): BUDGET_CAP (330 s), BUDGET_ARMS, RUN_DIR (/tmp/run), PY (python3).
# DRY=1 (no GPU needed; what tests/test_gpu_run_phases.py runs): every python call goes through
# research/gpu/dry_py.sh (gpu_families.py arms become `prepare`, gpu_budget_auto.py gets --dry-run, the
# rest is only logged to $RUN_DIR/dry.log) and no leftover server is looked for or killed.
#   DRY=1 RUN_DIR=/tmp/dry PHASES="gptossfull mixfull v2lite+v3layer mlacount hybridauto budget" bash research/gpu/gpu_run.sh session
#   DRY=1 RUN_DIR=/tmp/dry PHASES="v3deep kimideep" bash research/gpu/gpu_run.sh session
# Everything lands in /tmp/run; the tarball leaves out checkpoints and safetensors.
set -u
R=${RUN_DIR:-/tmp/run}
PY=${PY:-python3}
if [ "${DRY:-0}" = 1 ]; then PY="bash research/gpu/dry_py.sh"; export DRY_LOG=$R/dry.log; fi
export PY
export PYTHONPATH=$PWD:/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1  # the synced tree first
stamp() { date +%H:%M:%S; }
step() { echo "$(stamp) [$1] $2"; }
leftovers() {  # stop any server a timed-out phase left behind, then wait until its HBM is free (run 9b)
  [ "${DRY:-0}" = 1 ] && { step run "dry run: no leftover check"; return; }
  pkill -TERM -f "vllm.entrypoints.openai.api_server|reap_swap.server|EngineCore" 2>/dev/null; sleep 5
  pkill -KILL -f "vllm.entrypoints.openai.api_server|reap_swap.server|EngineCore" 2>/dev/null
  for _ in $(seq 30); do
    used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
    [ "${used:-0}" -lt 2048 ] && break; sleep 2
  done
  step run "GPU memory in use before the next phase: ${used:-?} MiB"
}

ph_dcache() { timeout 240 $PY research/gpu/bench_device_cache.py --log-dir $R/dcache > $R/dcache.log 2>&1; }
ph_tests() {
  timeout ${TESTS_CAP:-420} $PY -m pytest -q -rsx tests/gpu -p no:cacheprovider ${TESTS_K:+-k "$TESTS_K"} > $R/tests.log 2>&1
}
ph_budget() {
  $PY -c "import sys; sys.path.insert(0, 'research/gpu'); from pathlib import Path; import gpu_e2e; \
gpu_e2e.make_plan(Path('/tmp/model'), 0.25, 8, Path('$R/budget.plan.json'), budget_fraction=0.25)"
  timeout ${BUDGET_CAP:-330} $PY research/gpu/gpu_budget_auto.py --model /tmp/model --plan $R/budget.plan.json --out $R/budget \
    --arms ${BUDGET_ARMS:-auto@0.08,auto@0.14,cap@0.14,refused} > $R/budget.log 2>&1
}
ph_cache() {
  mkdir -p $R/cache
  local arms=${CACHE_ARMS:-reap-cache,reap-plan25} card
  card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  if [ "${CACHE_STOCK:-auto}" = run8 ] || { [ "${CACHE_STOCK:-auto}" = auto ] && [[ $card == *H200* ]]; }; then
    # stock-gpu's greedy text from run 8 (same kit, same seeded mk_model, same flags), recorded on an H200
    $PY -c "import json; d=json.load(open('research-notes/h200-2026-12-01/run8-gpu_e2e.json')); \
json.dump({'stock-gpu': d['stock-gpu']}, open('$R/cache/gpu_e2e.json', 'w'))"
  else  # another card picks other fused-MoE tile configs, so other bits (run 24, H100): serve stock here first
    case ",$arms," in *,stock-gpu,*) ;; *) arms=stock-gpu,$arms ;; esac
  fi
  echo "cache: card ${card:-?}, arms $arms" > $R/cache.log
  timeout ${CACHE_CAP:-330} $PY research/gpu/gpu_e2e.py --model /tmp/model --out $R/cache --moe-probe \
    --arms $arms ${CACHE_EXTRA:-} >> $R/cache.log 2>&1
}
quant_phase() {  # NAME KNOB_PREFIX DEFAULT_JOBS DEFAULT_CASES: gpu_quant_e2e.py into $R/NAME, knobs PREFIX_*
  local cap=${2}_CAP jobs=${2}_JOBS cases=${2}_CASES extra=${2}_EXTRA
  timeout ${!cap:-420} $PY research/gpu/gpu_quant_e2e.py --out $R/$1 --jobs ${!jobs:-$3} \
    --cases ${!cases:-$4} ${!extra:-} > $R/$1.log 2>&1
}
ph_quant() { quant_phase quant QUANT 3 fp8-block,fp8-tensor,ct-fp8,fp8-online; }
ph_quant2() { quant_phase quant2 QUANT2 1 awq,gptq,ct-w4a16; }
ph_qwen() {  # side by side on an H200 (560 s); one arm after the other under 120 GiB (H100): 900 s
  local cap=900
  bash research/gpu/gpu_families.sh side_by_side && cap=560
  cap=${QWEN_CAP:-$cap}
  QWEN_CAP=$cap FIELD_PLAN=.kit/strict30-v2-plan.json DEADLINE=$cap \
    bash research/gpu/gpu_families.sh lane_a_only --out $R/fam > $R/qwen.log 2>&1
}
ph_families() {
  FIELD_PLAN=.kit/strict30-v2-plan.json DEADLINE=${FAM_DEADLINE:-600} \
    bash research/gpu/gpu_families.sh all --out $R/fam > $R/families.log 2>&1
}
ph_v2lite() { DEADLINE=${V2_CAP:-330} bash research/gpu/gpu_families.sh v2lite_only --out $R/fam > $R/v2lite.log 2>&1; }
ph_v3layer() { DEADLINE=${V3_CAP:-300} bash research/gpu/gpu_families.sh v3_only --out $R/fam > $R/v3layer.log 2>&1; }
ph_fp8bench() { timeout ${FP8_CAP:-600} bash research/gpu/gpu_fp8_bench.sh run --out $R/fp8bench > $R/fp8bench.log 2>&1; }
ph_count() {  # qcount: exact router counts on full-size Qwen3.5 under CUDA graphs (no residency phases)
  timeout ${COUNT_CAP:-580} $PY research/gpu/gpu_families.py --name qwen35 --config tests/data/qwen3_5_moe_35b_a3b_config.json \
    --plan .kit/strict30-v2-plan.json --kv-gib 2 --gpu-util 0.1 --host-guard-gib 2.5 --arms count \
    --startup-timeout $(( ${COUNT_CAP:-580} - 80 )) --out $R/count > $R/count.log 2>&1
}
ph_mlacount() {  # mlapad: the MLA-only padding case (research.md, mlapad); count_cases in count.json
  timeout ${MLACOUNT_CAP:-560} $PY research/gpu/gpu_families.py --name deepseek_v2_lite_graphs \
    --config tests/data/deepseek_v2_lite_config.json --kv-gib 0.5 --gpu-util 0.1 --host-guard-gib 5 \
    --arms count --startup-timeout $(( ${MLACOUNT_CAP:-560} - 80 )) --out $R/mlacount > $R/mlacount.log 2>&1
}
ph_skewbench() {  # the driver SIGTERMs its benches 60 s before the outer cap and writes the summary
  timeout --kill-after=30 ${SKEW_CAP:-780} $PY research/gpu/gpu_skew_bench.py --out $R/skewbench \
    --deadline $(( ${SKEW_CAP:-780} - 60 )) ${SKEW_EXTRA:-} > $R/skewbench.log 2>&1
}
ph_gptossfull() { DEADLINE=${GPTOSS_CAP:-420} bash research/gpu/gpu_families.sh gptoss_full --out $R/fam > $R/gptossfull.log 2>&1; }
ph_kimideep() { DEADLINE=${KIMI_CAP:-600} bash research/gpu/gpu_families.sh kimi_deep --out $R/fam > $R/kimideep.log 2>&1; }
ph_v3deep() { DEADLINE=${V3DEEP_CAP:-660} bash research/gpu/gpu_families.sh v3_deep --out $R/fam > $R/v3deep.log 2>&1; }
ph_mixfull() { DEADLINE=${MIX_CAP:-780} bash research/gpu/gpu_families.sh mixtral_full --out $R/fam > $R/mixfull.log 2>&1; }
ph_hybridauto() {  # hybridkv: the KV target from vLLM's own hybrid grouping; one server at a time
  timeout --kill-after=30 ${HYB_CAP:-1200} $PY research/gpu/gpu_budget_auto.py \
    --config tests/data/qwen3_5_moe_35b_a3b_config.json --plan ${HYB_PLAN:-.kit/strict30-v2-plan.json} \
    --out $R/hybridauto --arms ${HYB_ARMS:-auto@0.5,auto@0.85} --startup-s ${HYB_STARTUP:-540} \
    --extra "--max-model-len 4096 --max-num-seqs 8 ${HYB_EXTRA:-}" > $R/hybridauto.log 2>&1
}
swap_guard() {  # the swap A/B, log $1; SWAPGUARD_EXTRA e.g. "--repeats 9" (then SWAPGUARD_CAP ~220)
  timeout ${SWAPGUARD_CAP:-150} $PY research/gpu/gpu_swap_guard.py --out $R/guards ${SWAPGUARD_EXTRA:-} > "$1" 2>&1
}
ph_guards() {  # swap A/B first (no server), then the decode guard's servers side by side
  swap_guard $R/guards.log
  timeout --kill-after=30 ${GUARD_CAP:-480} $PY research/gpu/gpu_guards.py --model /tmp/model --out $R/guards \
    --serves ${GUARD_SERVES:-2} --rounds ${GUARD_ROUNDS:-12} --tokens ${GUARD_TOKENS:-512} --deadline $(( ${GUARD_CAP:-480} - 40 )) >> $R/guards.log 2>&1
}
ph_swapguard() { swap_guard $R/swapguard.log; }  # guards' swap half only
ph_vmmprobe() { timeout ${VMMPROBE_CAP:-120} $PY research/gpu/gpu_vmm_probe.py --out $R/vmmprobe > $R/vmmprobe.log 2>&1; }
ph_int4() {  # int4perm: identity-order INT4 groups (the default), kernel test then the server e2e (~8 min)
  # INT4_KERNEL=0 skips the kernel test (run 14 ran it: 161 s) and serves the e2e only
  [ "${INT4_KERNEL:-1}" = 1 ] && \
    timeout 300 $PY -m pytest -q -rs -s -p no:cacheprovider tests/gpu/test_int4_groups.py > $R/int4_kernel.log 2>&1
  timeout ${INT4_CAP:-420} $PY research/gpu/gpu_quant_e2e.py --out $R/int4 --cases ${INT4_CASES:-awq,gptq,ct-w4a16} \
    --reap-group-size auto --jobs 3 --stock-twice all > $R/int4.log 2>&1
}
ph_qcache() {  # the device cache with slot rows for FP8 scales, per format: stock vs the cache arms
  local fmt rc=0
  mkdir -p $R/qcache
  for fmt in ${QCACHE_FORMATS:-fp8-block fp8-tensor}; do
    local ck=$fmt online=()  # fp8-online: the bf16 checkpoint served with vLLM's --quantization fp8 (every arm)
    [ "$fmt" = fp8-online ] && ck=bf16 online=(--quantization fp8)
    step qcache "$fmt: checkpoint" >> $R/qcache.log
    $PY scripts/make_quant_checkpoint.py --out $R/qcache/checkpoints --format $ck --layers 2 \
      --plain-attention 1 > $R/qcache/$fmt.checkpoint.log 2>&1 || { rc=1; continue; }
    step qcache "$fmt: serve" >> $R/qcache.log
    timeout ${QCACHE_CAP:-420} $PY research/gpu/gpu_e2e.py --model $R/qcache/checkpoints/$ck --out $R/qcache/$fmt \
      --moe-probe --no-prefix-caching "${online[@]}" ${QCACHE_EXTRA:-} \
      --arms ${QCACHE_ARMS:-stock-gpu,reap-cache,reap-cache-seeded} >> $R/qcache.log 2>&1 || rc=1
  done
  return $rc
}
ph_extra() { [ -f research/gpu/gpu_extra_phase.sh ] && bash research/gpu/gpu_extra_phase.sh $R/extra > $R/extra.log 2>&1; }

keep_earlier() {  # a phase repeated in one PHASES list ("swapguard tests swapguard", run 25) overwrote the
  # earlier one's log and output folder: move them to NAME.runN first, N unused by any phase (guards and
  # swapguard share guards/). Phases writing into the shared fam/ (the families lane) are not covered.
  local p=$1 n=1 path found=()
  for path in "$R/$p.log" "$R/$p" $(case $p in guards | swapguard) echo "$R/guards" ;; esac); do
    [ -e "$path" ] && [[ " ${found[*]} " != *" $path "* ]] && found+=("$path")
  done
  [ ${#found[@]} -gt 0 ] || return 0
  while compgen -G "$R/*.run$n*" > /dev/null; do n=$((n + 1)); done
  for path in "${found[@]}"; do
    case $path in *.log) mv "$path" "${path%.log}.run$n.log" ;; *) mv "$path" "$path.run$n" ;; esac
  done
  step run "phase $p: the earlier output kept as .run$n (${found[*]##*/})"
}

group() {  # "a+b+c": the phases side by side, then the leftover check
  local pids=() p
  for p in ${1//+/ }; do
    keep_earlier "$p"
    step run "phase $p"
    ( ph_$p; step run "phase $p exit $?"; tail -4 $R/$p.log 2>/dev/null | cut -c1-300 ) &
    pids+=($!)
  done
  wait "${pids[@]}"
  leftovers
}

session() {
  step run "session tree: $PWD"
  {
    $PY -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" 2>&1
    nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv 2>&1
    git rev-parse HEAD 2>/dev/null; echo "PHASES=${PHASES:-}"
  } > $R/versions.txt
  for g in ${PHASES:-tests}; do group "$g"; done
  touch $R/all.done
  step run "all done"
}

pack() {
  tar czf "$OUT/run.tgz.tmp" --exclude='checkpoints' --exclude='*.safetensors' --exclude='*.bin' \
    -C /tmp run 2>/dev/null && mv "$OUT/run.tgz.tmp" "$OUT/run.tgz"
}

missing_inputs() {  # research/gpu/gpu_inputs.txt: a phase's input absent from the tree refuses the start, by name
  local phase path ok=0 g
  while read -r phase path; do
    case "$phase" in ''|'#'*) continue ;; esac
    for g in ${PHASES:-tests}; do
      case "+$g+" in *"+$phase+"*)
        [ -e "$path" ] || { echo "gpu_run.sh: phase $phase reads $path, which this tree lacks" \
          "(research-notes/ moved out for the lease? research/gpu/gpu_lease_tree.sh hold keeps it)" >&2; ok=1; } ;;
      esac
    done
  done < research/gpu/gpu_inputs.txt
  return $ok
}

case "${1:-}" in
  start)  # the session runs from a private copy of the tree: every device call re-syncs the repo root, and
    # run 17's stock arm, started just as the next `wait` call synced it, found no research/gpu/gpu_families.py
    missing_inputs || exit 2
    mkdir -p $R
    T=${RUN_TREE:-/tmp/runtree}
    rm -rf "$T" && mkdir -p "$T"
    tar -c --exclude=./.git --exclude='./.venv*' --exclude='./.kit/[qs]0*' --exclude='./.kit/part-*' . | tar -x -C "$T"
    (cd "$T" && setsid nohup bash research/gpu/gpu_run.sh session > $R/main.log 2>&1 < /dev/null &)
    sleep 2; step start "background run started: PHASES=${PHASES:-tests}"
    ;;
  session) session ;;
  wait)  # packs $OUT/run.tgz every 60 s too, so a call cut short still brings results back
    limit=${2:-530}; t0=$(date +%s); last=0
    mkdir -p "$OUT"
    # A machine lent fresh (the last one went back after its idle release) has no run: waiting would
    # burn the whole limit on nothing (run 21 lost 540 s so). Say so and stop.
    [ -e $R/main.log ] || { echo "no run on this machine ($R/main.log missing): it was lent fresh; ship and start again" >&2; exit 3; }
    while [ ! -e $R/all.done ] && [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do
      sleep 10
      [ $(( $(date +%s) - last )) -ge 60 ] && { pack; last=$(date +%s); }
    done
    cat $R/main.log; free -g | head -2; nvidia-smi --query-gpu=memory.used --format=csv
    pack; ls -la "$OUT"
    ;;
  *) echo "usage: [PHASES=...] $0 start | wait SECONDS"; exit 2 ;;
esac
