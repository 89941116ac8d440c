# flexfa inside torch.compile (Inductor) on the GPU, and the Hopper tests (dispatch) with the
# is_compiling check in flex_attention
mkdir -p /tmp/fxc && cp benchmarks/results/tuning/autotune.json /tmp/fxc/
export FLEXFA_CACHE_DIR=/tmp/fxc PYTHONPATH=.
timeout 300 python -m pytest -m gpu -q tests/gpu/test_compile_gpu.py tests/gpu/test_hopper_gpu.py -p no:cacheprovider -p no:logging 2>&1 | tail -15 > $OUT/compile_and_hopper_tests.log; tail -6 $OUT/compile_and_hopper_tests.log
for i in 1 2 3; do timeout 60 python benchmarks/dispatch_overhead.py 2000 2>&1 | tail -1; done > $OUT/dispatch.log; cat $OUT/dispatch.log
