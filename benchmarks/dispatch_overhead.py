"""Host cost of a cached flexfa call on a GPU, at a tiny shape, against SDPA.

Times N back-to-back calls (host clock, one synchronize at the end) of each of
``host_cost.py``'s cases (B=1, H=2, L=S=128, E=64, bf16: dense, causal block mask, sliding
window method with an alibi score_mod reading a captured tensor, document mask, causal with
q, k, v requiring grad, forward only) on a shape whose kernel takes a few microseconds, next
to SDPA and ``torch.empty_like``; the difference is flexfa's per-call work. ``--tree PATH``
times the flexfa under PATH instead of this checkout (e.g. ``git archive 61b247e | tar -x -C
/tmp/old``), so two trees are compared by two runs on one host. Prints a table (median of
``--rounds`` rounds and the fastest) and writes JSON to ``--json``.

    timeout 300 python benchmarks/dispatch_overhead.py [--calls 2000] [--rounds 5]
        [--tree PATH] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("calls_positional", nargs="?", type=int, default=None,
                        help=argparse.SUPPRESS)  # the old form: dispatch_overhead.py 2000
    parser.add_argument("--calls", type=int, default=2000, help="calls per round (2000)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (5)")
    parser.add_argument("--tree", default=None, help="a directory holding another flexfa")
    parser.add_argument("--json", default=None, help="write the results to this file")
    args = parser.parse_args(argv)
    if args.calls_positional is not None:
        args.calls = args.calls_positional
    return args


def per_call_us(fn, calls: int, rounds: int) -> tuple[float, float]:
    """(median, fastest) over rounds of host microseconds per call, synchronized per round."""
    import torch

    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times), min(times)


def main(argv=None) -> dict:
    args = parse_args(argv)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)  # host_cost's cases
    sys.path.insert(0, os.path.abspath(args.tree) if args.tree else os.path.dirname(here))
    import torch
    import torch.nn.functional as F

    import flexfa
    from host_cost import make_cases

    cases = make_cases(flexfa, torch, "cuda")
    q = torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16)
    results = {"flexfa": os.path.dirname(flexfa.__file__), "gpu": torch.cuda.get_device_name(),
               "calls": args.calls, "rounds": args.rounds, "us": {}, "min_us": {}}
    timed = {**{f"flexfa_{name}": fn for name, fn in cases.items()},
             "sdpa": lambda: F.scaled_dot_product_attention(q, q, q),
             "empty_like": lambda: torch.empty_like(q)}
    first = next(iter(cases.values()))  # host and GPU clocks up before the first case
    warm_until = time.perf_counter() + 0.5
    with torch.no_grad():
        while time.perf_counter() < warm_until:
            first()
    print(f"flexfa from {results['flexfa']} on {results['gpu']}")
    print(f"{'case':22} {'median us':>9} {'min us':>7}")
    for name, fn in timed.items():
        with torch.set_grad_enabled(name.endswith("_grad")):
            median, fastest = per_call_us(fn, args.calls, args.rounds)
        results["us"][name], results["min_us"][name] = median, fastest
        print(f"{name:22} {median:9.1f} {fastest:7.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
