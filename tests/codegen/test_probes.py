"""The two CPU-only probes behind docs/performance.md's account of the forward's limits
(compiled for sm_90, no GPU): plain Triton 3.6 waits for a wgmma right after issuing it even
when its result is used one iteration later, and the Gluon spike's loop does overlap the
softmax with a GEMM (issue, wait for all but one group, exponentials, wait for the rest)."""
import os
import subprocess
import sys
from pathlib import Path

EXPERIMENTS = Path(__file__).resolve().parents[2] / "benchmarks" / "experiments"


def _run_probe(script: str, tmp_path) -> subprocess.CompletedProcess:
    """Run a benchmark script in its own process, compiling (not interpreting) with an empty
    Triton cache. Never in this process: a compile where triton.language was decorated for
    the interpreter calls its interpreted ``@jit`` functions (``tl.max``, ``tl.sum``), which
    patch triton.language for the interpreter for good, and every later compile fails."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": "",
           "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    return subprocess.run([sys.executable, str(EXPERIMENTS / script)], capture_output=True,
                          text=True, env=env, timeout=300)


def test_triton_waits_for_the_next_tiles_gemm_before_the_softmax(tmp_path):
    result = _run_probe("wgmma_wait_probe.py", tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    events = {line.split()[0]: line.split(":", 1)[1].split(" -> ")
              for line in result.stdout.strip().splitlines()}
    plain = ["wgmma", "wait0", "ex2", "wgmma", "wait0"]
    assert [w.strip() for w in events["plain"]] == plain, result.stdout
    # a Triton that defers the wait would change this
    assert [w.strip() for w in events["rotated"]] == plain, result.stdout


def test_gluon_spike_overlaps_softmax_and_gemm_without_spills(tmp_path):
    """In its own process: Gluon's standard library cannot be imported where triton.language
    was decorated for the interpreter, as in this test session."""
    result = _run_probe("gluon_forward_spike.py", tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2, result.stdout
    for line in lines:
        assert line.endswith("loop: wgmma -> wait1 -> ex2 -> wait0"), line
        assert " 0 bytes spilled" in line, line
