# dK/dV tiles of the dS mode (ab_v1..v4) and the dQ kernel's stages (ab_v5, v6) against this
# tree (HOPPER_DS_TILES ((64, 64, 4, 2), (128, 64, 8, 3))), then the backward GPU tests
mkdir -p /tmp/fxc && cp benchmarks/results/tuning/autotune.json /tmp/fxc/
export FLEXFA_CACHE_DIR=/tmp/fxc PYTHONPATH=.
timeout 240 python benchmarks/tree_ab.py --old ab_v1 --old ab_v2 --old ab_v3 --old ab_v4 --old ab_v5 --old ab_v6 --cases 128:16384:causal,128:8192:full,128:16384:softcap,128:2048:document --passes fwd+bwd --rounds 3 2>&1 | grep -v "Warn\|tuning" > $OUT/tree_ab_tiles.log; tail -25 $OUT/tree_ab_tiles.log
timeout 300 python -m pytest -m gpu -q tests/kernels/test_backward_gpu.py -p no:cacheprovider -p no:logging 2>&1 | tail -15 > $OUT/backward_gpu_tests.log; tail -6 $OUT/backward_gpu_tests.log
