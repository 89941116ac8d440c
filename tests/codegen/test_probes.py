"""The two CPU-only probes behind docs/performance.md's account of the forward's limits
(compiled for sm_90, no GPU): plain Triton 3.6 waits for a wgmma right after issuing it even
when its result is used one iteration later, and the Gluon spike's loop does overlap the
softmax with a GEMM (issue, wait for all but one group, exponentials, wait for the rest)."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name):
    """The benchmark script as a module, its kernels decorated for compiling (not for the
    interpreter the tests otherwise run under)."""
    from flexfa.runtime.loader import triton_mode

    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    with triton_mode(interpret=False):
        spec.loader.exec_module(module)
    return module


def test_triton_waits_for_the_next_tiles_gemm_before_the_softmax():
    probe = _load("wgmma_wait_probe")
    plain, rotated = probe.loop_events(False), probe.loop_events(True)
    assert plain == ["wgmma", "wait0", "ex2", "wgmma", "wait0"]
    assert rotated == plain  # a Triton that defers the wait would change this


def test_gluon_spike_overlaps_softmax_and_gemm_without_spills():
    """In its own process: Gluon's standard library cannot be imported where triton.language
    was decorated for the interpreter, as in this test session."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, str(BENCHMARKS / "gluon_forward_spike.py")],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2, result.stdout
    for line in lines:
        assert line.endswith("loop: wgmma -> wait1 -> ex2 -> wait0"), line
        assert " 0 bytes spilled" in line, line
