set -x
mkdir -p /tmp/fxc && cp benchmarks/results/tuning/autotune.json /tmp/fxc/
export FLEXFA_CACHE_DIR=/tmp/fxc PYTHONPATH=.
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,power.draw --format=csv
FLEXFA_BACKWARD_DS=1 timeout 150 python benchmarks/bwd_profile.py 16384 128 causal,full flexfa 2>&1 | grep -v Warn | tee $OUT/bwd_profile_ds.log
timeout 400 python benchmarks/tree_ab.py --old . --old-env FLEXFA_BACKWARD_DS=0 --new-env FLEXFA_BACKWARD_DS=1 --cases 128:16384:causal,128:16384:full,128:2048:causal,128:8192:document,64:16384:causal,64:2048:full --passes fwd+bwd --rounds 3 2>&1 | grep -v "Warn\|tuning" | tee $OUT/tree_ab_ds.log
