"""``python -m flexfa bench``: flexfa vs torch FlexAttention (compiled) vs SDPA, in one process.

Every case is checked against FlexAttention before it is timed; times are medians of
``triton.testing.do_bench``; FLOPs are 4*B*H*L*S*E times the block density of the mask (from
torch's own BlockMask, so both sides are charged the same work), x3.5 for fwd+bwd. ``--rounds``
times the columns in turn that many times, each round in another order of a balanced Latin
square (``round_order``: every column at every place and after every other column equally
often), and a row's ms is the median of its rounds. Each row
also has the call's peak extra memory (``peak_mib``: the allocator's peak during one warm call,
less what was allocated before it). ``--flash`` adds FlexAttention's FLASH backend (FA4, whose
wheels must be importable) as the column ``flex-flash``; ``--extra LABEL=JSON`` adds flexfa with
those kernel_options as the column LABEL.
Writes ``results.json`` (with GPU name, versions, date and commit) and ``results.png``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

from . import config
from .bench_cases import VARIANTS, bench_variants, versions

def _ceilings():
    import torch
    from triton.testing import do_bench

    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: x @ x, warmup=50, rep=200, return_mode="median")
    return {"bf16_matmul_tflops": 2 * 8192 ** 3 / ms / 1e9}


WARMUP_MS = 100  # do_bench's warm-up: long enough for the clocks to leave an idle pause


def round_order(labels: list[str], r: int) -> list[str]:
    """The columns in round ``r``, by a balanced Latin square (Williams's design): row r of
    the square whose first row is 0, 1, n - 1, 2, n - 2, ... and row r adds r (mod n); for
    an odd n rounds n to 2n - 1 are those rows reversed. Over n rounds (2n for an odd n) each
    column is timed at each place equally often, first among them, and right after each
    other column equally often. (In fixed order a column timed right after SDPA's flash
    column, 6.3 ms a call at E = 128 S = 16384, ran 3.58-3.66 ms where the same kernel in
    another column ran 3.42-3.53: benchmarks/results/gpu_2026-12-04/bench_53ddddb.)"""
    n = len(labels)
    if n == 0:
        return []
    first = [0] + [(k + 1) // 2 if k % 2 else n - k // 2 for k in range(1, n)]
    period = n if n % 2 == 0 else 2 * n
    r %= period
    row = [labels[(j + r) % n] for j in first]
    return row[::-1] if r >= n else row


def _grad_out(q, v):
    """A random upstream gradient in out's shape: q's rows, v's head dim."""
    import torch
    return torch.randn(*q.shape[:3], v.shape[3], device=q.device, dtype=q.dtype)


def _time(fn, q, k, v, bwd: bool, rep: int) -> float:
    import torch
    from triton.testing import do_bench

    if not bwd:
        return do_bench(lambda: fn(q, k, v), warmup=WARMUP_MS, rep=rep, return_mode="median")
    do = _grad_out(q, v)

    def step():
        fn(q, k, v).backward(do)
    return do_bench(step, warmup=WARMUP_MS, rep=rep, return_mode="median",
                    grad_to_none=[q, k, v])


def _peak_mib(fn, q, k, v, bwd: bool) -> float:
    """The allocator's peak during one warm call (and its backward), less what was allocated
    before it, in MiB: out, the gradients and whatever the implementation keeps or scratches."""
    import torch

    do = _grad_out(q, v)
    for t in (q, k, v):
        t.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn(q, k, v)
    if bwd:
        out.backward(do)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    for t in (q, k, v):
        t.grad = None
    return peak / 2 ** 20


def parse_extra(items) -> dict:
    """``--extra LABEL=JSON`` items as {label: kernel_options}; a clear error for bad ones."""
    extra = {}
    for item in items or ():
        label, sep, text = item.partition("=")
        if not sep or not label:
            raise ValueError(f"--extra takes LABEL=JSON (kernel_options), got {item!r}")
        if label in ("flexfa", "flex", "flex-flash", "sdpa-cudnn", "sdpa-flash"):
            raise ValueError(f"--extra label {label!r} names a column the benchmark has already")
        options = json.loads(text)
        if not isinstance(options, dict):
            raise ValueError(f"--extra {label}: kernel_options must be a JSON object, "
                             f"got {text!r}")
        extra[label] = options
    return extra


def _relerr(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _check(fa_fn, flex_fn, q, k, v, bwd: bool) -> dict:
    """flexfa vs FlexAttention on the benchmark inputs: relative L2 errors of out (and grads)."""
    import torch

    result = {}
    outs, grads = [], []
    do = _grad_out(q, v)
    for fn in (fa_fn, flex_fn):
        for t in (q, k, v):
            t.grad = None
        out = fn(q, k, v)
        outs.append(out.detach())
        if bwd:
            out.backward(do)
            grads.append([t.grad.detach().clone() for t in (q, k, v)])
    result["out_relerr"] = _relerr(outs[0], outs[1])
    if bwd:
        for name, a, b in zip(("dq", "dk", "dv"), grads[0], grads[1]):
            result[f"{name}_relerr"] = _relerr(a, b)
    for t in (q, k, v):
        t.grad = None
    return result


def run(args) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    import flexfa

    torch.manual_seed(0)
    torch._dynamo.config.recompile_limit = 10 ** 4
    torch._dynamo.config.accumulated_recompile_limit = 10 ** 5
    compiled_flex = torch.compile(torch_flex, dynamic=False)
    meta = versions()
    meta.update(_ceilings())
    meta.update(settings=config.settings(), autotune=config.autotune_enabled())
    print(json.dumps(meta), flush=True)
    rows = []
    passes = [p == "fwd+bwd" for p in args.passes.split(",")]
    for S in [int(s) for s in args.seqs.split(",")]:
        for D in [int(d) for d in args.dims.split(",")]:
            B, H = max(1, args.tokens // S), args.heads
            q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3))
            variants = bench_variants(S, H, "cuda")
            for name in args.variants.split(","):
                score_mod, mask_mod = variants[name]
                tbm = torch_block_mask(mask_mod, B, None, S, S, device="cuda") if mask_mod else None
                density = 1.0 - tbm.sparsity() / 100.0 if tbm is not None else 1.0
                t0 = time.perf_counter()
                fbm = flexfa.create_block_mask(mask_mod, B, None, S, S, device="cuda") if mask_mod else None
                torch.cuda.synchronize()
                fa_bm_ms = (time.perf_counter() - t0) * 1e3

                def fa_fn(q, k, v, score_mod=score_mod, fbm=fbm):
                    return flexfa.flex_attention(q, k, v, score_mod=score_mod, block_mask=fbm)

                def flex_fn(q, k, v, score_mod=score_mod, tbm=tbm):
                    return compiled_flex(q, k, v, score_mod=score_mod, block_mask=tbm)

                impls = {"flexfa": fa_fn, "flex": flex_fn}
                for label, options in parse_extra(args.extra).items():
                    def extra_fn(q, k, v, score_mod=score_mod, fbm=fbm, options=options):
                        return flexfa.flex_attention(q, k, v, score_mod=score_mod,
                                                     block_mask=fbm, kernel_options=options)
                    impls[label] = extra_fn
                if args.flash:
                    def flash_fn(q, k, v, score_mod=score_mod, tbm=tbm):
                        return compiled_flex(q, k, v, score_mod=score_mod, block_mask=tbm,
                                             kernel_options={"BACKEND": "FLASH"})
                    impls["flex-flash"] = flash_fn
                if name in ("full", "causal"):
                    for label, backend in (("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION),
                                           ("sdpa-flash", SDPBackend.FLASH_ATTENTION)):
                        def sdpa_fn(q, k, v, backend=backend, causal=(name == "causal")):
                            with sdpa_kernel(backend):
                                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                        impls[label] = sdpa_fn
                for bwd in passes:
                    pass_name = "fwd+bwd" if bwd else "fwd"
                    first = {}
                    for label, fn in impls.items():
                        t0 = time.perf_counter()
                        try:
                            out = fn(q, k, v)
                            if bwd:
                                out.sum().backward()
                            torch.cuda.synchronize()
                        except Exception as exc:  # a peer may not support a case; record it
                            rows.append(dict(impl=label, variant=name, S=S, D=D, B=B, H=H,
                                             pass_=pass_name, error=repr(exc)[:200]))
                            continue
                        first[label] = time.perf_counter() - t0
                    # every column against FlexAttention's Triton backend, on the same inputs
                    checks = {label: _check(impls[label], flex_fn, q, k, v, bwd)
                              for label in first if label != "flex" and "flex" in first}
                    # rounds over the columns in turn: a GPU's clocks move with its power
                    # and heat, so no column is always timed first after the checks' pause,
                    # nor always right after the same column (round_order)
                    timed = {label: [] for label in impls if label in first}
                    for r in range(args.rounds):
                        for label in round_order(list(timed), r):
                            timed[label].append(_time(impls[label], q, k, v, bwd, args.rep))
                    for label, rounds in timed.items():
                        fn = impls[label]
                        ms = statistics.median(rounds)
                        flops = 4 * B * H * S * S * D * density * (3.5 if bwd else 1.0)
                        row = dict(impl=label, variant=name, S=S, D=D, B=B, H=H, pass_=pass_name,
                                   ms=ms, ms_rounds=rounds, tflops=flops / ms / 1e9,
                                   density=density, first_call_s=first[label],
                                   peak_mib=_peak_mib(fn, q, k, v, bwd))
                        row.update(checks.get(label, {}))
                        if label == "flexfa":
                            row.update(blockmask_ms=fa_bm_ms)
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                    _save_partial(args, meta, rows)
            del q, k, v
            torch.cuda.empty_cache()
    return {"meta": meta, "rows": rows, "summary": summarize(rows),
            "peers": summarize_peers(rows)}


def _save_partial(args, meta, rows) -> None:
    """results.json after every case, so a run stopped at a time limit keeps what it measured."""
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "summary": summarize(rows), "partial": True}, f,
                  indent=1)


