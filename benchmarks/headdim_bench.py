"""Large and odd head dims on the GPU (issue 28 item 4): flexfa against torch FlexAttention
(compiled) and SDPA's cuDNN backend at E = 80, 96, 128, 192 with Ev = 128 (DeepSeek's MLA)
and 256; causal and full; forward and forward+backward; B * S = 16384 tokens, H = 16, bf16.

Per case and peer: the do_bench median in ms, the peak memory a call adds above its inputs
(MiB), and for flexfa the plans it ran (family and tiles, so a number says which config made
it); the max abs difference of each peer's output from flexfa's. The issue's target is
flexfa >= 1.2x FlexAttention at E = 192/128 and 256, fwd and fwd+bwd.

    FLEXFA_AUTOTUNE=0 timeout 170 python benchmarks/headdim_bench.py out.json [--budget 150]

``FLEXFA_AUTOTUNE=0``: the default tiles (those the compile checks chose), no tuning runs in
the slot. Cases run most-wanted first (E = 192/128, 256, then 128, 96, 80; causal, full;
S = 8192, 2048); no new case starts after ``--budget`` seconds (compiles included), nor one
that the time of the last like it (compiling or not) would carry past the budget, and the
JSON is rewritten after every case, so one GPU call always leaves a result. Every peer of
every case is guarded: an error (out of memory, out of resources, a head dim a peer does not
support) is recorded and the run goes on. ``--dims 192/128,256 --modes causal --seqs 8192``
pick a part of the grid; ``--device cpu --tokens 128 --heads 1 --seqs 64 --peers flexfa``
is a smoke run under the interpreter (wall-clock medians, no memory figures).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

DIMS = ("192/128", "256", "128", "96", "80")
TOKENS, HEADS = 16384, 16  # B * S and H
SPEC_FIELDS = ("head_dim", "head_dim_v", "block_m", "block_n", "num_warps", "num_stages",
               "max_registers", "block_m1", "block_n1", "block_m2", "block_n2", "dq_warps",
               "use_tma", "ds_dq")


def parse_dim(text: str) -> tuple[int, int]:
    e, _, ev = text.partition("/")
    return int(e), int(ev or e)


def guarded(rows: dict, name: str, measure) -> None:
    import torch
    try:
        rows[name] = measure()
    except Exception as exc:  # OOM, out of resources, an unsupported dim: recorded, go on
        rows[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        traceback.print_exc(limit=2)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def timed(fn, bench) -> dict:
    """{"ms": median, "peak_mib": memory a call adds above what is allocated before it (None
    off the GPU)}."""
    import torch
    fn()  # compile, plan, tune outside the timing
    if not torch.cuda.is_available():
        return {"ms": bench(fn), "peak_mib": None}
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - before) / 2**20
    return {"ms": bench(fn), "peak_mib": round(peak, 1)}


def bench_on(device: str, rep: int):
    """The timer of one call in ms: do_bench's median on a GPU; on the CPU (no CUDA events)
    the median of three wall-clock runs."""
    import triton.testing

    def bench(fn) -> float:
        if device == "cpu":
            times = []
            for _ in range(3):
                begin = time.perf_counter()
                fn()
                times.append((time.perf_counter() - begin) * 1e3)
            return sorted(times)[1]
        return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")
    return bench


def passes(forward, inputs, bench, what=("fwd", "fwd_bwd")) -> dict:
    """fwd (no autograd) and fwd_bwd rows of ``forward()`` (those in ``what``), each guarded;
    with fwd also the output ("out")."""
    import torch
    grad = []

    def fwd():
        with torch.no_grad():
            forward()

    def fwd_bwd():
        out = forward()
        if not grad:
            grad.append(torch.randn_like(out))
        out.backward(grad[0])
        for t in inputs:
            t.grad = None
    rows = {}
    for pass_, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        if pass_ in what:
            guarded(rows, pass_, lambda: timed(fn, bench))
    if "fwd" not in what:
        return rows
    with torch.no_grad():
        try:
            rows["out"] = forward()
        except Exception:  # already recorded above
            pass
    return rows


def flexfa_rows(q, k, v, causal: bool, bench, options=None, what=("fwd", "fwd_bwd")) -> dict:
    import flexfa
    from flexfa.runtime import plans

    mask = flexfa.create_block_mask(flexfa.mods.causal, None, None, q.shape[2], k.shape[2],
                                    device=q.device) if causal else None
    plans.PLANS.clear()  # the plans listed below are this case's
    rows = passes(lambda: flexfa.flex_attention(q, k, v, block_mask=mask,
                                                kernel_options=options), (q, k, v), bench, what)
    rows["plans"] = []
    for described in map(describe, plans.PLANS.values()):  # with and without lse: one entry
        if described not in rows["plans"]:
            rows["plans"].append(described)
    return rows


def describe(plan) -> dict:
    spec = dataclasses.asdict(plan.spec)
    return {"family": plan.family.name,
            **{name: spec[name] for name in SPEC_FIELDS if name in spec}}


def torch_rows(q, k, v, causal: bool, compiled, bench) -> dict:
    from torch.nn.attention.flex_attention import create_block_mask

    def causal_mod(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    mask = create_block_mask(causal_mod, None, None, q.shape[2], k.shape[2],
                             device=q.device) if causal else None
    return passes(lambda: compiled(q, k, v, block_mask=mask), (q, k, v), bench)


def cudnn_rows(q, k, v, causal: bool, bench) -> dict:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def forward():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return passes(forward, (q, k, v), bench)


def run_case(E: int, Ev: int, S: int, causal: bool, args, compiled, bench) -> dict:
    import torch
    B, H = max(1, args.tokens // S), args.heads
    generator = torch.Generator(device=args.device).manual_seed(E * 1000 + Ev)
    q, k = (torch.randn(B, H, S, E, device=args.device, dtype=torch.bfloat16,
                        generator=generator).requires_grad_() for _ in range(2))
    v = torch.randn(B, H, S, Ev, device=args.device, dtype=torch.bfloat16,
                    generator=generator).requires_grad_()
    case = {"E": E, "Ev": Ev, "B": B, "H": H, "S": S, "mode": "causal" if causal else "full"}
    makers = {"flexfa": lambda: flexfa_rows(q, k, v, causal, bench),
              # the Gluon backward asked for (head dims that pad to 64, 128 or 256)
              "flexfa_gluon_bwd": lambda: flexfa_rows(q, k, v, causal, bench,
                                                      {"GLUON_BACKWARD": True}, ("fwd_bwd",)),
              "torch_flex": lambda: torch_rows(q, k, v, causal, compiled, bench),
              "cudnn": lambda: cudnn_rows(q, k, v, causal, bench)}
    peers = args.peers.split(",")
    for name in peers:
        guarded(case, name, makers[name])
    outs = {}
    for name in peers:
        if isinstance(case.get(name), dict) and "out" in case[name]:
            outs[name] = case[name].pop("out")
    if "flexfa" in outs:
        case["max_abs_diff_vs_flexfa"] = {
            name: float((out.float() - outs["flexfa"].float()).abs().max())
            for name, out in outs.items() if name != "flexfa"}
    case["speedup_vs_torch_flex"] = {
        what: ratio(case, "torch_flex", what) for what in ("fwd", "fwd_bwd")}
    if "flexfa_gluon_bwd" in peers:
        case["gluon_bwd_speedup_vs_torch_flex"] = ratio(case, "torch_flex", "fwd_bwd",
                                                        "flexfa_gluon_bwd")
    return case


def ratio(case: dict, peer: str, what: str, ours: str = "flexfa"):
    try:
        return round(case[peer][what]["ms"] / case[ours][what]["ms"], 3)
    except (KeyError, TypeError):
        return None


def table(cases: list[dict]) -> str:
    def ms(case, peer, what):
        try:
            return f"{case[peer][what]['ms']:.3f}"
        except (KeyError, TypeError):
            return "err"
    lines = ["E/Ev     S     mode    pass     flexfa   torch_flex  cudnn    x flex  gluon_bwd"]
    for case in cases:
        for what in ("fwd", "fwd_bwd"):
            speedup = case["speedup_vs_torch_flex"][what]
            # the Gluon backward's peer times fwd+bwd only (its forward is flexfa's)
            gluon = ms(case, "flexfa_gluon_bwd", what) if (
                "flexfa_gluon_bwd" in case and what == "fwd_bwd") else "-"
            lines.append(f"{case['E']}/{case['Ev']:<4} {case['S']:<5} {case['mode']:<7} "
                         f"{what:<8} {ms(case, 'flexfa', what):>8} "
                         f"{ms(case, 'torch_flex', what):>11} {ms(case, 'cudnn', what):>8} "
                         f"{'-' if speedup is None else f'{speedup:.2f}':>7} {gluon:>10}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="JSON file for the results (rewritten after every case)")
    parser.add_argument("--budget", type=float, default=150.0,
                        help="seconds after which no new case starts (default 150)")
    parser.add_argument("--dims", default=",".join(DIMS), help="E or E/Ev, comma list")
    parser.add_argument("--modes", default="causal,full", help="causal and/or full")
    parser.add_argument("--seqs", default="8192,2048", help="sequence lengths (B = 16384 / S)")
    parser.add_argument("--peers", default="flexfa,torch_flex,cudnn",
                        help="comma list of flexfa, flexfa_gluon_bwd (GLUON_BACKWARD=True), "
                             "torch_flex, cudnn")
    parser.add_argument("--tokens", type=int, default=TOKENS, help="B * S (default 16384)")
    parser.add_argument("--heads", type=int, default=HEADS)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run")
    args = parser.parse_args(argv)
    start = time.perf_counter()

    import torch
    from torch.nn.attention.flex_attention import flex_attention
    from manifest import manifest

    for limit in ("cache_size_limit", "recompile_limit"):  # one compile per dim and mode
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 64)
    compiled = torch.compile(flex_attention)

    bench = bench_on(args.device, rep=60)

    results = {"manifest": manifest(" ".join([sys.argv[0], *(argv or sys.argv[1:])])),
               "args": vars(args), "cases": [], "skipped": []}
    grid = [(parse_dim(dim), mode == "causal", int(S)) for dim in args.dims.split(",")
            for mode in args.modes.split(",") for S in args.seqs.split(",")]
    # a case starts only if it should end within the budget: its cost guessed from the last
    # case that compiled (a new dim and mode) or the last that did not (if any yet)
    last = {True: 0.0, False: 0.0}
    seen = set()
    for (E, Ev), causal, S in grid:
        label = f"E={E}/{Ev} S={S} {'causal' if causal else 'full'}"
        compiles = (E, Ev, causal) not in seen
        began = time.perf_counter()
        if began - start + (last[compiles] or last[True]) > args.budget:
            results["skipped"].append(label)
            continue
        seen.add((E, Ev, causal))
        case = run_case(E, Ev, S, causal, args, compiled, bench)
        last[compiles] = time.perf_counter() - began
        case["elapsed_s"] = round(time.perf_counter() - start, 1)
        results["cases"].append(case)
        print(f"{label}: x flex {case['speedup_vs_torch_flex']} "
              f"({case['elapsed_s']} s)", flush=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
    finish(results, args.out, table(results["cases"]), args.budget)
    return 0


def finish(results: dict, out: str, text: str, budget: float) -> None:
    """Write the JSON a last time, print the table and the cases the budget left out."""
    Path(out).write_text(json.dumps(results, indent=1))
    print(text)
    if results["skipped"]:
        print(f"not started (budget {budget:.0f} s): {', '.join(results['skipped'])}")


if __name__ == "__main__":
    raise SystemExit(main())
