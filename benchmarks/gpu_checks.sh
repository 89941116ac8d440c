#!/bin/bash
# One device call: the GPU-marked tests, then the FP8 and block-mask GPU benchmarks, each step
# under its own time limit so one slow step cannot starve the rest. Logs go to $OUT.
# Usage (repository root, on the H200): FLEXFA_COMMIT=<sha> bash benchmarks/gpu_checks.sh
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. FLEXFA_CACHE_DIR=/tmp/fxc
OUT=${OUT:-/tmp/flexfa-gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc $((SECONDS - t0))s: $(grep -E 'passed|failed|error' "$OUT/$name.log" | tail -1)"
}
step fwd_bwd 130 python -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_forward_gpu.py tests/kernels/test_backward_gpu.py
step fp8 60 python -m pytest -m gpu -q -s -p no:cacheprovider tests/gpu/test_fp8_gpu.py
step memory 50 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_memory_gpu.py
step hopper 45 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_hopper_gpu.py
step fp8_bench 45 python -m flexfa.fp8.bench --seqs 16384 --dims 128 --variants full,causal --out "$OUT"
step blockmask_bench 25 python benchmarks/blockmask_bench.py --cuda
tail -n 25 "$OUT/fp8_bench.log" "$OUT/blockmask_bench.log"
grep -h -E "^(FAILED|ERROR)" "$OUT"/*.log | head -20
