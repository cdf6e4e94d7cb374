#!/usr/bin/env bash
# The python3 of `DRY=1 bash research/gpu/gpu_run.sh session` (branch fulldepth): checks on a machine
# without a GPU what a phase would run, with today's code, and starts no server.
#   research/gpu/gpu_families.py ... --arms reap|stock|count  ->  the same call with --arms prepare (real:
#       the model folder, shape, synthetic plan, engine arguments, meta.json); merge runs as is
#   research/gpu/gpu_budget_auto.py ...                       ->  the same call with --dry-run (real: the
#       model folder for --config, the plan read, every arm's server command; no server)
#   anything else (-c snippets, benches, pytest)         ->  only logged
# Every call is logged to $DRY_LOG (one line, "DRY <argv>"); the real interpreter is $DRY_PYTHON.
set -u
echo "DRY ${REAP_SWAP_EXACT_PINNING:+REAP_SWAP_EXACT_PINNING=$REAP_SWAP_EXACT_PINNING }$*" >> "${DRY_LOG:-/tmp/run/dry.log}"
py=${DRY_PYTHON:-python3}
case "${1:-}" in
  research/gpu/gpu_families.py)
    args=("$@")
    for ((i = 0; i < ${#args[@]}; i++)); do
      if [ "${args[$i]}" = "--arms" ] && [ "${args[$((i + 1))]}" != merge ]; then args[$((i + 1))]=prepare; fi
    done
    exec $py "${args[@]}"
    ;;
  research/gpu/gpu_budget_auto.py) exec $py "$@" --dry-run ;;
  *) exit 0 ;;
esac
