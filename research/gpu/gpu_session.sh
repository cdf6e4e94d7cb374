#!/usr/bin/env bash
# One device session's measurements (issues 4, 8, 9) on a 2xH200 machine, run in the background so
# that they outlive one 10-minute device call; see research.md "Re-running the GPU measurements".
#
#   bash research/gpu/gpu_session.sh start [main|followup|tp|tp-reap|single]   # after the kit is installed and /tmp/model exists
#   bash research/gpu/gpu_session.sh wait 540   # wait up to N s, print progress, pack results into $OUT
#
# Two single-GPU lanes run at once (GPU 0 and GPU 1, each its own servers, one at a time per
# lane), then the TP=2 lane uses both GPUs. Everything lands in /tmp/sess.
set -u
S=/tmp/sess
PY=python3
ENGINE=(--dtype bfloat16 --max-model-len 2048 --max-num-seqs 8 --gpu-memory-utilization 0.35 --moe-backend triton)
stamp() { date +%H:%M:%S; }
step() { echo "$(stamp) [$1] $2"; }
gpu_tests() { $PY -m pytest -q tests/gpu -p no:cacheprovider > $S/gpu_tests.log 2>&1; tail -3 $S/gpu_tests.log; }
finish() { touch $S/all.done; step main "all done"; }  # what `wait` waits for

lane0() {  # random model: correctness, mechanism cost, swap speed; then the 25 % bench budget
  export CUDA_VISIBLE_DEVICES=0
  step lane0 "e2e stock-gpu,reap-sweep"
  $PY research/gpu/gpu_e2e.py --model /tmp/model --out $S/e2e0 --arms stock-gpu,reap-sweep
  step lane0 "waiting for the skewed plan"
  while [ ! -e $S/skew.plan.json ] && [ ! -e $S/lane1.failed ]; do sleep 5; done
  if [ -e $S/skew.plan.json ]; then
    step lane0 "bench 25 %"
    $PY -m reap_swap.cli bench --model /tmp/skew --plan $S/skew.plan.json --prompts data/corpus/heldout.jsonl \
      --arms stock-uva,plan-swap --budget-gib 3.375 --batch 8 --no-progress --out $S/bench25 -- "${ENGINE[@]}"
  fi
  step lane0 done
}

lane1() {  # GPU tests; the skewed model: observe, plan, the 50 % bench budget; counters check
  export CUDA_VISIBLE_DEVICES=1
  step lane1 "pytest tests/gpu"
  gpu_tests
  step lane1 "skewed model"
  $PY scripts/make_skewed_moe.py /tmp/model /tmp/skew > $S/skew.log 2>&1 || { touch $S/lane1.failed; tail $S/skew.log; }
  cp /tmp/skew/skew_construction.json $S/ 2>/dev/null
  if [ ! -e $S/lane1.failed ]; then
    step lane1 "observe"
    $PY -m reap_swap.cli observe --model /tmp/skew --corpus data/corpus/calibration.jsonl --out $S/skew.obs.pt \
      --no-progress "${ENGINE[@]}" --enforce-eager > $S/observe.log 2>&1 || tail -20 $S/observe.log
    step lane1 "plan"
    $PY -m reap_swap.cli plan --observations $S/skew.obs.pt --model /tmp/skew --budget-ratio 0.5 \
      --core-fraction 0.48 --out $S/skew.plan.json.tmp > $S/plan.log 2>&1 && mv $S/skew.plan.json.tmp $S/skew.plan.json \
      || { touch $S/lane1.failed; tail -20 $S/plan.log; }
  fi
  if [ -e $S/skew.plan.json ]; then
    step lane1 "bench 50 %"
    $PY -m reap_swap.cli bench --model /tmp/skew --plan $S/skew.plan.json --prompts data/corpus/heldout.jsonl \
      --arms stock-uva,plan-swap --budget-gib 6.75 --batch 8 --no-progress --out $S/bench50 -- "${ENGINE[@]}"
  fi
  step lane1 "e2e reap-routed"
  $PY research/gpu/gpu_e2e.py --model /tmp/model --out $S/e2e1 --arms reap-routed
  if [ -e $S/want_uva_all ]; then  # asked for by a later call when reap's text differs from stock-gpu's
    step lane1 "e2e stock-uva-all"
    $PY research/gpu/gpu_e2e.py --model /tmp/model --out $S/e2e1 --arms stock-uva-all
  fi
  step lane1 done
}

lane_tp() {  # both GPUs: TP=2
  export CUDA_VISIBLE_DEVICES=0,1
  step tp "e2e tp: stock-gpu,reap-tp"
  $PY research/gpu/gpu_e2e.py --model /tmp/model --out $S/tp --tp 2 --arms stock-gpu,reap-tp
  step tp done
}

followup_a() {  # GPU 0: clean timings (no start-up on the other GPU while decode is timed)
  export CUDA_VISIBLE_DEVICES=0 E2E_QUIET_FILE=$S/quiet
  step A "e2e stock-gpu,reap-clean"
  $PY research/gpu/gpu_e2e.py --model /tmp/model --out $S/e2e0 --arms stock-gpu,reap-clean
  step A done
}

