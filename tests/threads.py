"""Threads started together, with Python switching between them every few microseconds so
that their steps interleave (the thread-safety tests' harness)."""
import sys
import threading


def run_in_threads(target, args: list[tuple], switch_interval: float = 1e-6) -> None:
    """Run ``target(*a)`` for each ``a`` in ``args``, one thread each, and wait for all."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(switch_interval)
    try:
        threads = [threading.Thread(target=target, args=a) for a in args]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(previous)
