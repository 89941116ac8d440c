"""Where a fwd+bwd step's time goes: per-kernel CUDA time (torch.profiler) against the wall
time per step, for flexfa and FlexAttention on a few variants.

    PYTHONPATH=. python benchmarks/bwd_profile.py [S] [D] [variants] [impls]

(impls: "flexfa,flex" by default; "flexfa" alone skips FlexAttention's compile)
"""
from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import flexfa
from flexfa.bench import _variants


def main() -> None:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    S = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
    D = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    names = sys.argv[3].split(",") if len(sys.argv) > 3 else ["causal", "sliding", "alibi"]
    wanted = sys.argv[4].split(",") if len(sys.argv) > 4 else ["flexfa", "flex"]
    B, H = max(1, 16384 // S), 16
    compiled = torch.compile(flex_attention, dynamic=False)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)
    for name in names:
        score_mod, mask_mod = _variants(S, H, "cuda")[name]
        fbm = flexfa.create_block_mask(mask_mod, B, None, S, S, device="cuda") \
            if mask_mod else None
        tbm = create_block_mask(mask_mod, B, None, S, S, device="cuda") if mask_mod else None
        impls = {"flexfa": lambda: flexfa.flex_attention(q, k, v, score_mod, fbm),
                 "flex": lambda: compiled(q, k, v, score_mod=score_mod, block_mask=tbm)}
        for label, fn in impls.items():
            if label not in wanted:
                continue

            def step():  # fresh gradients each step, as the benchmark's do_bench(grad_to_none)
                q.grad = k.grad = v.grad = None
                fn().backward(do)
            for _ in range(5):
                step()
            torch.cuda.synchronize()
            steps = 20
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                start = time.perf_counter()
                for _ in range(steps):
                    step()
                torch.cuda.synchronize()
                wall = (time.perf_counter() - start) / steps * 1e3
            kernels: dict[str, float] = {}
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    key = e.name[:60]
                    kernels[key] = kernels.get(key, 0.0) + e.device_time / steps / 1e3
            gpu = sum(kernels.values())
            print(f"{name:8} {label:7} wall {wall:.3f} ms/step, kernels {gpu:.3f} ms/step")
            for key, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:6]:
                print(f"    {ms:.3f}  {key}")


if __name__ == "__main__":
    main()
