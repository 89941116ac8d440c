"""The README's test command (scripts/test.sh, which .ci/run runs) uses empty Triton and
flexfa caches of its own, so no test can pass only because a cache was warm."""
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_test_script_runs_on_fresh_empty_caches(tmp_path):
    env = dict(os.environ, EMPTY_CACHES_REPORT=str(tmp_path / "seen"))
    for name in ("TRITON_CACHE_DIR", "FLEXFA_CACHE_DIR"):
        warm = tmp_path / name.lower()
        warm.mkdir()
        (warm / "left_by_an_earlier_run").write_text("warm")
        env[name] = env["CALLER_" + name] = str(warm)
    result = subprocess.run(["bash", "scripts/test.sh", "tests/reliability/empty_caches_check.py"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "1 passed" in result.stdout, result.stdout[-2000:]
    used = (tmp_path / "seen").read_text().splitlines()
    assert len(used) == 2 and not any(map(os.path.exists, used)), "caches not removed at exit"
