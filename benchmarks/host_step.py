"""Where the host time of a fwd+bwd training step goes, on a GPU (one tool, three views).

At small shapes (S = 2048, E = 64 on the H200) a step's kernels take under a millisecond and
the host's work to enqueue them can set the step time. For each benchmark variant:

- ``sync``: one flexfa step under ``torch.cuda.set_sync_debug_mode("warn")``, printing the
  Python stack of every synchronizing call; then the host time to enqueue 20 steps against the
  time until they finish (a host time close to the total means the GPU waited for the host).
- ``profile``: host microseconds per call of the forward and of fwd+bwd, flexfa against torch
  FlexAttention (compiled), with the GPU kept busy (``torch.cuda._sleep``) so only the host is
  timed; then cProfile of flexfa's steps, sorted by own time.
- ``timeline``: the GPU's kernels of two steps run as ``do_bench`` runs them (a 256 MB cache
  clear, the step), from torch.profiler (GPU activity only), with the idle gap before each
  kernel; then flexfa's host time per phase of a step (before, inside and after its autograd
  Function's forward and backward).

    python benchmarks/host_step.py [S] [E] [variants] [--show sync,profile,timeline] [--steps N]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
import traceback
import warnings

VIEWS = ("sync", "profile", "timeline")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("seq_len", nargs="?", type=int, default=2048, help="S (default 2048)")
    parser.add_argument("head_dim", nargs="?", type=int, default=64, help="E (default 64)")
    parser.add_argument("variants", nargs="?", default="causal,document",
                        help="benchmark variants, comma-separated (default causal,document)")
    parser.add_argument("--show", default="sync",
                        help=f"views, comma-separated, of {','.join(VIEWS)} (default sync)")
    parser.add_argument("--steps", type=int, default=50, help="steps per profile round (50)")
    args = parser.parse_args(argv)
    args.show = args.show.split(",")
    unknown = sorted(set(args.show) - set(VIEWS))
    if unknown:
        parser.error(f"--show: unknown view(s) {unknown}; choose from {list(VIEWS)}")
    return args


def host_us(fn, calls: int, sleep_cycles: int = 400_000_000) -> float:
    """Host microseconds per call of ``fn`` (median of 5 rounds of ``calls`` calls) while a
    ``torch.cuda._sleep(sleep_cycles)`` keeps the GPU busy, so the queue never drains and only
    the host is timed (400M cycles: about 0.2 s on the H200)."""
    import torch

    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        torch.cuda._sleep(sleep_cycles)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return sorted(rounds)[2]


def variant_pair(name: str, q, k, v, compiled_flex):
    """({"flexfa": fn, "flex": fn}, score_mod, flexfa's block mask) for benchmark variant
    ``name`` on ``[B, H, S, E]`` inputs; each fn() runs the forward on q, k, v."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask

    import flexfa
    from flexfa.bench_cases import bench_variants as _variants

    B, H, S = q.shape[:3]
    score_mod, mask_mod = _variants(S, H, "cuda")[name]
    fbm = flexfa.create_block_mask(mask_mod, B, None, S, S, device="cuda") if mask_mod else None
    tbm = torch_block_mask(mask_mod, B, None, S, S, device="cuda") if mask_mod else None
    impls = {"flexfa": lambda: flexfa.flex_attention(q, k, v, score_mod, fbm),
             "flex": lambda: compiled_flex(q, k, v, score_mod=score_mod, block_mask=tbm)}
    return impls, score_mod, fbm


def show_sync(name, impls, q, k, v, do) -> None:
    import torch

    def step():
        impls["flexfa"]().backward(do)
        q.grad = k.grad = v.grad = None

    def report(message, category, filename, lineno, file=None, line=None):
        print(f"SYNC: {message}")
        traceback.print_stack(limit=12)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    print(f"-- {name}: one step under sync debug mode", flush=True)
    with warnings.catch_warnings():
        warnings.showwarning = report
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        step()
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    steps = 20
    start = time.perf_counter()
    for _ in range(steps):
        step()
    host = (time.perf_counter() - start) / steps * 1e3
    torch.cuda.synchronize()
    total = (time.perf_counter() - start) / steps * 1e3
    print(f"{name:9} host {host:.3f} ms/step to enqueue, {total:.3f} ms/step until done",
          flush=True)


def show_profile(name, impls, q, k, v, do, steps: int) -> None:
    import torch

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


def _gpu_timeline(step, label: str) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

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


def show_timeline(name, impls, score_mod, fbm, q, k, v, do) -> None:
    import torch

    import flexfa
    from flexfa import autograd as fa_autograd

    for label, fn in impls.items():
        def step(fn=fn):
            q.grad = k.grad = v.grad = None
            fn().backward(do)
        _gpu_timeline(step, f"{name} {label}")
    # the same steps with flexfa's autograd Function's entry and exit stamped
    stamps: list[float] = []
    original = {key: getattr(fa_autograd.FlexAttentionFunction, key)
                for key in ("forward", "backward")}

    def stamped(key):
        def wrapper(*args, **kwargs):
            stamps.append(time.perf_counter())
            result = original[key](*args, **kwargs)
            stamps.append(time.perf_counter())
            return result
        return staticmethod(wrapper)
    for key in original:
        setattr(fa_autograd.FlexAttentionFunction, key, stamped(key))
    try:
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
    finally:
        for key in original:
            setattr(fa_autograd.FlexAttentionFunction, key, staticmethod(original[key]))
    median = [sorted(column)[len(column) // 2] for column in zip(*phases)]
    labels = ("to Function.forward", "Function.forward", "to Function.backward",
              "Function.backward", "after it")
    print(f"-- {name} flexfa host per step (medians, us): "
          + ", ".join(f"{label} {value:.0f}" for label, value in zip(labels, median))
          + f"; total {sum(median):.0f}", flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    if not torch.cuda.is_available():
        raise SystemExit("host_step.py times a GPU's host work: torch sees no CUDA GPU")
    S, D = args.seq_len, args.head_dim
    B, H = max(1, 16384 // S), 16
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)
    compiled = torch.compile(torch_flex, dynamic=False)
    for name in args.variants.split(","):
        impls, score_mod, fbm = variant_pair(name, q, k, v, compiled)
        if "sync" in args.show:
            show_sync(name, impls, q, k, v, do)
        if "profile" in args.show:
            show_profile(name, impls, q, k, v, do, args.steps)
        if "timeline" in args.show:
            show_timeline(name, impls, score_mod, fbm, q, k, v, do)


if __name__ == "__main__":
    main()