def case_speedups(rows, peer: str = "flex") -> dict:
    """{pass: [dict(variant, S, D, speedup)]}: the peer's time (FlexAttention's by default)
    over flexfa's for every case that has both."""
    by_case = {}
    for r in rows:
        if "ms" in r:
            by_case.setdefault((r["variant"], r["S"], r["D"], r["pass_"]), {})[r["impl"]] = r["ms"]
    speedups = {}
    for (variant, S, D, pass_), times in by_case.items():
        if "flexfa" in times and peer in times:
            speedups.setdefault(pass_, []).append(
                dict(variant=variant, S=S, D=D, speedup=times[peer] / times["flexfa"]))
    return speedups


def summarize(rows, peer: str = "flex") -> dict:
    """Speedup of flexfa over the peer (FlexAttention by default) per case, and the geometric
    means per pass."""
    summary = {}
    for pass_, items in case_speedups(rows, peer).items():
        geo = math.exp(sum(math.log(i["speedup"]) for i in items) / len(items))
        worst = min(items, key=lambda i: i["speedup"])
        summary[pass_] = dict(geomean_speedup=geo, worst=worst, cases=len(items))
    return summary


def summarize_peers(rows) -> dict:
    """{peer: summarize(rows, peer)} for every column other than flexfa's."""
    peers = dict.fromkeys(r["impl"] for r in rows if "ms" in r and r["impl"] != "flexfa")
    return {peer: summarize(rows, peer) for peer in peers}


