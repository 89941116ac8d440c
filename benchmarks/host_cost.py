"""CPU: the host (Python) cost of a cached ``flex_attention`` call, with the launch stubbed out.

Each case makes its call once (the plan is made and the kernel runs once under the Triton
interpreter), then the plan's launches are replaced by the CUDA cached path's
``launch_direct`` into a compiled kernel that does nothing, so what is timed is flexfa's
Python work per call on the path the H200 takes (the Hopper forward family: checks, trace
and mask lookups, plan key and lookup, outputs, tensor descriptors, argument binding, the
launcher call) on CPU tensors. A GPU adds the CUDA allocations and the launch itself
(``dispatch_overhead.py`` times the whole call there). Cases (B=1, H=2, L=S=128, E=64, bf16):
dense; causal block mask; sliding window (a method reading ``self.window``) with an alibi
score_mod reading a captured slopes tensor; document mask (a captured document-id tensor);
causal with q, k, v requiring grad (the forward of the autograd Function, no backward).
Prints microseconds per call (median and fastest of ``--rounds`` rounds of ``--calls``
calls) and the flexfa functions one call enters (``sys.setprofile``; independent of the
machine's load).

``--tree PATH`` times the flexfa package under PATH instead of this checkout (a directory
holding ``flexfa``, e.g. ``git archive 61b247e | tar -x -C /tmp/old``); trees from before the
kernel-family registry (``flexfa.runtime.hopper._PLANS``) are stubbed the same way.

    python benchmarks/host_cost.py [--calls 2000] [--rounds 7] [--tree PATH] [--profile CASE]
        [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

CASES = ("dense", "causal", "sliding_alibi", "document", "causal_grad")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per round (2000)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds; the median is shown (7)")
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated, of {','.join(CASES)}")
    parser.add_argument("--tree", default=None, help="a directory holding another flexfa")
    parser.add_argument("--profile", default=None, metavar="CASE",
                        help="also print cProfile's top functions of this case")
    parser.add_argument("--json", default=None, help="write the results to this file")
    args = parser.parse_args(argv)
    args.cases = args.cases.split(",")
    unknown = sorted(set(args.cases) - set(CASES))
    if unknown:
        parser.error(f"--cases: unknown {unknown}; choose from {list(CASES)}")
    return args


class StubCompiled:
    """Stands in for Triton's CompiledKernel: launching it does nothing."""

    function = packed_metadata = None

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, *args):
        return None


def make_cases(flexfa, torch, device="cpu") -> dict:
    """name -> a function making one call, on fresh inputs of the probe's shape on
    ``device`` (``dispatch_overhead.py`` times the same cases on a GPU)."""
    q, k, v = (torch.randn(1, 2, 128, 64, dtype=torch.bfloat16, device=device)
               for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    class Sliding:
        def __init__(self, window):
            self.window = window

        def mask_mod(self, b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx <= self.window)

    slopes = torch.exp2(-torch.arange(1, 3, dtype=torch.float32, device=device))

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    documents = torch.arange(128, device=device) // 40

    def document(b, h, q_idx, kv_idx):
        return documents[q_idx] == documents[kv_idx]

    def mask(mask_mod):
        return flexfa.create_block_mask(mask_mod, 1, None, 128, 128, device=device)

    causal_mask, sliding, doc_mask = mask(causal), mask(Sliding(32).mask_mod), mask(document)
    attention = flexfa.flex_attention
    return {"dense": lambda: attention(q, k, v),
            "causal": lambda: attention(q, k, v, block_mask=causal_mask),
            "sliding_alibi": lambda: attention(q, k, v, alibi, block_mask=sliding),
            "document": lambda: attention(q, k, v, block_mask=doc_mask),
            "causal_grad": lambda: attention(qg, kg, vg, block_mask=causal_mask)}


def stub_launches(flexfa, torch) -> None:
    """Make every cached plan launch a do-nothing compiled kernel through ``launch_direct``,
    as the CUDA cached path does (``torch.cuda.current_device`` reads as the CPU's None)."""
    import importlib

    launch = importlib.import_module("flexfa.runtime.launch")
    torch.cuda.current_device = lambda: None
    torch._C._cuda_getCurrentRawStream = lambda index: 0
    stub = launch.DirectState(StubCompiled(), ())
    step_type = getattr(launch, "Step", None)
    if step_type is not None:  # one launch path: Step
        plans = importlib.import_module("flexfa.runtime.plans")
        for plan in plans.PLANS.values():
            for step in plan.steps:
                step.direct = stub

        def cached_launch(self, args, device, _launch=step_type.launch):
            if self.direct is not None and device.index == torch.cuda.current_device():
                launch.launch_direct(self.direct, self.grid, device.index, args)
                return
            _launch(self, args, device)
        step_type.launch = cached_launch
        return
    hopper = importlib.import_module("flexfa.runtime.hopper")  # before the registry
    for plan in hopper._PLANS.values():
        plan.direct = stub


def per_call_us(fn, calls: int, rounds: int) -> tuple[float, float]:
    """(median, fastest) over ``rounds`` rounds of microseconds per call; on a shared machine
    the fastest round is the one least disturbed."""
    for _ in range(50):
        fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times), min(times)


def functions_entered(fn, root: str, calls: int = 20) -> float:
    """flexfa's Python functions (those in files under ``root``) entered per call: a measure
    of the Python work that the machine's load does not blur."""
    count = 0

    def hook(frame, event, arg):
        nonlocal count
        if event == "call" and frame.f_code.co_filename.startswith(root):
            count += 1
    sys.setprofile(hook)
    try:
        for _ in range(calls):
            fn()
    finally:
        sys.setprofile(None)
    return count / calls


def profile(fn, calls: int) -> None:
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    print(text.getvalue())


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ["FLEXFA_BACKEND"] = "HOPPER"  # the H200's family, under the interpreter
    os.environ["FLEXFA_FORWARD_TEMPLATE"] = "hopper"  # the same, in trees before the registry
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.abspath(args.tree) if args.tree else here)
    import torch

    import flexfa

    cases = make_cases(flexfa, torch)
    for name in args.cases:
        cases[name]()  # plans made, kernels run once (interpreted)
    stub_launches(flexfa, torch)
    results = {"flexfa": os.path.dirname(flexfa.__file__), "calls": args.calls,
               "rounds": args.rounds, "us": {}}
    print(f"flexfa from {results['flexfa']}")
    print(f"{'case':16} {'median us':>9} {'min us':>7} {'functions':>9}")
    for name in args.cases:
        with torch.set_grad_enabled(name.endswith("_grad")):
            us, fastest = per_call_us(cases[name], args.calls, args.rounds)
            results["us"][name] = us
            results.setdefault("min_us", {})[name] = fastest
            functions = functions_entered(cases[name], results["flexfa"])
            results.setdefault("functions_entered", {})[name] = functions
            print(f"{name:16} {us:9.1f} {fastest:7.1f} {functions:9.0f}", flush=True)
            if args.profile == name:
                profile(cases[name], args.calls)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
