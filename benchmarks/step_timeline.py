"""Host and GPU timeline of one training step, flexfa against FlexAttention (compiled).

Where a step is host-bound, what counts is when each kernel is launched on the host against
when the GPU could have run it. Steps run back to back as ``do_bench`` runs them (gradients set
to None, a 256 MB cache clear, the step); torch.profiler records the GPU's kernels only (no
host events, which would slow the host), and the idle gaps between them show where the GPU
waited for the host. Then, for flexfa, the host time spent in its autograd forward and
backward functions (perf_counter, the GPU kept busy).

    PYTHONPATH=. python benchmarks/step_timeline.py [S] [D] [variants]
"""
from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import flexfa
from host_common import variant_pair

def _timeline(step, label: str) -> None:
    cache = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    for _ in range(5):
        cache.zero_()
        step()
    torch.cuda.synchronize()
    # GPU activity only: recording host ops would slow the host this measures
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(4):
            cache.zero_()
            step()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                     key=lambda e: e.time_range.start)
    fills = [i for i, e in enumerate(kernels) if "fill" in e.name.lower()
             and e.time_range.end - e.time_range.start > 20]  # the 256 MB cache clears
    last = kernels[fills[-2]:]
    t0 = last[0].time_range.end
    print(f"-- {label}: GPU timeline of the last two steps (us from the cache clear's end)",
          flush=True)
    end = t0
    for e in last:
        start = e.time_range.start
        print(f"   {e.name[:46]:46} {start - t0:7.0f} .. {e.time_range.end - t0:7.0f}"
              f"  idle before {max(0.0, start - end):5.0f}")
        end = max(end, e.time_range.end)


def main() -> None:
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
    stamps: list[float] = []
    original = {name: getattr(fa_autograd.FlexAttentionFunction, name)
                for name in ("forward", "backward")}

    def stamped(name):
        def wrapper(*args, **kwargs):
            stamps.append(time.perf_counter())
            result = original[name](*args, **kwargs)
            stamps.append(time.perf_counter())
            return result
        return staticmethod(wrapper)
    for name in names:
        impls, score_mod, fbm = variant_pair(name, q, k, v, compiled)
        for label, fn in impls.items():
            def step(fn=fn):
                q.grad = k.grad = v.grad = None
                fn().backward(do)
            _timeline(step, f"{name} {label}")
        # the same steps with flexfa's autograd functions' entry and exit stamped
        for key in original:
            setattr(fa_autograd.FlexAttentionFunction, key, stamped(key))
        torch.cuda._sleep(200_000_000)  # the GPU stays busy: only the host is timed
        phases = []
        for _ in range(30):
            stamps.clear()
            start = time.perf_counter()
            q.grad = k.grad = v.grad = None
            flexfa.flex_attention(q, k, v, score_mod, fbm).backward(do)
            stamps.append(time.perf_counter())
            marks = [start, *stamps]
            phases.append([(b - a) * 1e6 for a, b in zip(marks, marks[1:])])
        torch.cuda.synchronize()
        for key in original:
            setattr(fa_autograd.FlexAttentionFunction, key, staticmethod(original[key]))
        median = [sorted(column)[len(column) // 2] for column in zip(*phases)]
        labels = ("to Function.forward", "Function.forward", "to Function.backward",
                  "Function.backward", "after it")
        print(f"-- {name} flexfa host per step (medians, us): "
              + ", ".join(f"{label} {value:.0f}" for label, value in zip(labels, median))
              + f"; total {sum(median):.0f}", flush=True)


if __name__ == "__main__":
    main()
