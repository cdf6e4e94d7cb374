#!/usr/bin/env bash
# Run 34 (one lease, in order of what is cheapest to finish): the GPU tests (issue 43: the renamed
# step="triton" tests and the folded VMM stores); issue 44: INT4 in groups loaded through vLLM's UVA
# offload under its own names (w13_qweight / w13_weight_packed) against stock on seeded checkpoints,
# then an AWQ model with more expert bytes than the card (Qwen3-235B-A22B layer shape, 72 layers,
# dummy weights, reap-swap defaults: groups and exact pinning chosen by the launcher); issue 42: the skew bench (the step kernel's run-time slot count:
# startup, no torch fallback), the equality driver at 25 % and on the skewed model, the guards.
# Poll calls tar /tmp/run into $OUT.
source "$(dirname "$0")/lease_env.sh"
python3 -c "import pytest; print('pytest', pytest.__version__)" >> "$R/lease.log" 2>&1
free -g >> "$R/lease.log"
say "gpu tests start (beside the INT4 cases: those servers take a fixed KV cache, no memory profiling)"
( timeout 480 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu > "$R/pytest_gpu.log" 2>&1; say "gpu tests rc $?" ) &
say "int4 e2e start"
timeout 600 python3 research/gpu/gpu_quant_e2e.py --out "$R/q4" --cases awq,gptq,ct-w4a16 --reap-group-size auto \
  --layers 2 --jobs 3 --stock-twice none --eager-pair none --case-timeout 360 > "$R/q4.log" 2>&1
say "int4 e2e rc $?"
grep -h "cpu-offload-params\|no UVA expert offload" "$R"/q4/*/*.server.log >> "$R/lease.log" 2>&1
say "int4 beyond the card start"
ENG="--served-model-name m --dtype float16 --max-model-len 2048 --max-num-seqs 8 --gpu-memory-utilization 0.9"
ENG="$ENG --load-format dummy --no-enable-prefix-caching --kv-cache-memory-bytes 2147483648 --enforce-eager"
( while sleep 5; do echo "$(date +%T) $(free -m | awk '/Mem:/{print $3, $7}') $(nvidia-smi --query-gpu=memory.used --format=csv,noheader)"; done ) > "$R/mem_awq235.log" 2>&1 &
MEMPID=$!
timeout 900 python3 research/gpu/gpu_families.py --config tests/data/qwen3_235b_a22b_awq_config.json --name awq235 \
  --layers 72 --arms reap --plan-core 0.125 --plan-budget 0.25 --out "$R/fam" --engine "$ENG" \
  --prompts 2 --greedy-tokens 8 \
  --startup-timeout 700 --models /tmp/families > "$R/awq235.log" 2>&1
say "int4 beyond the card rc $?"
kill $MEMPID
timeout 560 python3 research/gpu/gpu_skew_bench.py --out "$R/skew" --no-25 --deadline 500 --all-at-once \
  --only cache50,resident,static50 > "$R/skew.log" 2>&1
say "skew rc $?"
grep -rh "runs the torch policy step\|step kernel" "$R/skew" 2>/dev/null | head -20 >> "$R/lease.log"
timeout 420 python3 research/gpu/gpu_cache_equality.py --model /tmp/model --out "$R/eq25" --budget 0.25 --core 0.125 \
  --arms stock,reap-default > "$R/eq25.log" 2>&1
say "eq25 rc $?"
timeout 420 python3 research/gpu/gpu_cache_equality.py --model /tmp/skew --out "$R/eqskew" \
  --arms stock,reap-default > "$R/eqskew.log" 2>&1
say "eqskew rc $?"
run_guards
say "all done"
