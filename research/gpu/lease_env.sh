# Sourced by the lease drivers (lease32.sh, lease33.sh, lease33b.sh) after the kit's install call: the
# repository root as working folder, $R (default /tmp/run) for results, the kit's environment, say()
# appending to $R/lease.log, the card's name in $R/card.txt, and run_guards (the two guards, a lease's last step).
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
R=${R:-/tmp/run}
mkdir -p "$R"
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1
say() { echo "$(date +%T) $*" >> "$R/lease.log"; }
nvidia-smi -L > "$R/card.txt" 2>&1
# the swap guard, then the all-resident decode guard (one serve): the closing step of a lease
run_guards() {
  timeout 150 python3 research/gpu/gpu_swap_guard.py --out "$R/guards" > "$R/swapguard.log" 2>&1
  say "swapguard rc $?"
  timeout --kill-after=30 300 python3 research/gpu/gpu_guards.py --model /tmp/model --out "$R/guards" \
    --serves 1 --rounds 8 --tokens 256 --deadline 260 > "$R/guards.log" 2>&1
  say "guards rc $?"
}
