"""benchmarks/shard_pytest.py: ids dealt into shards, summaries summed, failures reported."""
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import shard_pytest  # noqa: E402

SCRIPT = Path(shard_pytest.__file__)


def test_deal_round_robin_and_no_empty_shard():
    assert shard_pytest.deal(list("abcde"), 2) == [["a", "c", "e"], ["b", "d"]]
    assert shard_pytest.deal(["a"], 4) == [["a"]]
    with pytest.raises(ValueError, match="shards must be >= 1, got 0"):
        shard_pytest.deal(["a"], 0)


def test_summed_adds_the_last_summary_of_each_log():
    logs = ["x\n1 failed, 3 passed in 2.0s\n", "4 passed, 1 skipped in 1.0s\n", "1 error\n"]
    assert shard_pytest.summed(logs) == {"failed": 1, "passed": 7, "skipped": 1, "errors": 1}


def test_a_failing_shard_fails_the_run(tmp_path):
    (tmp_path / "test_tiny.py").write_text(
        "import pytest\n"
        "@pytest.mark.parametrize('n', range(5))\n"
        "def test_n(n):\n    assert n != 3\n")
    done = subprocess.run([sys.executable, str(SCRIPT), "-n", "2", "--logs",
                           str(tmp_path / "logs" / "log"), "--", "test_tiny.py"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAILED test_tiny.py::test_n[3]" in done.stdout
    assert done.stdout.splitlines()[-1].startswith("1 failed, 4 passed")
    assert sorted(p.name for p in (tmp_path / "logs").glob("log.*.log")) == ["log.0.log",
                                                                             "log.1.log"]
