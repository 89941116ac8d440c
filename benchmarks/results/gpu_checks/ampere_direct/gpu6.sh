# the Ampere template's direct launches: GPU tests (alignment, strides, masks), the forward GPU
# file, and the dispatch cost (flexfa_dense_pointer_template_us) against the previous tree
mkdir -p /tmp/fxc && cp benchmarks/results/tuning/autotune.json /tmp/fxc/
export FLEXFA_CACHE_DIR=/tmp/fxc PYTHONPATH=.
timeout 200 python -m pytest -m gpu -q tests/kernels/test_forward_gpu.py -k "ampere or matches_sdpa or gqa or dispatch" -p no:cacheprovider -p no:logging 2>&1 | tail -8 > $OUT/forward_gpu_tests.log; tail -4 $OUT/forward_gpu_tests.log
for i in 1 2 3; do timeout 60 python benchmarks/dispatch_overhead.py 2000 2>&1 | tail -1; done > $OUT/dispatch.log; cat $OUT/dispatch.log
