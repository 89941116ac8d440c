#!/bin/bash
# The H200 runs behind docs/performance.md, one device call per part:
#   part a: lazy-rescale A/B, first-call and dispatch timings, the benchmark at E=128
#   part b: the benchmark at E=64 (same machine: reuses /tmp/fxc, the tuned tiles included)
# Usage (repository root): FLEXFA_COMMIT=<sha> bash benchmarks/h200_run.sh a|b [bench seconds]
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. FLEXFA_CACHE_DIR=/tmp/fxc
OUT=${OUT:-/tmp/flexfa-bench}
mkdir -p "$OUT"
PART=${1:-a}
LIMIT=${2:-420}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
if [ "$PART" = a ]; then
  python benchmarks/rescale_ab.py 2>&1 | tee "$OUT/rescale_ab.txt"
  tail -1 "$OUT/rescale_ab.txt" | grep -qx '[08]' && tail -1 "$OUT/rescale_ab.txt" > /tmp/fxc_rescale
  export FLEXFA_RESCALE_THRESHOLD=$(cat /tmp/fxc_rescale 2>/dev/null || echo 0)
  python benchmarks/first_call.py "$OUT/first_call.json" 2>&1 | grep -v Warning
  python benchmarks/dispatch_overhead.py 2>&1 | tee "$OUT/dispatch.json"
  timeout "$LIMIT" python -m flexfa bench --dims 128 --seqs 16384,8192,2048 --rep 50 \
    --out "$OUT/d128" 2>&1 | grep -v '^{"impl'
else
  export FLEXFA_RESCALE_THRESHOLD=$(cat /tmp/fxc_rescale 2>/dev/null || echo 0)
  timeout "$LIMIT" python -m flexfa bench --dims 64 --seqs 16384,2048,8192 --rep 50 \
    --out "$OUT/d64" 2>&1 | grep -v '^{"impl'
fi
echo "rescale threshold used: $FLEXFA_RESCALE_THRESHOLD"
