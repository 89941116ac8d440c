"""Run one pytest selection in several processes: the CPU suite on a machine's cores (CI's
`scripts/test.sh`), or GPU correctness suites on one GPU, to spend device time on kernels
instead of waiting on one compile after another. Timings taken while other processes compile
and run are meaningless, so timed tests stay serial.

    python scripts/shard_pytest.py -n 6 --logs /tmp/out/name -- -m gpu tests/gpu/test_x.py
    python scripts/shard_pytest.py -n auto --by-file --logs /tmp/out/name -- -m "not gpu"

The selection is collected once. By default its test ids are dealt round robin into n shards,
each run as `python -m pytest -q -rfE <ids>` (the ids select: -m and -k act at collection
only). With --by-file every process runs the whole selection and takes test files from a
shared queue as it reaches them (a file's tests run in one process, its module fixtures
once; a process idles on nothing while files are left), which balances files of very
different cost without a table of durations. Each process logs to `<logs>.<k>.log`. Prints
every process's summary (and a failing one's last lines), then one line `N failed, M passed
...` summed over the processes; exits non-zero when any process failed, when nothing was
collected (5), or when the processes together reported fewer outcomes than tests collected.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import time

_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)")
QUEUE = "SHARD_PYTEST_QUEUE"  # the --by-file queue's directory, in each process's environment
_claims: dict[str, bool] = {}


def pytest_runtest_protocol(item, nextitem):
    """Plugin hook (this module loads into each --by-file process with -p): run a test only if
    this process claimed its file, the first process to reach the file claiming it by creating
    a file in the queue directory. Returning True tells pytest the test was handled, so an
    unclaimed test runs nowhere here and is reported by the process that claimed its file."""
    queue = os.environ.get(QUEUE)
    if not queue:
        return None
    path = item.nodeid.split("::", 1)[0]
    if path not in _claims:
        name = os.path.join(queue, hashlib.sha1(path.encode()).hexdigest())
        try:
            os.close(os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            _claims[path] = True
        except FileExistsError:
            _claims[path] = False
    if _claims[path]:
        return None
    # pytest tears a test's fixtures and collectors (module, package, directory) down only
    # as far as the next test needs them; the test after one that ran here may run elsewhere,
    # so whatever the next test does not need is torn down at each test skipped here (the
    # next test that runs here then starts from a stack that is a prefix of its own chain)
    item.session._setupstate.teardown_exact(nextitem)
    return True


def collect(pytest_args: list[str]) -> list[str]:
    """Test ids of the selection, in pytest's order."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", *pytest_args],
                          capture_output=True, text=True)
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    if not ids:
        sys.stdout.write(done.stdout[-2000:] + done.stderr[-2000:])
    return ids


def deal(ids: list[str], shards: int) -> list[list[str]]:
    """ids round robin into at most `shards` non-empty groups."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    groups = [ids[k::shards] for k in range(shards)]
    return [group for group in groups if group]


def summed(texts: list[str]) -> dict[str, int]:
    """Counts of the last pytest summary line of each log, added up."""
    total: dict[str, int] = {}
    for text in texts:
        lines = [line for line in text.splitlines() if _COUNT.search(line)]
        for number, word in _COUNT.findall(lines[-1] if lines else ""):
            word = "errors" if word.startswith("error") else word
            total[word] = total.get(word, 0) + int(number)
    return total


def processes(value: str) -> int:
    """-n: a count >= 1, or auto (the cores this process may use, at most 8)."""
    if value == "auto":
        return max(1, min(8, len(os.sched_getaffinity(0))))
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"-n takes a count >= 1 or auto, got {value!r}")
    return int(value)


def reported(counts: dict[str, int]) -> int:
    """Tests with an outcome in summed counts (an error in setup is a test's only outcome)."""
    return sum(counts.get(word, 0) for word in
               ("passed", "failed", "skipped", "xfailed", "xpassed", "errors"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=processes, default=4,
                        help="processes, or auto: the usable cores, at most 8 (default 4)")
    parser.add_argument("--by-file", action="store_true",
                        help="processes take whole test files from a shared queue")
    parser.add_argument("--logs", required=True, help="log path prefix: <logs>.<k>.log")
    parser.add_argument("--tail", type=int, default=60,
                        help="lines of a failing shard's log to print (default 60)")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER,
                        help="after --: the pytest selection and options")
    args = parser.parse_args(argv)
    pytest_args = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    ids = collect(pytest_args)
    if not ids:
        print("0 passed: nothing collected")
        return 5
    os.makedirs(os.path.dirname(os.path.abspath(args.logs)), exist_ok=True)
    base = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider"]
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="shard-pytest-queue.") as queue:
        if args.by_file:
            files = len({test_id.split("::", 1)[0] for test_id in ids})
            groups = [ids] * min(args.n, files)
            here = os.path.dirname(os.path.abspath(__file__))
            env.update({QUEUE: queue, "PYTHONPATH": os.pathsep.join(
                [here] + [p for p in [env.get("PYTHONPATH")] if p])})
            # torch's CPU threads split between the processes unless the caller chose
            env.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0))
                                                      // len(groups))))
            commands = [base + ["-p", "shard_pytest", *pytest_args]] * len(groups)
        else:
            groups = deal(ids, args.n)
            commands = [base + group for group in groups]
        t0 = time.time()
        procs = []
        for k, command in enumerate(commands):
            log = open(f"{args.logs}.{k}.log", "w")
            procs.append((subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                           env=env), log))
        codes = [proc.wait() for proc, _ in procs]
    texts = []
    for k, (_, log) in enumerate(procs):
        log.close()
        with open(f"{args.logs}.{k}.log") as f:
            texts.append(f.read())
        summary = [line for line in texts[-1].splitlines() if _COUNT.search(line)]
        size = "files from the queue" if args.by_file else f"{len(groups[k])} tests"
        print(f"shard {k} ({size}) rc={codes[k]}: "
              f"{summary[-1].strip('= ') if summary else 'no summary'}")
        for line in dict.fromkeys(texts[-1].splitlines()):  # -rfE and -ra list them twice
            if line.startswith(("FAILED", "ERROR")):
                print(line)
        if codes[k] != 0:  # the shard's end: the failures' tracebacks, or a crash
            print("\n".join(texts[-1].splitlines()[-args.tail:]))
    counts = summed(texts)
    order = ("failed", "errors", "passed", "skipped", "xfailed", "xpassed")
    print(", ".join(f"{counts[word]} {word}" for word in order if word in counts) +
          f" in {time.time() - t0:.1f}s over {len(groups)} processes")
    if reported(counts) < len(ids):  # (more: a module skipped whole reports one skip)
        print(f"{len(ids)} tests collected but {reported(counts)} reported by the processes")
        return 1
    return 0 if all(code == 0 for code in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
