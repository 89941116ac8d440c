"""GPU: one fwd+bwd step timed four ways, flexfa against cuDNN SDPA (issue 26: the project
benchmark put causal at 0.996x cuDNN while a profile of back-to-back steps put it at 1.015x).
With ``--forward`` the step is the forward alone (under ``torch.no_grad()``).

For each variant (causal, full; B=1, H=16, bf16, S and E as given) and each implementation,
in rounds that alternate the implementations:
  bench    triton's do_bench as `python -m flexfa bench` calls it (a 256 MB L2 flush and
           grad_to_none before each step, CUDA events around each step, median)
  noflush  the same without the flush
  chain    CUDA events around 20 back-to-back steps, per step
  host     the host's time to enqueue one step (the GPU kept busy by a long sleep first),
and each implementation's peak extra memory of one step (MiB: outputs and gradients count).
An implementation `flexfa@NAME=VALUE;NAME=VALUE` is flexfa with those kernel_options (ints,
True/False), e.g. `flexfa@GLUON_BWD_DQ_CHUNKS=3`; `--modes` picks the ways of timing.
(A profiled pass that split the trace at the flushes was dropped: torch's trace did not show
every flush, st_2aae01a; benchmarks/bwd_profile.py has the kernels' times.)

    PYTHONPATH=. python benchmarks/experiments/step_timing.py [--seq 16384] [--dim 128]
        [--variants causal,full] [--impls flexfa,flexfa@GLUON_BWD_DQ_CHUNKS=3,cudnn]
        [--modes bench,noflush,chain,host] [--rounds 3] [--forward] [--json out.json]
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


MODES = ("bench", "noflush", "chain", "host")


def kernel_options(label: str) -> dict | None:
    """The kernel_options of an implementation label `flexfa@NAME=VALUE;...` (None for
    plain `flexfa`)."""
    if "@" not in label:
        return None
    options = {}
    for item in label.split("@", 1)[1].split(";"):
        name, value = item.split("=", 1)
        options[name] = {"True": True, "False": False}.get(value) if value in (
            "True", "False") else int(value) if value.lstrip("-").isdigit() else value
    return options


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--variants", default="causal,full")
    parser.add_argument("--impls", default="flexfa,cudnn")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--forward", action="store_true",
                        help="time the forward alone (no gradients) instead of fwd+bwd")
    parser.add_argument("--json", default="")
    return parser


def main() -> int:
    args = build_parser().parse_args()
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    import flexfa
    from flexfa.bench_cases import bench_variants

    S, D, H = args.seq, args.dim, 16
    q, k, v = (torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)
    results = []
    for name in args.variants.split(","):
        score_mod, mask_mod = bench_variants(S, H, "cuda")[name]
        fbm = flexfa.create_block_mask(mask_mod, 1, None, S, S, device="cuda") \
            if mask_mod else None

        def cudnn(causal=(name == "causal")):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        def flexfa_impl(options):
            return lambda: flexfa.flex_attention(q, k, v, score_mod, fbm,
                                                 kernel_options=options)
        impls = {label: cudnn if label == "cudnn" else flexfa_impl(kernel_options(label))
                 for label in args.impls.split(",")}
        modes = args.modes.split(",")

        def run(fn):  # one step: fwd+bwd, or with --forward the forward alone
            if args.forward:
                with torch.no_grad():
                    fn()
            else:
                fn().backward(do)

        def step(fn):
            q.grad = k.grad = v.grad = None
            run(fn)

        def noflush(fn, n=40):
            times = []
            for _ in range(n):
                q.grad = k.grad = v.grad = None
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                run(fn)
                b.record()
                times.append((a, b))
            torch.cuda.synchronize()
            return statistics.median(a.elapsed_time(b) for a, b in times)

        def chain(fn, n=20):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(n):
                step(fn)
            b.record()
            torch.cuda.synchronize()
            return a.elapsed_time(b) / n

        def host(fn, n=10):
            torch.cuda._sleep(2 * 10 ** 9)  # about a second of GPU time: the host runs ahead
            t0 = time.perf_counter()
            for _ in range(n):
                step(fn)
            ms = (time.perf_counter() - t0) / n * 1e3
            torch.cuda.synchronize()
            return ms

        def peak_mib(fn):
            q.grad = k.grad = v.grad = None
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            run(fn)
            torch.cuda.synchronize()
            return (torch.cuda.max_memory_allocated() - before) / 2 ** 20

        ways = {"bench": lambda fn: do_bench(lambda: step(fn), warmup=100, rep=100,
                                             return_mode="median", grad_to_none=[q, k, v]),
                "noflush": noflush, "chain": chain, "host": host}
        for fn in impls.values():
            for _ in range(3):
                step(fn)
        torch.cuda.synchronize()
        peaks = {label: peak_mib(fn) for label, fn in impls.items()}
        timed = {label: {m: [] for m in modes} for label in impls}
        for _ in range(args.rounds):
            for label, fn in impls.items():
                for m in modes:
                    timed[label][m].append(ways[m](fn))
        for label in impls:
            t = timed[label]
            row = {"variant": name, "impl": label, "S": S, "D": D, "peak_mib": peaks[label],
                   **{m: statistics.median(v) for m, v in t.items()}, "rounds": t}
            results.append(row)
            print(f"{name:7} {label:30} " + " ".join(f"{m} {row[m]:.3f}" for m in modes)
                  + f" ms, peak extra {row['peak_mib']:.0f} MiB", flush=True)
        base = {r["impl"]: r for r in results if r["variant"] == name}
        for label in (lb for lb in base if lb.startswith("flexfa") and "cudnn" in base):
            print(f"{name:7} cuDNN / {label}: " + ", ".join(
                f"{m} {base['cudnn'][m] / base[label][m]:.3f}x"
                for m in modes if m != "host"), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
