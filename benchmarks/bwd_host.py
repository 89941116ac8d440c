"""CPU: the Python host time of a cached backward (``FlexAttentionFunction.backward``), kernels stubbed.

Each case runs one real fwd+bwd under Triton's interpreter (which makes the plans), then
replaces ``Step.launch`` with a no-op and times ``FlexAttentionFunction.backward`` alone
(a wrapper around it, the autograd engine outside) over ``--calls`` fwd+bwd steps: the median
microseconds per backward call and the best median of a round of 20 calls (robust to other
processes on a shared machine), and with ``--profile`` cProfile of those backward calls sorted
by own time. What it measures is the work flexfa does on the host per backward call, at a
small shape on CPU tensors: a lower bound of what a GPU step's backward costs the host
(notes: the H200's 413 us at B=8 H=16 S=2048 E=64 also holds the launches themselves).

    TRITON_INTERPRET=1 python benchmarks/bwd_host.py [--cases dense,sliding,...] [--calls 200]
        [--profile [--sort cumulative]] [--json out.json]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import time

CASES = ("dense", "sliding", "alibi", "alibi_grad", "gqa", "sliding_det_grad")  # _grad: learnable


def case_names(text: str) -> list[str]:
    """``--cases``: comma-separated names from ``CASES``."""
    names = text.split(",")
    wrong = [name for name in names if name not in CASES]
    if wrong:
        raise argparse.ArgumentTypeError(f"unknown case(s) {wrong}; choose from {list(CASES)}")
    return names


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=case_names, default=list(CASES),
                        help=f"comma-separated, of {','.join(CASES)} (default all)")
    parser.add_argument("--calls", type=int, default=200, help="timed backward calls (200)")
    parser.add_argument("--profile", action="store_true", help="cProfile the timed calls")
    parser.add_argument("--sort", default="tottime", help="cProfile's order (tottime)")
    parser.add_argument("--json", default=None, help="write the medians to this path")
    return parser.parse_args(argv)


def make_case(name: str):
    """(q, k, v, kwargs, extra leaves) for one case: B=1, H=2, S=128, E=16, float32."""
    import torch

    import flexfa

    torch.manual_seed(0)
    hkv = 1 if name == "gqa" else 2
    q = torch.randn(1, 2, 128, 16, requires_grad=True)
    k, v = (torch.randn(1, hkv, 128, 16, requires_grad=True) for _ in range(2))
    kwargs, leaves = {}, []
    if name == "gqa":
        kwargs["enable_gqa"] = True
    if name.startswith("sliding"):
        kwargs["block_mask"] = flexfa.create_block_mask(flexfa.mods.sliding_window(32), 1, None,
                                                        128, 128, BLOCK_SIZE=32)
    if name.startswith("alibi") or name.endswith("grad"):
        slopes = torch.rand(2, requires_grad=name.endswith("grad"))
        leaves = [slopes] if slopes.requires_grad else []

        def alibi(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx)
        kwargs["score_mod"] = alibi
    if name.endswith("det_grad"):
        kwargs["kernel_options"] = {"deterministic": True}
    return q, k, v, kwargs, leaves


def run_case(name: str, calls: int, profile: bool, sort: str = "tottime") -> dict:
    import torch

    import flexfa
    from flexfa.autograd import FlexAttentionFunction
    from flexfa.runtime import launch

    q, k, v, kwargs, leaves = make_case(name)

    def step():
        out = flexfa.flex_attention(q, k, v, **kwargs)
        out.backward(grad)
    grad = torch.randn(q.shape[0], q.shape[1], q.shape[2], v.shape[3])
    step()  # the real first call: plans, generated modules, the interpreter
    original_backward = FlexAttentionFunction.backward
    original_launch = launch.Step.launch
    times, profiler = [], cProfile.Profile() if profile else None

    def timed_backward(ctx, *grads):
        if profiler is not None:
            profiler.enable()
        start = time.perf_counter_ns()
        result = original_backward(ctx, *grads)
        times.append(time.perf_counter_ns() - start)
        if profiler is not None:
            profiler.disable()
        return result
    FlexAttentionFunction.backward = staticmethod(timed_backward)
    launch.Step.launch = lambda self, args, device: None
    try:
        for _ in range(20):
            step()
        times.clear()
        if profiler is not None:
            profiler = cProfile.Profile()
        for _ in range(calls):
            step()
    finally:
        FlexAttentionFunction.backward = staticmethod(original_backward)
        launch.Step.launch = original_launch
    # rounds of 20 calls: the best round's median is robust to other processes on the machine
    rounds = [statistics.median(times[i:i + 20]) for i in range(0, len(times) - 19, 20)]
    result = {"case": name, "backward_us": statistics.median(times) / 1e3,
              "best_round_us": min(rounds) / 1e3}
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(sort).print_stats(25)
        result["profile"] = text.getvalue()
    return result


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    results = []
    for name in args.cases:
        result = run_case(name, args.calls, args.profile, args.sort)
        print(f"{name:18s} backward median {result['backward_us']:7.1f} us, best round "
              f"{result['best_round_us']:7.1f} us", flush=True)
        if "profile" in result:
            print(result.pop("profile"))
        results.append(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
