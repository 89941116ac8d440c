mkdir -p /tmp/fxc && cp benchmarks/results/tuning/autotune.json /tmp/fxc/
export FLEXFA_CACHE_DIR=/tmp/fxc
for round in 1 2; do
  echo "old c78abd9 round $round"; (cd ab_old && PYTHONPATH=. timeout 60 python ../benchmarks/dispatch_overhead.py 2000 2>&1 | grep "{")
  echo "new round $round"; PYTHONPATH=. timeout 60 python benchmarks/dispatch_overhead.py 2000 2>&1 | grep "{"
done
PYTHONPATH=. timeout 150 python -m pytest -m gpu -q tests/gpu/test_hopper_gpu.py -p no:cacheprovider 2>&1 | grep -E "passed|failed|us per cached|Error" | tail -6
PYTHONPATH=. timeout 200 python -m pytest -m gpu -q tests/kernels/test_backward_gpu.py -k "128" -p no:cacheprovider 2>&1 | grep -E "passed|failed|Error" | tail -6
