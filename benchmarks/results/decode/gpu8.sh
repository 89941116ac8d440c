# split-KV decoding (not yet run: no device time was left in the tenth session): GPU tests,
# then the decode benchmark with FLEXFA_SPLIT_KV=0 (default) and auto
mkdir -p /tmp/fxc && cp benchmarks/results/tuning/autotune.json /tmp/fxc/
export FLEXFA_CACHE_DIR=/tmp/fxc PYTHONPATH=.
timeout 100 python -m pytest -m gpu -q tests/kernels/test_forward_gpu.py -k "split or ampere or sdpa or gqa" -p no:cacheprovider -p no:logging 2>&1 | tail -8 > $OUT/split_gpu_tests.log; tail -4 $OUT/split_gpu_tests.log
for setting in 0 auto; do FLEXFA_SPLIT_KV=$setting timeout 80 python benchmarks/decode_gap.py 2>&1 | grep -v "Warn\|tuning" | tail -14; done > $OUT/decode_split.log; cat $OUT/decode_split.log
