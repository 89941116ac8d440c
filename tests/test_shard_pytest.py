"""scripts/shard_pytest.py: ids dealt into shards, summaries summed, failures reported."""
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
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


def test_processes_takes_a_count_or_auto():
    assert shard_pytest.processes("3") == 3
    assert 1 <= shard_pytest.processes("auto") <= 8
    for bad in ("0", "-2", "two"):
        with pytest.raises(Exception, match="-n takes a count >= 1 or auto"):
            shard_pytest.processes(bad)


def test_by_file_runs_each_file_once_in_one_process(tmp_path):
    # four files in two directories whose module fixture records the process that set it up:
    # each file's tests run in one process, every test runs once, and a failure fails the
    # run. The sleeps make the usual order: one process takes a/test_a1 (slow), the other
    # a/test_a2 and b/test_b1 (slower); the first then skips those and takes b/test_b2, so it
    # must have torn down directory a's collector at the tests it skipped
    for name, sleep in (("a/test_a1", 2), ("a/test_a2", 0), ("b/test_b1", 3), ("b/test_b2", 0)):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / f"{name}.py").write_text(
            "import os, time, pytest\n"
            "@pytest.fixture(scope='module')\n"
            "def setup_once():\n"
            f"    with open('setups.txt', 'a') as f: f.write('{name} %d\\n' % os.getpid())\n"
            "@pytest.mark.parametrize('n', range(3))\n"
            "def test_n(setup_once, n):\n"
            f"    time.sleep({sleep} if n == 0 else 0)\n"
            f"    assert '{name}' != 'b/test_b2' or n != 2\n")
    done = subprocess.run([sys.executable, str(SCRIPT), "-n", "2", "--by-file", "--logs",
                           str(tmp_path / "logs" / "log"), "--", "."],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAILED b/test_b2.py::test_n[2]" in done.stdout
    assert "ERROR" not in done.stdout, done.stdout
    assert done.stdout.splitlines()[-1].startswith("1 failed, 11 passed"), done.stdout
    setups = (tmp_path / "setups.txt").read_text().split()
    assert sorted(setups[0::2]) == ["a/test_a1", "a/test_a2", "b/test_b1", "b/test_b2"]
    (tmp_path / "b" / "test_b2.py").unlink()
    (tmp_path / "setups.txt").unlink()
    done = subprocess.run([sys.executable, str(SCRIPT), "-n", "4", "--by-file", "--logs",
                           str(tmp_path / "logs" / "again"), "--", "a"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1].startswith("6 passed in")
    assert "over 2 processes" in done.stdout.splitlines()[-1]  # no more processes than files
