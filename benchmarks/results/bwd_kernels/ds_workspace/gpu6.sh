# dS workspace of block slots (bands) against the dense L x S layout of b869736, and the
# E = 128 backward GPU tests
mkdir -p /tmp/fxc && cp benchmarks/results/tuning/autotune.json /tmp/fxc/
export FLEXFA_CACHE_DIR=/tmp/fxc PYTHONPATH=.
timeout 150 python benchmarks/tree_ab.py --old ab_old --cases 128:16384:causal,128:16384:document,128:2048:causal --passes fwd+bwd --rounds 3 2>&1 | grep -v "Warn\|tuning" | tail -5
timeout 130 python -m pytest -m gpu -q tests/kernels/test_backward_gpu.py -k 128 -p no:cacheprovider -p no:logging 2>&1 | grep -E "passed|failed|Error" | tail -4
