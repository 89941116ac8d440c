"""Host and GPU timeline of one training step, flexfa against FlexAttention (compiled).

Where a step is host-bound, what counts is when each kernel is launched on the host against
when the GPU could have run it. Steps run back to back as ``do_bench`` runs them (gradients set
to None, a 256 MB cache clear, the step); torch.profiler records the host's launch calls and
the GPU's kernels of the last step. Printed per kernel: host time of its launch call and GPU
start / end, all in microseconds from the step's first host event; then, for flexfa, the
host time spent in its forward and backward functions (perf_counter, same steps).

    PYTHONPATH=. python benchmarks/step_timeline.py [S] [D] [variants]
"""
from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import flexfa
from flexfa.bench import _variants

_LAUNCHES = ("cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernel", "cudaLaunchKernelExC")


def _timeline(step, label: str) -> None:
    cache = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    for _ in range(5):
        cache.zero_()
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(4):
            cache.zero_()
            with torch.profiler.record_function("STEP"):
                step()
        torch.cuda.synchronize()
    events = list(prof.events())
    steps = sorted((e for e in events if e.name == "STEP" and e.device_type.name == "CPU"),
                   key=lambda e: e.time_range.start)
    last = steps[-1]
    t0, t1 = last.time_range.start, last.time_range.end
    launches = sorted((e for e in events if e.name in _LAUNCHES and t0 <= e.time_range.start <= t1),
                      key=lambda e: e.time_range.start)
    kernels = sorted((e for e in events if e.device_type.name == "CUDA"
                      and e.time_range.start >= t0 and "zero" not in e.name.lower()
                      and "fill" not in e.name.lower()), key=lambda e: e.time_range.start)
    print(f"-- {label}: host step {t1 - t0:.0f} us, {len(launches)} launches", flush=True)
    for e in launches:
        print(f"   host launch {e.name:20} at {e.time_range.start - t0:7.0f} "
              f"({e.time_range.end - e.time_range.start:5.0f} us)")
    for e in kernels[:12]:
        print(f"   gpu {e.name[:44]:44} {e.time_range.start - t0:7.0f} .. "
              f"{e.time_range.end - t0:7.0f}")


def main() -> None:
    from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    from flexfa import autograd as fa_autograd

    S = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
    D = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    names = sys.argv[3].split(",") if len(sys.argv) > 3 else ["causal", "document"]
    B, H = max(1, 16384 // S), 16
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)
    compiled = torch.compile(torch_flex, dynamic=False)
    spans = {"forward": [], "backward": []}
    original = {name: getattr(fa_autograd.FlexAttentionFunction, name) for name in spans}

    def timed(name):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            result = original[name](*args, **kwargs)
            spans[name].append(time.perf_counter() - start)
            return result
        return staticmethod(wrapper)
    for name in ("causal", "document", "full", "alibi"):
        if name not in names:
            continue
        score_mod, mask_mod = _variants(S, H, "cuda")[name]
        fbm = flexfa.create_block_mask(mask_mod, B, None, S, S, device="cuda") if mask_mod else None
        tbm = torch_block_mask(mask_mod, B, None, S, S, device="cuda") if mask_mod else None
        impls = {"flexfa": lambda: flexfa.flex_attention(q, k, v, score_mod, fbm),
                 "flex": lambda: compiled(q, k, v, score_mod=score_mod, block_mask=tbm)}
        for label, fn in impls.items():
            def step(fn=fn):
                q.grad = k.grad = v.grad = None
                fn().backward(do)
            _timeline(step, f"{name} {label}")
        for key in spans:
            spans[key].clear()
        # the same steps with flexfa's autograd functions timed on the host
        fa_autograd.FlexAttentionFunction.forward = timed("forward")
        fa_autograd.FlexAttentionFunction.backward = timed("backward")
        torch.cuda._sleep(200_000_000)
        start = time.perf_counter()
        for _ in range(30):
            q.grad = k.grad = v.grad = None
            flexfa.flex_attention(q, k, v, score_mod, fbm).backward(do)
        total = (time.perf_counter() - start) / 30 * 1e6
        torch.cuda.synchronize()
        for key in spans:
            setattr(fa_autograd.FlexAttentionFunction, key, staticmethod(original[key]))
        fwd = sorted(spans["forward"])[len(spans["forward"]) // 2] * 1e6
        bwd = sorted(spans["backward"])[len(spans["backward"]) // 2] * 1e6
        print(f"-- {name} flexfa host per step {total:.0f} us: Function.forward {fwd:.0f}, "
              f"Function.backward {bwd:.0f}, the rest (torch, autograd engine) "
              f"{total - fwd - bwd:.0f}", flush=True)


if __name__ == "__main__":
    main()
