#!/usr/bin/env bash
# Run 35 (one lease, cheapest and most decisive first): issue 43's last GPU test alone on the card;
# issue 44: GPT-OSS MXFP4 per expert (REAPSWAP_MXFP4=1, compat/mxfp4.py) against stock at 2 layers of
# the GPT-OSS shape, beside DeepSeek-V2-Lite on Model Runner V2 offloaded at load by reap-swap's hook
# (compat/runner.install_v2_offloader; research/gpu/check_mrv2.py reads it); then the AWQ model larger
# than the card (Qwen3-235B-A22B shape, 72 layers, lease34's step 3) and GPT-OSS-120B MXFP4 at full
# depth if the 2-layer case was equal to stock; online FP8's load-time HBM peak at 12 layers; issue
# 42's skew bench and guards last.
# Poll calls tar /tmp/run into $OUT.
source "$(dirname "$0")/lease_env.sh"
free -g >> "$R/lease.log"
say "pool test alone"
timeout 120 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_pool_reserve_gpu.py > "$R/pytest_pool.log" 2>&1
say "pool test rc $?"
python3 -c "import triton_kernels, sys; print('triton_kernels', triton_kernels.__file__)" >> "$R/lease.log" 2>&1
say "mxfp4 2-layer e2e start (beside the V2-Lite lane)"
( REAPSWAP_MXFP4=1 timeout 600 python3 research/gpu/gpu_quant_e2e.py --out "$R/mx" --cases mxfp4 --gpt-oss-shape \
    --layers 2 --jobs 1 --stock-twice none --eager-pair none --case-timeout 500 > "$R/mx.log" 2>&1
  say "mxfp4 e2e rc $?" ) &
MXPID=$!
V2=(--config tests/data/deepseek_v2_lite_config.json --name deepseek_v2_lite --out "$R/fam" --eager --kv-gib 0.5
    --host-guard-gib 5 --startup-timeout 400 --prompts 2)
( while sleep 5; do echo "$(date +%T) $(free -m | awk '/Mem:/{print $3, $7}') $(nvidia-smi --query-gpu=memory.used --format=csv,noheader)"; done ) > "$R/mem.log" 2>&1 &
MEMPID=$!
timeout 450 python3 research/gpu/gpu_families.py "${V2[@]}" --arms reap > "$R/v2_reap.log" 2>&1
say "v2-lite reap rc $?"
timeout 300 python3 research/gpu/gpu_families.py "${V2[@]}" --arms stock > "$R/v2_stock.log" 2>&1
say "v2-lite stock rc $?"
python3 research/gpu/gpu_families.py --name deepseek_v2_lite --out "$R/fam" --arms merge > /dev/null 2>&1
python3 research/gpu/check_mrv2.py "$R/fam" --out "$R/mrv2_check.json" > /dev/null 2>&1
say "mrv2 check rc $?"
wait $MXPID
grep -h "cpu-offload-params\|mxfp4\|MXFP4" "$R"/mx/*/*.server.log 2>/dev/null | head -40 >> "$R/lease.log"
say "int4 beyond the card start"
ENG="--served-model-name m --dtype float16 --max-model-len 2048 --max-num-seqs 8 --gpu-memory-utilization 0.9"
ENG="$ENG --load-format dummy --no-enable-prefix-caching --kv-cache-memory-bytes 2147483648 --enforce-eager"
timeout 720 python3 research/gpu/gpu_families.py --config tests/data/qwen3_235b_a22b_awq_config.json --name awq235 \
  --layers 72 --arms reap --plan-core 0.125 --plan-budget 0.25 --out "$R/fam" --engine "$ENG" \
  --prompts 2 --greedy-tokens 8 --startup-timeout 600 --models /tmp/families > "$R/awq235.log" 2>&1
say "int4 beyond the card rc $?"
if python3 -c "import json, sys; r = json.load(open('$R/mx/quant_e2e.json'))['rows']; sys.exit(not (r and r[0]['binds'] and r[0]['pass']))" 2>/dev/null; then
  say "gpt-oss-120b mxfp4 full depth start"
  ENG="--served-model-name m --max-model-len 2048 --max-num-seqs 8 --gpu-memory-utilization 0.9"
  ENG="$ENG --load-format dummy --no-enable-prefix-caching --kv-cache-memory-bytes 2147483648"
  REAPSWAP_MXFP4=1 timeout 600 python3 research/gpu/gpu_families.py --config tests/data/gpt_oss_120b_config.json \
    --name gptoss120 --arms reap --plan-core 0.125 --plan-budget 0.25 --out "$R/fam" --engine "$ENG" \
    --prompts 2 --greedy-tokens 8 --startup-timeout 500 --models /tmp/families > "$R/gptoss120.log" 2>&1
  say "gpt-oss-120b rc $?"
fi
# online --quantization fp8 (issue 44): is the load's HBM peak one layer in conversion (vLLM 0.26.0's
# reload/layerwise.py materializes, loads and quantizes one layer at a time; the engine re-homes it
# right after) or every expert (what launcher.check_device_load assumes)? mem.log has the answer.
say "online fp8 at 12 layers start"
timeout 400 python3 research/gpu/gpu_quant_e2e.py --out "$R/fp8online" --cases fp8-online --layers 12 --jobs 1 \
  --stock-twice none --eager-pair none --case-timeout 360 > "$R/fp8online.log" 2>&1
say "online fp8 rc $?"
kill $MEMPID
timeout 560 python3 research/gpu/gpu_skew_bench.py --out "$R/skew" --no-25 --deadline 500 --all-at-once \
  --only cache50,resident,static50 > "$R/skew.log" 2>&1
say "skew rc $?"
run_guards
say "all done"
