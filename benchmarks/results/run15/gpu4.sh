# FP8 GPU tests at HEAD (fwd_fp8 stores its lse through flexfa_store_rows since 476ad73; not
# re-run on the GPU since cc68a83) and the cached-call dispatch cost on this session's host
mkdir -p /tmp/fxc && cp benchmarks/results/tuning/autotune.json /tmp/fxc/
export FLEXFA_CACHE_DIR=/tmp/fxc PYTHONPATH=.
timeout 240 python -m pytest -m gpu -q -s tests/gpu/test_fp8_gpu.py -p no:cacheprovider -p no:logging 2>&1 | grep -v Warn | tail -30 > $OUT/fp8_gpu_tests.log; tail -8 $OUT/fp8_gpu_tests.log
for i in 1 2 3; do timeout 60 python benchmarks/dispatch_overhead.py 2000 2>&1 | tail -1; done > $OUT/dispatch.log; cat $OUT/dispatch.log
