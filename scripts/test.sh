#!/usr/bin/env bash
# The test suite as CI runs it: CPU only, kernels through the Triton interpreter, with empty
# Triton and flexfa caches of its own (removed at exit), so that no test passes only because
# an earlier run left a kernel in a cache. The suite runs in one process per core
# (scripts/shard_pytest.py --by-file: whole test files from a shared queue, the processes'
# logs in the temporary directory, a failing process's last lines printed, one summed summary
# line at the end); arguments go to pytest in each process.
set -uo pipefail
cd "$(dirname "$0")/.."
caches=$(mktemp -d "${TMPDIR:-/tmp}/flexfa-test-caches.XXXXXX") || exit 1
trap 'rm -rf "$caches"' EXIT
export TRITON_CACHE_DIR="$caches/triton" FLEXFA_CACHE_DIR="$caches/flexfa"
export TRITON_INTERPRET=1 HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"
python3 scripts/shard_pytest.py -n auto --by-file --tail 200 --logs "$caches/logs/pytest" \
  -- -m "not gpu and not slow" "$@"
