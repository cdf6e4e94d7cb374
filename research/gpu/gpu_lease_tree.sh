#!/usr/bin/env bash
# Slim the working tree for a GPU lease (run 18's shipping: whole kit parts fit a device call only when
# research-notes/, ~50 MB, stays behind), keeping the research-notes/ files a phase reads
# (research/gpu/gpu_inputs.txt), and put it back after:
#   bash research/gpu/gpu_lease_tree.sh hold      # research-notes/ -> $HOLD (default /tmp/rn_hold), inputs copied back
#   bash research/gpu/gpu_lease_tree.sh restore   # the held research-notes/ back in place
set -euo pipefail
cd "$(dirname "$0")/../.."
HOLD=${HOLD:-/tmp/rn_hold}
case "${1:-}" in
  hold)
    [ -e "$HOLD" ] && { echo "$HOLD exists: restore first" >&2; exit 2; }
    mv research-notes "$HOLD"
    grep -v '^#' research/gpu/gpu_inputs.txt | awk '$2 ~ /^research-notes\// {print $2}' | sort -u | while read -r f; do
      if [ -f "$HOLD/${f#research-notes/}" ]; then mkdir -p "$(dirname "$f")" && cp "$HOLD/${f#research-notes/}" "$f"
      else echo "not in research-notes/: $f (gpu_run.sh start refuses the phase that reads it)" >&2; fi
    done
    echo "held research-notes/ in $HOLD; kept: $(find research-notes -type f | tr '\n' ' ')"
    ;;
  restore)
    [ -d "$HOLD" ] || { echo "nothing held in $HOLD" >&2; exit 2; }
    rm -rf research-notes && mv "$HOLD" research-notes
    echo "research-notes/ restored"
    ;;
  *) echo "usage: [HOLD=dir] $0 hold | restore" >&2; exit 2 ;;
esac
