"""GPU: the host's cost of one fwd+bwd call on the Triton and on the Gluon backward (issue 26:
on small sparse masks the Gluon backward measured 1.4-1.6 ms whatever the mask, the Triton
backward 0.6-1.5 ms: sparse_bwd.py). Per configuration: the host's time to queue a step
(no sync), the wall time of a synced step, then a cProfile of 20 steps (top functions).

    python benchmarks/experiments/gluon_bwd_host.py [--window 256] [--top 30]
"""
import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    import torch

    import flexfa

    S, H, E, w = args.seq, 16, 128, args.window
    q, k, v = (torch.randn(1, H, S, E, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)
    mask = flexfa.create_block_mask(lambda b, h, qi, ki: (qi >= ki) & (qi - ki < w), None, None,
                                    S, S, device="cuda")
    configs = {"triton": {"GLUON_BACKWARD": False}, "gluon": {"GLUON_BACKWARD": True},
               "gluon_c1": {"GLUON_BACKWARD": True, "GLUON_BWD_DQ_CHUNKS": 1},
               "gluon_serial": {"GLUON_BACKWARD": True, "GLUON_BWD_OVERLAP": False}}
    for label, opts in configs.items():
        def step():
            flexfa.flex_attention(q, k, v, block_mask=mask, kernel_options=opts).backward(do)
            for t in (q, k, v):
                t.grad = None
        for _ in range(10):
            step()
        torch.cuda.synchronize()
        n = 30
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        host = (time.perf_counter() - t0) / n
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / n
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        print(f"{label:13s} host {host * 1e3:.3f} ms/step  wall {wall * 1e3:.3f} ms/step  "
              f"one step (events) {start.elapsed_time(end):.3f} ms", flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20):
            step()
        prof.disable()
        torch.cuda.synchronize()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
        print("\n".join(out.getvalue().splitlines()[:args.top + 12]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
