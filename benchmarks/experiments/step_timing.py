"""GPU: one fwd+bwd step timed four ways, flexfa against cuDNN SDPA (issue 26: the project
benchmark put causal at 0.996x cuDNN while a profile of back-to-back steps put it at 1.015x).

For each variant (causal, full; B=1, H=16, bf16, S and E as given) and each implementation,
in rounds that alternate the implementations:
  bench    triton's do_bench as `python -m flexfa bench` calls it (a 256 MB L2 flush and
           grad_to_none before each step, CUDA events around each step, median)
  noflush  the same without the flush
  chain    CUDA events around 20 back-to-back steps, per step
  host     the host's time to enqueue one step (the GPU kept busy by a long sleep first)
and one profiled pass of 10 flushed steps: per step, the span from the first kernel's start
to the last one's end, the time no kernel ran inside it (idle), the wait from the flush's
end to the step's first kernel, and each kernel's summed time.

    PYTHONPATH=. python benchmarks/experiments/step_timing.py [--seq 16384] [--dim 128]
        [--variants causal,full] [--rounds 3] [--json out.json]
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--variants", default="causal,full")
    parser.add_argument("--impls", default="flexfa,cudnn")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default="")
    return parser


def _kernel_spans(trace: dict) -> list[tuple[str, float, float]]:
    return sorted((e["name"], e["ts"], e["ts"] + e["dur"]) for e in trace["traceEvents"]
                  if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset"))


def _union(spans) -> float:
    busy, end = 0.0, float("-inf")
    for _, s, e in spans:
        if e <= end:
            continue
        busy += e - max(s, end)
        end = e
    return busy


def main() -> int:
    args = build_parser().parse_args()
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile
    from triton.testing import do_bench

    import flexfa
    from flexfa.bench_cases import bench_variants

    S, D, H = args.seq, args.dim, 16
    q, k, v = (torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)
    flush = torch.empty(256 * 2 ** 20, dtype=torch.int8, device="cuda")
    results = []
    for name in args.variants.split(","):
        score_mod, mask_mod = bench_variants(S, H, "cuda")[name]
        fbm = flexfa.create_block_mask(mask_mod, 1, None, S, S, device="cuda") \
            if mask_mod else None

        def cudnn(causal=(name == "causal")):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        impls = {"flexfa": lambda: flexfa.flex_attention(q, k, v, score_mod, fbm),
                 "cudnn": cudnn}
        impls = {label: fn for label, fn in impls.items() if label in args.impls.split(",")}

        def step(fn):
            q.grad = k.grad = v.grad = None
            fn().backward(do)

        def noflush(fn, n=40):
            times = []
            for _ in range(n):
                q.grad = k.grad = v.grad = None
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn().backward(do)
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

        for fn in impls.values():
            for _ in range(3):
                step(fn)
        torch.cuda.synchronize()
        timed = {label: {"bench": [], "noflush": [], "chain": [], "host": []} for label in impls}
        for _ in range(args.rounds):
            for label, fn in impls.items():
                t = timed[label]
                t["bench"].append(do_bench(lambda: step(fn), warmup=100, rep=100,
                                           return_mode="median", grad_to_none=[q, k, v]))
                t["noflush"].append(noflush(fn))
                t["chain"].append(chain(fn))
                t["host"].append(host(fn))
        for label, fn in impls.items():
            steps = 10
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    q.grad = k.grad = v.grad = None
                    flush.zero_()
                    fn().backward(do)
                torch.cuda.synchronize()
            path = Path(f"/tmp/step_timing_{name}_{label}.json")
            prof.export_chrome_trace(str(path))
            spans = _kernel_spans(json.loads(path.read_text()))
            # split at the flushes: the 256 MB zeroing (a memset or a fill kernel) is the
            # only memset or fill of 40 us or more
            flushes = [i for i, (n, s, e) in enumerate(spans)
                       if ("memset" in n.lower() or "fill" in n.lower()) and e - s >= 40.0]
            per = []
            kernels: dict[str, float] = {}
            for j, i in enumerate(flushes):
                body = spans[i + 1:flushes[j + 1] if j + 1 < len(flushes) else len(spans)]
                if not body:
                    continue
                span = max(e for _, _, e in body) - body[0][1]
                per.append((span, span - _union(body), body[0][1] - spans[i][2]))
                for n, s, e in body:
                    kernels[n[:70]] = kernels.get(n[:70], 0.0) + (e - s) / 1e3
            if not per:  # no flush found: say so rather than lose the timings
                print(f"{name} {label}: no flush in the profile; kernels seen: "
                      f"{sorted({n[:40] for n, _, _ in spans})}", flush=True)
                per = [(float("nan"),) * 3]
            t = timed[label]
            row = {"variant": name, "impl": label, "S": S, "D": D,
                   **{m: statistics.median(v) for m, v in t.items()},
                   "rounds": t,
                   "span": statistics.median(p[0] for p in per) / 1e3,
                   "idle": statistics.median(p[1] for p in per) / 1e3,
                   "wait": statistics.median(p[2] for p in per) / 1e3,
                   "kernels": {n: ms / max(1, len(per)) for n, ms in
                               sorted(kernels.items(), key=lambda kv: -kv[1])[:10]}}
            results.append(row)
            print(f"{name:7} {label:7} bench {row['bench']:.3f} noflush {row['noflush']:.3f} "
                  f"chain {row['chain']:.3f} host {row['host']:.3f} | profiled span "
                  f"{row['span']:.3f} idle {row['idle']:.3f} wait {row['wait']:.3f} ms",
                  flush=True)
            for n, ms in row["kernels"].items():
                print(f"      {ms:7.3f}  {n}")
        base = {r["impl"]: r for r in results if r["variant"] == name}
        if {"flexfa", "cudnn"} <= set(base):
            print(f"{name:7} cuDNN / flexfa: " + ", ".join(
                f"{m} {base['cudnn'][m] / base['flexfa'][m]:.3f}x"
                for m in ("bench", "noflush", "chain", "span")), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
