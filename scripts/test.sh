#!/usr/bin/env bash
# The test suite as CI runs it: CPU only, kernels through the Triton interpreter.
set -uo pipefail
cd "$(dirname "$0")/.."
export TRITON_INTERPRET=1 HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"
python3 -m pytest -q -m "not gpu and not slow" -p no:cacheprovider "$@"