followup_b() {  # GPU 1: counters vs routed experts (unique prompts), GPU tests, standalone swap bench
  export CUDA_VISIBLE_DEVICES=1
  step B "e2e reap-routed"
  $PY research/gpu/gpu_e2e.py --model /tmp/model --out $S/e2e1 --arms reap-routed
  touch $S/quiet
  step B "pytest tests/gpu"
  gpu_tests
  step B "swap bench"
  $PY research/gpu/gpu_swap_bench.py --layers 8 --out $S/swap_bench.json > $S/swap_bench.log 2>&1; tail -3 $S/swap_bench.log
  step B done
}

tp_session() {  # issue 9's remaining items: stock UVA TP=2 references, bitwise MoE-layer probes
  export CUDA_VISIBLE_DEVICES=1
  step tp "pytest tests/gpu (GPU 1, before any server: nothing else allocates while vLLM profiles)"
  gpu_tests
  export CUDA_VISIBLE_DEVICES=0,1
  step tp "e2e tp: stock-gpu,reap-tp,stock-uva-half,stock-uva-all with MoE probes"
  $PY research/gpu/gpu_e2e.py --model /tmp/model --out $S/tp --tp 2 --moe-probe \
    --arms stock-gpu,reap-tp,stock-uva-half,stock-uva-all
  step tp done
}

tp_reap_session() {  # after a fix: GPU tests, then reap-tp alone, compared with an earlier call's stock arms
  export CUDA_VISIBLE_DEVICES=1
  step tp "pytest tests/gpu"
  gpu_tests
  export CUDA_VISIBLE_DEVICES=0,1
  mkdir -p $S/tp
  if [ -n "${TP_REFERENCE:-}" ]; then  # an earlier gpu_e2e.json: its stock arms (not its reap-tp)
    $PY -c "import json,sys; d=json.load(open(sys.argv[1])); d.pop('reap-tp',None); json.dump(d,open(sys.argv[2],'w'))" \
      "$TP_REFERENCE" $S/tp/gpu_e2e.json
  fi
  step tp "e2e tp: reap-tp with MoE probes"
  $PY research/gpu/gpu_e2e.py --model /tmp/model --out $S/tp --tp 2 --moe-probe --arms reap-tp
  step tp done
}

single_session() {  # one H200: GPU tests, then stock-gpu vs reap at 0/25/50/100 % and after swaps (issue 14's check)
  export CUDA_VISIBLE_DEVICES=0
  step single "pytest tests/gpu"
  gpu_tests
  step single "e2e stock-gpu,reap-sweep with MoE probes"
  $PY research/gpu/gpu_e2e.py --model /tmp/model --out $S/e2e0 --moe-probe --arms stock-gpu,reap-sweep
  [ -e $S/extra.sh ] && { step single "extra.sh"; bash $S/extra.sh > $S/extra.log 2>&1; }
  step single done
}

followup_lanes() {
  followup_a > $S/lane0.log 2>&1 &
  followup_b > $S/lane1.log 2>&1 &
  wait
  finish
}

main_lanes() {
  lane0 > $S/lane0.log 2>&1 &
  lane1 > $S/lane1.log 2>&1 &
  wait
  step main "single-GPU lanes done; TP lane"
  lane_tp > $S/lane_tp.log 2>&1
  [ -e $S/extra.sh ] && bash $S/extra.sh > $S/extra.log 2>&1
  finish
}

pack() {
  mkdir -p "$OUT"
  tar czf "$OUT/sess.tgz" --exclude='*.tmp' --exclude='checkpoints' -C /tmp sess $([ -d /tmp/fam ] && echo fam) 2>/dev/null
  ls -la "$OUT"
}

case "${1:-}" in
  start)  # start [main|followup|tp|tp-reap]
    mkdir -p $S
    setsid nohup bash "$0" "${2:-main}" > $S/main.log 2>&1 < /dev/null &
    sleep 2; step start "background session started (${2:-main})"
    ;;
  main) main_lanes ;;
  followup) followup_lanes ;;
  tp) tp_session > $S/lane_tp.log 2>&1; finish ;;
  tp-reap) tp_reap_session > $S/lane_tp.log 2>&1; finish ;;
  single) single_session > $S/lane0.log 2>&1; finish ;;
  wait)
    limit=${2:-540}; t0=$(date +%s)
    while [ ! -e $S/all.done ] && [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do sleep 10; done
    for f in main lane0 lane1 lane_tp extra; do [ -e $S/$f.log ] || continue; echo "== $f"; grep -v "^INFO\|^(APIServer\|^(EngineCore" $S/$f.log 2>/dev/null | tail -12 | cut -c1-400; done
    pack
    ;;
  *) echo "usage: $0 start | wait SECONDS"; exit 2 ;;
esac
