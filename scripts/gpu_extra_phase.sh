#!/usr/bin/env bash
# gpu_run.sh's `extra` phase (issue 17), the version for run 23 (earlier versions: git log; run 20's
# and 22's asked the 25 % plan-cache text question with `reap-swap bench` jobs).
# This one asks why the SEEDED device cache's text differed from stock in run 12 (research.md
# "seedfix": refused on CUDA since; the kernel-level identity held in run 19) and serves the PINNED
# form with an empty core for the first time. Run 20 found the 25 % plan-cache server moving per
# process from Inductor's on-device autotuning and bitwise equal to stock with
# TORCHINDUCTOR_DETERMINISTIC=1; if the seeded serve's difference is the same thing, `seeded` differs
# and `seededdet` does not. Jobs (DIAG_JOBS picks; all by default), each one gpu_e2e.py arm on
# /tmp/model (the kit's mk_model, 12 layers, run 8's stock text as the reference), two servers at a
# time (--gpu-memory-utilization 0.35 each, as in run 12):
#   seeded       reap-cache-seeded as in run 12 (plan core 25 %, pool 50 %, 64 slots seeded, swaps after)
#   seededdet    the same with TORCHINDUCTOR_DETERMINISTIC=1
#   nocore       reap-cache-nocore: the pinned form with an empty core (E + N = 192 units, own units
#                all host-backed: run 12's seeded layout without seeding)
#   seededbytes  reap-cache-seeded with --cache-shadow bytes (every cached MoE step beside the
#                uncached one, every slot's bytes checked: where a difference is made, if one is)
# Usage: bash scripts/gpu_extra_phase.sh OUTDIR   (needs /tmp/model)
set -u
O=${1:?outdir}; mkdir -p "$O"
PY=${PY:-python3}
REF=research-notes/h200-2026-12-01/run8-gpu_e2e.json
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
if [[ $card != *H200* ]] && [ "${DIAG_ANY_CARD:-0}" != 1 ]; then  # run 24: an H100 did not reproduce it
  echo "extra: $REF is an H200's stock text; on '${card:-?}' the text checks would compare two cards' kernels" \
    "(research.md run 24); DIAG_ANY_CARD=1 runs anyway" | tee -a "$O/jobs.log" >&2
  exit 2
fi
job() {  # NAME ARM EXTRA_FLAGS ENV...
  local name=$1 arm=$2 flags=$3; shift 3
  case " ${DIAG_JOBS:-seeded seededdet nocore seededbytes} " in *" $name "*) ;; *) return 0 ;; esac
  mkdir -p "$O/$name"
  $PY -c "import json; d=json.load(open('$REF')); json.dump({'stock-gpu': d['stock-gpu']}, open('$O/$name/gpu_e2e.json', 'w'))"
  # shellcheck disable=SC2086  # flags: word-split on purpose
  env "$@" timeout --kill-after=20 ${DIAG_CAP:-330} $PY scripts/gpu_e2e.py --model /tmp/model --out "$O/$name" \
    --moe-probe --arms "$arm" $flags > "$O/$name.log" 2>&1
  echo "$(date +%T) $name exit $?" >> "$O/jobs.log"
}
job seeded reap-cache-seeded "" &
job seededdet reap-cache-seeded "" TORCHINDUCTOR_DETERMINISTIC=1 &
wait
job nocore reap-cache-nocore "" &
job seededbytes reap-cache-seeded "--cache-shadow bytes" &
wait