def print_table(result: dict) -> None:
    rows = result["rows"]
    print(f"\n{'variant':9} {'S':>6} {'D':>4} {'pass':8} {'flexfa ms':>10} {'TF/s':>6} "
          f"{'flex ms':>9} {'TF/s':>6} {'speedup':>8} {'cudnn ms':>9} {'err':>8}")
    cases = {}
    for r in rows:
        cases.setdefault((r["variant"], r["S"], r["D"], r["pass_"]), {})[r["impl"]] = r
    for (variant, S, D, pass_), impls in cases.items():
        fa, fl, cu = impls.get("flexfa", {}), impls.get("flex", {}), impls.get("sdpa-cudnn", {})

        def cell(r, key, fmt):
            return format(r[key], fmt) if key in r else "-"
        speed = f"{fl['ms'] / fa['ms']:.2f}x" if "ms" in fa and "ms" in fl else "-"
        print(f"{variant:9} {S:6} {D:4} {pass_:8} {cell(fa, 'ms', '10.3f'):>10} "
              f"{cell(fa, 'tflops', '6.0f'):>6} {cell(fl, 'ms', '9.3f'):>9} "
              f"{cell(fl, 'tflops', '6.0f'):>6} {speed:>8} {cell(cu, 'ms', '9.3f'):>9} "
              f"{cell(fa, 'out_relerr', '8.1e'):>8}")
    for pass_, s in result["summary"].items():
        w = s["worst"]
        print(f"{pass_}: geomean speedup over FlexAttention {s['geomean_speedup']:.3f}x over "
              f"{s['cases']} cases; worst {w['speedup']:.2f}x ({w['variant']} S={w['S']} D={w['D']})")
    print_peers(rows)


