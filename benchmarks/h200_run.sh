#!/bin/bash
# The H200 runs behind docs/performance.md, one device call per part:
#   part a: first-call and dispatch timings, the benchmark at E=128
#   part b: the benchmark at E=64 (same machine: reuses /tmp/fxc, the tuned tiles included)
# Usage (repository root): FLEXFA_COMMIT=<sha> bash benchmarks/h200_run.sh a|b [bench seconds]
# Writes $OUT/manifest.json (commit, GPU, versions, command, date) first.
case "${1:-}" in -h|--help) sed -n '2,6p' "$0" | cut -c3-; exit 0;; esac
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. FLEXFA_CACHE_DIR=/tmp/fxc
OUT=${OUT:-/tmp/flexfa-bench}
mkdir -p "$OUT"
python benchmarks/manifest.py "$OUT" --command "bash benchmarks/h200_run.sh $*" > /dev/null
PART=${1:-a}
LIMIT=${2:-420}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
if [ "$PART" = a ]; then
  python benchmarks/first_call.py "$OUT/first_call.json" 2>&1 | grep -v Warning
  python benchmarks/dispatch_overhead.py --json "$OUT/dispatch.json" 2>&1 | tee "$OUT/dispatch.log"
  timeout "$LIMIT" python -m flexfa bench --dims 128 --seqs 16384,8192,2048 --rep 50 \
    --out "$OUT/d128" 2>&1 | grep -v '^{"impl'
else
  timeout "$LIMIT" python -m flexfa bench --dims 64 --seqs 16384,2048,8192 --rep 50 \
    --out "$OUT/d64" 2>&1 | grep -v '^{"impl'
fi
