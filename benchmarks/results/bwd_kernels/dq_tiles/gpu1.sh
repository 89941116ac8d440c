# dQ-from-dS kernel tiles (ab_t1..t4: DS_DQ_TILES) and a pointer store of dS (ab_t5) against
# this tree (DS_DQ_TILES None: the tuned dQ tiles), then the GPU tests not re-run at 5d6783b
mkdir -p /tmp/fxc && cp benchmarks/results/tuning/autotune.json /tmp/fxc/
export FLEXFA_CACHE_DIR=/tmp/fxc PYTHONPATH=.
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
timeout 250 python benchmarks/tree_ab.py --old ab_t1 --old ab_t2 --old ab_t3 --old ab_t4 --old ab_t5 --cases 128:16384:causal,128:8192:full,128:2048:document --passes fwd+bwd --rounds 3 2>&1 | grep -v "Warn\|tuning" > $OUT/tree_ab_e128.log; tail -17 $OUT/tree_ab_e128.log
E=FLEXFA_BACKWARD_DS=1
timeout 130 python benchmarks/tree_ab.py --old ab_t1 --old ab_t2 --old ab_t3 --old-env $E --old-env $E --old-env $E --cases 64:16384:causal,64:2048:full --passes fwd+bwd --rounds 3 2>&1 | grep -v "Warn\|tuning" > $OUT/tree_ab_e64.log; tail -8 $OUT/tree_ab_e64.log
timeout 190 python -m pytest -m gpu -q tests/gpu/test_memory_gpu.py tests/gpu/test_bench_cases.py tests/gpu/test_hopper_gpu.py -p no:cacheprovider -p no:logging 2>&1 | tail -15 > $OUT/gpu_tests.log; tail -6 $OUT/gpu_tests.log
