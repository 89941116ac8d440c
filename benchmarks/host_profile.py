"""Where the host time of a training step goes, flexfa against FlexAttention (compiled).

At S = 2048, E = 64 on the H200 a fwd+bwd step's kernels take under a millisecond and the
host's work to enqueue them sets the step time. For each variant this keeps the GPU busy
(``torch.cuda._sleep``) while the host enqueues ``steps`` steps, so the host clock measures
only the host: forward alone, and forward + backward, for flexfa and for FlexAttention. Then
cProfile of flexfa's steps (sorted by own time) shows which Python and launcher calls cost.

    PYTHONPATH=. python benchmarks/host_profile.py [S] [D] [variants] [steps]
"""
from __future__ import annotations

import cProfile
import io
import pstats
import sys

import torch

from host_common import host_us, variant_pair


def main() -> None:
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    S = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
    D = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    names = sys.argv[3].split(",") if len(sys.argv) > 3 else ["causal", "document"]
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 50
    B, H = max(1, 16384 // S), 16
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)
    compiled = torch.compile(torch_flex, dynamic=False)
    for name in names:
        impls = variant_pair(name, q, k, v, compiled)[0]
        for label, fn in impls.items():
            def step(fn=fn):
                fn().backward(do)
                q.grad = k.grad = v.grad = None
            with torch.no_grad():
                fwd = host_us(fn, steps)
            both = host_us(step, steps)
            print(f"{name:9} {label:7} host us per call: fwd {fwd:7.1f}  fwd+bwd {both:7.1f}",
                  flush=True)
            if label != "flexfa":
                continue
            profile = cProfile.Profile()
            torch.cuda._sleep(400_000_000)
            profile.enable()
            for _ in range(steps):
                step()
            profile.disable()
            torch.cuda.synchronize()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(28)
            print(text.getvalue(), flush=True)


if __name__ == "__main__":
    main()
