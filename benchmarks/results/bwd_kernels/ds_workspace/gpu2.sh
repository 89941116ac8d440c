set -x
mkdir -p /tmp/fxc && cp benchmarks/results/tuning/autotune.json /tmp/fxc/
export FLEXFA_CACHE_DIR=/tmp/fxc PYTHONPATH=.
timeout 330 python benchmarks/tree_ab.py --old . --old-env FLEXFA_BACKWARD_DS=0 --new-env FLEXFA_BACKWARD_DS=auto --cases 128:16384:softcap,128:8192:alibi,128:8192:sliding,128:16384:prefix,128:2048:full,128:2048:softcap,128:2048:document --passes fwd+bwd --rounds 3 2>&1 | grep -v "Warn\|tuning" | tee $OUT/tree_ab_ds2.log
timeout 220 python -m pytest -m gpu -q -x tests/kernels/test_backward_gpu.py tests/gpu/test_hopper_gpu.py -p no:cacheprovider 2>&1 | tail -15 | tee $OUT/gpu_tests.log
