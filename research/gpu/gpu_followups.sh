#!/usr/bin/env bash
# What one H200 lease runs after gpu_session.sh's `single` lane (it is that lane's extra.sh):
# the quantized-MoE survey (issue 16), then Qwen3.5-35B-A3B at full size with the field plan
# (issue 15, lane A of gpu_families.sh). Results under /tmp/sess/{quant_survey,fam}.
#   cp research/gpu/gpu_followups.sh /tmp/sess/extra.sh   # before `gpu_session.sh start single`
set -u
S=/tmp/sess
echo "$(date +%H:%M:%S) quant survey"
PYTHONPATH=/tmp/site:$PWD timeout --kill-after=20 330 python3 research/gpu/gpu_quant_survey.py \
  --out $S/quant_survey --jobs 6 --timeout 240 > $S/quant_survey.log 2>&1
echo "$(date +%H:%M:%S) quant survey exit $?"
tail -20 $S/quant_survey/summary.txt 2>/dev/null
echo "$(date +%H:%M:%S) families lane A (Qwen3.5-35B-A3B, field plan)"
mkdir -p /tmp/fam/out
FIELD_PLAN=${FIELD_PLAN:-.kit/strict30-v2-plan.json} bash research/gpu/gpu_families.sh lane_a_only > $S/families.log 2>&1
echo "$(date +%H:%M:%S) families exit $?"
