# run 15: the full benchmark grid in one process at HEAD, then the FP8 target cases
mkdir -p /tmp/fxc && cp benchmarks/results/tuning/autotune.json /tmp/fxc/
export FLEXFA_CACHE_DIR=/tmp/fxc PYTHONPATH=. FLEXFA_COMMIT=b9806b8
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
timeout 470 python -m flexfa bench --dims 64,128 --seqs 2048,8192,16384 --rep 40 --out $OUT 2>&1 | grep -v "Warn\|tuning" > $OUT/run15_bench.log; tail -4 $OUT/run15_bench.log
timeout 100 python -m flexfa.fp8.bench --seqs 16384 --dims 128 --variants full,causal --out $OUT/fp8 2>&1 | grep -v Warn | tail -12 > $OUT/fp8_bench.log; cat $OUT/fp8_bench.log