def print_peers(rows) -> None:
    """One line per case: each column's time and its time over flexfa's (> 1: flexfa faster),
    and each column's peak extra memory."""
    impls = list(dict.fromkeys(r["impl"] for r in rows if "ms" in r))
    if len(impls) <= 2:
        return
    cases = {}
    for r in rows:
        if "ms" in r:
            cases.setdefault((r["variant"], r["S"], r["D"], r["pass_"]), {})[r["impl"]] = r
    print("\nms (time over flexfa's) / peak extra MiB")
    print(f"{'variant':9} {'S':>6} {'D':>4} {'pass':8} " + " ".join(f"{i:>24}" for i in impls))
    for (variant, S, D, pass_), by_impl in cases.items():
        base = by_impl.get("flexfa", {}).get("ms")
        cells = []
        for impl in impls:
            r = by_impl.get(impl)
            if r is None:
                cells.append(f"{'-':>24}")
                continue
            ratio = f" ({r['ms'] / base:.2f}x)" if base else ""
            mib = f" / {r['peak_mib']:.0f}" if "peak_mib" in r else ""
            cells.append(f"{r['ms']:.3f}{ratio}{mib}".rjust(24))
        print(f"{variant:9} {S:6} {D:4} {pass_:8} " + " ".join(cells))


def plot(result: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [r for r in result["rows"] if "tflops" in r]
    passes = sorted({r["pass_"] for r in rows})
    fig, axes = plt.subplots(len(passes), 1, figsize=(14, 4.5 * len(passes)), squeeze=False)
    for ax, pass_ in zip(axes[:, 0], passes):
        cases = sorted({(r["variant"], r["S"], r["D"]) for r in rows if r["pass_"] == pass_},
                       key=lambda c: (c[2], c[1], c[0]))
        impls = ["flexfa", "flex", "sdpa-cudnn", "sdpa-flash"]
        width = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            vals = []
            for c in cases:
                match = [r for r in rows if (r["variant"], r["S"], r["D"]) == c
                         and r["pass_"] == pass_ and r["impl"] == impl]
                vals.append(match[0]["tflops"] if match else 0.0)
            ax.bar([j + i * width for j in range(len(cases))], vals, width, label=impl)
        ax.set_xticks([j + 0.4 for j in range(len(cases))])
        ax.set_xticklabels([f"{v} {s // 1024}k E{d}" for v, s, d in cases], fontsize=7,
                           rotation=90)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{pass_}, bf16, H=16, B*S=16384 on {result['meta']['gpu']}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flexfa bench", description=__doc__)
    parser.add_argument("--seqs", default="2048,8192,16384")
    parser.add_argument("--dims", default="64,128")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--passes", default="fwd,fwd+bwd")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--rep", type=int, default=100, help="do_bench repetition time in ms")
    parser.add_argument("--rounds", type=int, default=1,
                        help="timing rounds over the columns in turn (each round in another "
                             "order: a balanced Latin square); a row's ms is the median of its "
                             "rounds' medians")
    parser.add_argument("--out", default=config.environment("OUT", "."))
    parser.add_argument("--flash", action="store_true",
                        help="add FlexAttention's FLASH backend (FA4 wheels importable) as "
                             "a column")
    parser.add_argument("--extra", action="append", metavar="LABEL=JSON",
                        help="add flexfa with these kernel_options as column LABEL (repeatable)")
    parser.add_argument("--fp8", action="store_true",
                        help="also time the FP8 forward (flexfa.fp8.bench) on the same grid")
    args = parser.parse_args(argv)
    try:
        parse_extra(args.extra)
    except ValueError as exc:
        parser.error(str(exc))
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    import torch
    if not torch.cuda.is_available():
        print("the benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    result = run(args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(args.out, "results.png"))
    print_table(result)
    if args.fp8:
        from .fp8 import bench as fp8_bench
        result["fp8_rows"] = fp8_bench.run_fp8(args)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(result, f, indent=1)
        fp8_bench.print_table(result["fp8_rows"])
    return 0
