#!/usr/bin/env bash
# gpu_run.sh's `extra` phase (issue 42; earlier versions: git log): reap-swap with the device cache
# against stock vLLM on this card, under swaps in flight, after them and after a storm
# (research/gpu/gpu_cache_equality.py), with the controls the issue asks for: a second stock server and
# reap-swap with the cache off. EQ_ARMS picks the arms (in order), EQ_SHADOW the cache arms' debug
# shadow (out: every cached MoE step beside the uncached one), EQ_CAP the phase's time limit.
# Usage: bash research/gpu/gpu_extra_phase.sh OUTDIR   (needs /tmp/model: the kit's mk_model)
set -u
O=${1:?outdir}; mkdir -p "$O"
PY=${PY:-python3}
nvidia-smi --query-gpu=name --format=csv,noheader > "$O/card.txt" 2>&1
# shellcheck disable=SC2086  # EQ_EXTRA: word-split on purpose
timeout --kill-after=20 ${EQ_CAP:-900} $PY research/gpu/gpu_cache_equality.py --model /tmp/model --out "$O" \
  --arms "${EQ_ARMS:-stock,reap-cache,reap-off,stock2}" --shadow "${EQ_SHADOW:-out}" ${EQ_EXTRA:-} > "$O/eq.log" 2>&1
echo "$(date +%T) equality exit $?" >> "$O/jobs.log"
