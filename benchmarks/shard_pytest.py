"""Run one pytest selection in several processes that share one GPU, to spend device time on
kernels instead of waiting on one compile after another. For correctness tests only: timings
taken while other processes compile and run are meaningless, so timed tests stay serial.

    python benchmarks/shard_pytest.py -n 6 --logs /tmp/out/name -- -m gpu tests/gpu/test_x.py

The selection is collected once, its test ids dealt round robin into n shards (each shard
runs a module's fixtures once), each shard runs as `python -m pytest -q -rfE <ids>` (the ids
select: -m and -k act at collection only) with its log in `<logs>.<k>.log`. Prints every
shard's summary (and a failing shard's last lines), then one line `N failed, M passed ...`
summed over the shards; exits non-zero when any shard failed or nothing was collected.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)")


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=4, help="processes (default 4)")
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
    groups = deal(ids, args.n)
    os.makedirs(os.path.dirname(os.path.abspath(args.logs)), exist_ok=True)
    t0 = time.time()
    procs = []
    for k, group in enumerate(groups):
        log = open(f"{args.logs}.{k}.log", "w")
        procs.append((subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *group],
            stdout=log, stderr=subprocess.STDOUT), log))
    codes = [proc.wait() for proc, _ in procs]
    texts = []
    for k, (_, log) in enumerate(procs):
        log.close()
        with open(f"{args.logs}.{k}.log") as f:
            texts.append(f.read())
        summary = [line for line in texts[-1].splitlines() if _COUNT.search(line)]
        print(f"shard {k} ({len(groups[k])} tests) rc={codes[k]}: "
              f"{summary[-1].strip('= ') if summary else 'no summary'}")
        for line in texts[-1].splitlines():
            if line.startswith(("FAILED", "ERROR")):
                print(line)
        if codes[k] != 0:  # the shard's end: the failures' tracebacks, or a crash
            print("\n".join(texts[-1].splitlines()[-args.tail:]))
    counts = summed(texts)
    order = ("failed", "errors", "passed", "skipped", "xfailed", "xpassed")
    print(", ".join(f"{counts[word]} {word}" for word in order if word in counts) +
          f" in {time.time() - t0:.1f}s over {len(groups)} processes")
    return 0 if all(code == 0 for code in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
