# decode-shaped calls: flexfa vs FlexAttention (compiled) vs SDPA
mkdir -p /tmp/fxc && cp benchmarks/results/tuning/autotune.json /tmp/fxc/
export FLEXFA_CACHE_DIR=/tmp/fxc PYTHONPATH=.
timeout 200 python benchmarks/decode_gap.py 2>&1 | grep -v "Warn\|tuning" > $OUT/decode_gap.log; tail -14 $OUT/decode_gap.log
