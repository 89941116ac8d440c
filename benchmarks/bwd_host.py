"""Host time of a cached backward (``FlexAttentionFunction.backward``), kernel launches stubbed.

Each case runs one real fwd+bwd (on the CPU under Triton's interpreter), which makes the
plans, then times ``FlexAttentionFunction.backward`` alone (a wrapper around it, the autograd
engine outside) over ``--calls`` fwd+bwd steps with ``Step.launch`` replaced by a no-op: the
median microseconds per backward call and the best median of a round of 20 calls (robust to
other processes on a shared machine); ``--profile``: cProfile of those calls. That is the
work flexfa does on the host per backward call besides launching. With ``--device cuda``
(bf16, default B=8 H=16 S=2048 E=64, the shape of notes' H200 timeline) each case is timed
twice, launches stubbed and real: the difference is what the launches themselves cost the
host (no backward syncs: tests/kernels/test_backward_host.py); the real run also lists each
launched step (forward and backward) with whether it takes ``launch_direct`` and Triton's C
launch function itself (``c_launch``; else Triton's Python launcher, which encodes every
tensor descriptor on every call).

    TRITON_INTERPRET=1 python benchmarks/bwd_host.py [--cases dense,sliding,...] [--calls 200]
        [--profile [--sort cumulative]] [--json out.json]
    timeout 300 python benchmarks/bwd_host.py --device cuda --json out.json
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
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cpu (float32, the interpreter; default) or cuda (bf16)")
    parser.add_argument("--shape", default=None, type=lambda t: tuple(map(int, t.split(","))),
                        help="B,H,S,E (default 1,2,128,16 on cpu, 8,16,2048,64 on cuda)")
    return parser.parse_args(argv)


def make_case(name: str, device: str = "cpu", shape: tuple | None = None):
    """(q, k, v, kwargs, extra leaves) for one case: float32 on the CPU, bf16 on a GPU; the
    sliding window is S / 4 wide; GQA has half the heads in k, v."""
    import torch

    import flexfa

    B, H, S, E = shape or ((1, 2, 128, 16) if device == "cpu" else (8, 16, 2048, 64))
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    hkv = H // 2 if name == "gqa" else H

    def leaf(heads):
        return torch.randn(B, heads, S, E, device=device, dtype=dtype, requires_grad=True)
    q, k, v = leaf(H), leaf(hkv), leaf(hkv)
    kwargs, leaves = {}, []
    if name == "gqa":
        kwargs["enable_gqa"] = True
    if name.startswith("sliding"):
        block = 32 if device == "cpu" else 128
        kwargs["block_mask"] = flexfa.create_block_mask(
            flexfa.mods.sliding_window(S // 4), 1, None, S, S, device=device, BLOCK_SIZE=block)
    if name.startswith("alibi") or name.endswith("grad"):
        slopes = torch.rand(H, device=device, requires_grad=name.endswith("grad"))
        leaves = [slopes] if slopes.requires_grad else []

        def alibi(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx)
        kwargs["score_mod"] = alibi
    if name.endswith("det_grad"):
        kwargs["kernel_options"] = {"deterministic": True}
    return q, k, v, kwargs, leaves


def run_case(name: str, calls: int, profile: bool, sort: str = "tottime", device: str = "cpu",
             shape: tuple | None = None, stub: bool = True) -> dict:
    """Times one case's cached backward; ``stub``: kernel launches replaced by a no-op."""
    import torch

    import flexfa
    from flexfa.autograd import FlexAttentionFunction
    from flexfa.runtime import launch

    q, k, v, kwargs, leaves = make_case(name, device, shape)
    grad = torch.randn(*q.shape[:3], v.shape[3], device=device, dtype=q.dtype)

    def step():
        q.grad = k.grad = v.grad = None
        flexfa.flex_attention(q, k, v, **kwargs).backward(grad)
    step()  # the real first call: plans, generated modules, compiles or the interpreter
    launched = []  # the backward's steps: on a GPU, whether each takes the C launch fast path
    original_launch = launch.Step.launch

    def recording_launch(self, args, device, grid=None):
        launched.append(self)
        return original_launch(self, args, device, grid)
    launch.Step.launch = recording_launch
    try:
        step()
    finally:
        launch.Step.launch = original_launch
    original_backward = FlexAttentionFunction.backward
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
    if stub:
        launch.Step.launch = lambda self, args, device, grid=None: None
    try:
        for _ in range(20):
            step()
        times.clear()
        if profiler is not None:
            profiler = cProfile.Profile()
        for _ in range(calls):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
    finally:
        FlexAttentionFunction.backward = staticmethod(original_backward)
        launch.Step.launch = original_launch
    # rounds of 20 calls: the best round's median is robust to other processes on the machine
    rounds = [statistics.median(times[i:i + 20]) for i in range(0, len(times) - 19, 20)]
    result = {"case": name, "launches": "stubbed" if stub else "real",
              "backward_us": statistics.median(times) / 1e3, "best_round_us": min(rounds) / 1e3}
    if device == "cuda":  # direct: launch_direct; c_launch: Triton's C function itself
        result["steps"] = [{"step": repr(s), "direct": s.direct is not None,
                            "c_launch": s.direct is not None and s.direct.c_launch is not None,
                            "descriptors": len(s.direct.descriptors) if s.direct else 0}
                           for s in launched]
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(sort).print_stats(25)
        result["profile"] = text.getvalue()
    return result


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    results = []
    for name in args.cases:
        for stub in (True, False) if args.device == "cuda" else (True,):
            result = run_case(name, args.calls, args.profile, args.sort, args.device,
                              args.shape, stub)
            print(f"{name:18s} launches {result['launches']:7s} backward median "
                  f"{result['backward_us']:7.1f} us, best round {result['best_round_us']:7.1f} us",
                  flush=True)
            for launched in result.get("steps", ()) if not stub else ():
                print(f"   {launched}", flush=True)
            if "profile" in result:
                print(result.pop("profile"))
            results.append(result)
            if args.json:  # after every case: a time limit keeps what was measured
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
