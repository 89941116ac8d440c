"""The cache under concurrency: 4 processes racing on one new kernel, threads running
different mods at once."""
import multiprocessing
import sys
import threading
import time

import torch

import flexfa
from flexfa.runtime import cache
from threads import run_in_threads
from .inputs import assert_matches_reference, qkv
from .workers import attend_once

# twice the CI machine's cores: all wait at one barrier, then race for the lock; each more
# process costs an import of torch and flexfa (about 3 s of CPU)
PROCESSES = 4


def _check_files(directory, problems: list) -> int:
    """Verify every kernel file in ``directory`` (complete, checksum right); how many."""
    paths = list(directory.glob("flexfa_fwd_*.py"))
    for path in paths:
        try:
            key = path.read_text().partition(" key=")[2].split(" ")[0]
            source, problem = cache.read_source(path, key)
        except Exception as exc:  # a torn file may fail in any way: record it
            source, problem = None, repr(exc)
        if source is None:
            problems.append(f"{path.name}: {problem}")
    return len(paths)


def _watch_for_torn_files(directory, stop: threading.Event, problems: list) -> None:
    """Read every kernel file that appears while the processes run: each must be complete."""
    while not stop.is_set():
        _check_files(directory, problems)
        time.sleep(0.005)


def test_processes_started_at_once_share_one_generation(tmp_path):
    directory = tmp_path / "cache"  # empty: nobody has generated this mod yet
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(PROCESSES), context.Queue()
    workers = [context.Process(target=attend_once, args=(str(directory), barrier, results))
               for _ in range(PROCESSES)]
    for worker in workers:
        worker.start()
    stop, torn = threading.Event(), []
    watcher = threading.Thread(target=_watch_for_torn_files, args=(directory, stop, torn))
    watcher.start()
    try:
        reports = [results.get(timeout=280) for _ in workers]
    finally:
        stop.set()
        watcher.join()
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.kill()
    failures = [r["traceback"] for r in reports if "traceback" in r]
    assert not failures, failures[0]
    assert [w.exitcode for w in workers] == [0] * PROCESSES
    assert all(r["error"] < 1e-5 for r in reports), [r["error"] for r in reports]
    assert not [r["warnings"] for r in reports if r["warnings"]], "a process saw a bad file"
    assert sum(r["codegen"] for r in reports) == 1, [r["codegen"] for r in reports]
    assert sum(r["disk_hits"] for r in reports) == PROCESSES - 1
    assert _check_files(directory, torn) == 1
    assert not torn, torn
    assert not list(directory.glob(".*.tmp")), "temporary files left behind"


def _thread_mod(i: int):
    def mod(score, b, h, q_idx, kv_idx):
        return score + ((kv_idx * (i + 1)) % 7) * 0.5 - h * i * 0.25
    mod.__name__ = f"thread_mod_{i}"
    return mod


def test_threads_with_different_mods_get_their_own_results(fresh_cache):
    """Each thread's result is its own mod's, on a fresh cache (all threads generate at once)
    and again from the memo. A short switch interval makes the threads interleave inside
    kernel launches, where Triton's interpreter keeps global state."""
    q, k, v = qkv(B=2, Hq=2, Hkv=2, L=100, S=72, E=16)
    mods = [_thread_mod(i) for i in range(6)]
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    try:
        for _ in range(2):
            outputs, errors = {}, []

            def work(i):
                try:
                    outputs[i] = flexfa.flex_attention(q, k, v, score_mod=mods[i])
                except BaseException as exc:  # reported below
                    errors.append(exc)

            threads = [threading.Thread(target=work, args=(i,)) for i in range(len(mods))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert not errors, errors[0]
            for i, mod in enumerate(mods):
                assert_matches_reference(outputs[i], q, k, v, mod)
    finally:
        sys.setswitchinterval(previous)
    assert cache.STATS.codegen == len(mods)
    assert not torch.equal(outputs[0], outputs[1])


def test_threads_running_backward_get_their_own_gradients(fresh_cache):
    """Forward and backward launches of several threads interleave; each thread's gradients
    (including a captured tensor's) are its own mod's."""
    q, k, v = qkv(L=40, S=56)
    biases = [torch.linspace(-1, 1, 8) * (i + 1) for i in range(3)]

    def make(bias):
        def biased(score, b, h, q_idx, kv_idx):
            return score + bias[(q_idx + kv_idx) % 8]
        return biased

    def grads(bias, q, k, v):
        bias = bias.clone().requires_grad_()
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        out = flexfa.flex_attention(q, k, v, score_mod=make(bias))
        out.pow(2).sum().backward()
        return [t.grad for t in (q, k, v, bias)]

    expected = [grads(b, q, k, v) for b in biases]  # one thread: the known-good answers
    cache.clear_memo()
    results, errors = {}, []

    def work(i):
        try:
            results[i] = grads(biases[i], q, k, v)
        except BaseException as exc:  # reported below
            errors.append(exc)

    run_in_threads(work, [(i,) for i in range(len(biases))], switch_interval=1e-4)
    assert not errors, errors[0]
    for i, want in enumerate(expected):
        for got, ref in zip(results[i], want):
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
