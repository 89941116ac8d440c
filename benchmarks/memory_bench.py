"""Peak memory and time of the backward (issue 26): flexfa by default (nothing L x S) and with
its opt-in dS workspace (``DS_WORKSPACE=True``) against torch FlexAttention (compiled) and
SDPA's cuDNN backend, in one process, bf16.

Cases: the project benchmark's variants at B = 1, H = 16, S = 16384, E = 128 (full, causal,
sliding 1024, softcap+causal, ALiBi+causal, document), causal GQA (B = 2, Hq = 32, Hkv = 8,
S = 8192), causal S = 65536 (B = 1, H = 8) and causal E = 64 (B = 2, H = 16, S = 8192). Per
case and peer: fwd and fwd+bwd do_bench medians (ms) and their peak extra memory (MiB:
torch.cuda.max_memory_allocated after reset_peak_memory_stats minus what was allocated before
the call, i.e. the inputs, the upstream gradient and the block mask; outputs and gradients
count); cuDNN only where the variant is expressible (full, causal); the dS mode fwd+bwd only
(its forward is flexfa's). Also the memory the outputs and gradients must take and flexfa's
default formula (the outputs, dQ, dK, dV, 4 B Hq L bytes of delta and, where the Gluon
backward ran, its fp32 dQ accumulator: ``accumulator_mib``), and which backward plans ran.
The issue's memory target: flexfa's fwd+bwd peak <= 1.2x FlexAttention's.

    timeout 300 python benchmarks/memory_bench.py out.json [--budget 240]

No new case starts after ``--budget`` seconds (compiles and flexfa's first-call tuning
included; ``FLEXFA_AUTOTUNE=0`` skips the tuning), nor one the last case's time would carry
past it; the JSON is rewritten after every case, each peer is guarded (an error, e.g. out of
memory, is recorded and the run goes on). ``--cases causal,gqa`` and ``--peers`` pick a part;
``--device cpu`` is a smoke run under the interpreter (every case at S = 128 and an eighth of
the heads, FlexAttention eager, cuDNN an error; wall-clock medians, no memory figures).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from headdim_bench import bench_on, finish, guarded, passes  # noqa: E402

# name -> (variant of flexfa.bench_cases, B, Hq, Hkv, S, E), most wanted first
CASES = {
    "causal": ("causal", 1, 16, 16, 16384, 128),
    "gqa": ("causal", 2, 32, 8, 8192, 128),
    "alibi": ("alibi", 1, 16, 16, 16384, 128),
    "long": ("causal", 1, 8, 8, 65536, 128),
    "full": ("full", 1, 16, 16, 16384, 128),
    "softcap": ("softcap", 1, 16, 16, 16384, 128),
    "sliding": ("sliding", 1, 16, 16, 16384, 128),
    "document": ("document", 1, 16, 16, 16384, 128),
    "e64": ("causal", 2, 16, 16, 8192, 64),
}
PEERS = ("flexfa", "flexfa_ds", "torch_flex", "cudnn")
MIB = 2 ** 20


def shape(name: str, device: str) -> tuple:
    """(variant, B, Hq, Hkv, S, E) of a case; on the CPU (a smoke run) S = 128, B = 1 and an
    eighth of the heads."""
    variant, B, Hq, Hkv, S, E = CASES[name]
    if device == "cpu":
        B, Hq, Hkv, S = 1, max(1, Hq // 8), max(1, Hkv // 8), 128
    return variant, B, Hq, Hkv, S, E


def run_case(name: str, device: str, compiled, bench, peers) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask

    import flexfa
    from flexfa.bench_cases import bench_variants
    from flexfa.runtime import plans

    variant, B, Hq, Hkv, S, E = shape(name, device)
    gqa = Hq != Hkv
    generator = torch.Generator(device=device).manual_seed(S + E)
    q = torch.randn(B, Hq, S, E, device=device, dtype=torch.bfloat16, generator=generator)
    k, v = (torch.randn(B, Hkv, S, E, device=device, dtype=torch.bfloat16, generator=generator)
            for _ in range(2))
    inputs = [t.requires_grad_() for t in (q, k, v)]
    score_mod, mask_mod = bench_variants(S, Hq, device)[variant]
    case = {"case": name, "variant": variant, "B": B, "Hq": Hq, "Hkv": Hkv, "S": S, "E": E}
    # what any implementation must hold: out, lse (fwd); out, lse, dq, dk, dv (fwd+bwd)
    out_bytes, lse_bytes = q.numel() * 2, B * Hq * S * 4
    grads = sum(t.numel() * 2 for t in inputs)
    case["outputs_mib"] = {"fwd": round((out_bytes + lse_bytes) / MIB, 1),
                           "fwd_bwd": round((out_bytes + lse_bytes + grads) / MIB, 1)}
    # flexfa's default backward: those, and delta [B, Hq, L] float32 (and, added once flexfa
    # ran, the Gluon backward's dQ accumulator where that plan ran)
    case["flexfa_formula_mib"] = round((out_bytes + lse_bytes + grads + lse_bytes) / MIB, 1)

    def rows(forward, what=("fwd", "fwd_bwd")) -> dict:
        return passes(forward, inputs, bench, what)

    def flexfa_rows(options=None, what=("fwd", "fwd_bwd")) -> dict:
        mask = flexfa.create_block_mask(mask_mod, None, None, S, S, device=device) \
            if mask_mod else None
        plans.PLANS.clear()
        found = rows(lambda: flexfa.flex_attention(q, k, v, score_mod, mask, enable_gqa=gqa,
                                                   kernel_options=options), what)
        found["plans"] = sorted({describe(plan) for plan in plans.PLANS.values()})
        found["accumulator_mib"] = round(sum(plan.fixed.get("accumulator_bytes", 0)
                                             for plan in plans.PLANS.values()) / MIB, 1)
        return found

    def torch_rows() -> dict:
        mask = torch_block_mask(mask_mod, None, None, S, S, device=device) if mask_mod else None
        return rows(lambda: compiled(q, k, v, score_mod=score_mod, block_mask=mask,
                                     enable_gqa=gqa))

    def cudnn_rows() -> dict:
        def forward():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=variant == "causal",
                                                      enable_gqa=gqa)
        return rows(forward)
    makers = {"flexfa": flexfa_rows,
              "flexfa_ds": lambda: flexfa_rows({"DS_WORKSPACE": True}, ("fwd_bwd",)),
              "torch_flex": torch_rows, "cudnn": cudnn_rows}
    for peer in peers:
        if peer == "cudnn" and (score_mod is not None or variant not in ("full", "causal")):
            continue  # not expressible in SDPA
        guarded(case, peer, makers[peer])
        if device == "cuda":
            torch.cuda.empty_cache()
    if isinstance(case.get("flexfa"), dict) and "accumulator_mib" in case["flexfa"]:
        # the Gluon backward's fp32 dQ accumulator (a part of the heads at a time), if it ran
        case["flexfa_formula_mib"] = round(case["flexfa_formula_mib"]
                                           + case["flexfa"]["accumulator_mib"], 1)
    outs = {peer: case[peer].pop("out") for peer in peers
            if isinstance(case.get(peer), dict) and "out" in case[peer]}
    if "flexfa" in outs:
        case["max_abs_diff_vs_flexfa"] = {
            peer: float((out.float() - outs["flexfa"].float()).abs().max())
            for peer, out in outs.items() if peer != "flexfa"}
    return case


def describe(plan) -> str:
    spec = dataclasses.asdict(plan.spec)
    fields = ("block_m1", "block_n1", "block_m2", "block_n2", "ds_dq", "use_tma")
    return plan.family.name + "".join(f" {f}={spec[f]}" for f in fields if f in spec)


def value(case: dict, peer: str, pass_: str, field: str):
    try:
        return case[peer][pass_][field]
    except (KeyError, TypeError):
        return None


def ratio(top, bottom):
    return None if top is None or bottom is None or not bottom else round(top / bottom, 3)


def summarize(case: dict) -> dict:
    """x peer: the peer's time over flexfa's (> 1: flexfa faster); mem/flex: flexfa's peak
    extra memory over FlexAttention's (the issue's target <= 1.2)."""
    found = {}
    for pass_ in ("fwd", "fwd_bwd"):
        ms, mib = value(case, "flexfa", pass_, "ms"), value(case, "flexfa", pass_, "peak_mib")
        found[pass_] = {
            "x_torch_flex": ratio(value(case, "torch_flex", pass_, "ms"), ms),
            "x_cudnn": ratio(value(case, "cudnn", pass_, "ms"), ms),
            "x_flexfa_ds": ratio(value(case, "flexfa_ds", pass_, "ms"), ms),
            "mem_over_torch_flex": ratio(mib, value(case, "torch_flex", pass_, "peak_mib")),
            "ds_mem_over_torch_flex": ratio(value(case, "flexfa_ds", pass_, "peak_mib"),
                                            value(case, "torch_flex", pass_, "peak_mib"))}
    return found


def table(cases: list[dict]) -> str:
    def cell(number, digits=3, width=9):
        return f"{'-' if number is None else f'{number:.{digits}f}':>{width}}"
    head = (f"{'case':<9}{'pass':<8}{'flexfa':>9}{'ds':>9}{'flex':>9}{'cudnn':>9}{'x flex':>8}"
            f"{'x cudnn':>8}{'x ds':>7} | {'MiB':>8}{'ds MiB':>8}{'flex MiB':>9}{'cudnn':>8}"
            f"{'mem/fl':>7}{'ds/fl':>7}")
    lines = ["times in ms (x peer: its time / flexfa's); peak extra memory in MiB", head]
    for case in cases:
        for pass_ in ("fwd", "fwd_bwd"):
            r = case["ratios"][pass_]
            lines.append(
                f"{case['case']:<9}{pass_:<8}"
                + "".join(cell(value(case, p, pass_, "ms")) for p in PEERS)
                + cell(r["x_torch_flex"], 2, 8) + cell(r["x_cudnn"], 2, 8)
                + cell(r["x_flexfa_ds"], 2, 7) + " | "
                + "".join(cell(value(case, p, pass_, "peak_mib"), 0, w)
                          for p, w in zip(PEERS, (8, 8, 9, 8)))
                + cell(r["mem_over_torch_flex"], 2, 7) + cell(r["ds_mem_over_torch_flex"], 2, 7))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="JSON file for the results (rewritten after every case)")
    parser.add_argument("--budget", type=float, default=240.0,
                        help="seconds after which no new case starts (default 240)")
    parser.add_argument("--cases", default=",".join(CASES), help="comma list of " + ", ".join(CASES))
    parser.add_argument("--peers", default=",".join(PEERS), help="comma list of " + ", ".join(PEERS))
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    for name in args.cases.split(","):
        if name not in CASES:
            parser.error(f"--cases: unknown case {name!r}; the cases are {', '.join(CASES)}")
    peers = args.peers.split(",")
    for peer in peers:
        if peer not in PEERS:
            parser.error(f"--peers: unknown peer {peer!r}; the peers are {', '.join(PEERS)}")

    import torch
    from torch.nn.attention.flex_attention import flex_attention

    from manifest import manifest

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --device cpu for a smoke run)")
    for limit in ("cache_size_limit", "recompile_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, limit):  # one compile per case
            setattr(torch._dynamo.config, limit, 256)
    # a smoke run calls FlexAttention eagerly (no C++ compiler needed on the CPU)
    compiled = torch.compile(flex_attention, dynamic=False) if args.device == "cuda" \
        else flex_attention

    bench = bench_on(args.device, rep=50)

    results = {"manifest": manifest(" ".join([sys.argv[0], *(argv or sys.argv[1:])])),
               "args": vars(args), "cases": [], "skipped": []}
    last = 0.0
    for name in args.cases.split(","):
        began = time.perf_counter()
        if began - start + last > args.budget:
            results["skipped"].append(name)
            continue
        case = run_case(name, args.device, compiled, bench, peers)
        case["ratios"] = summarize(case)
        last = time.perf_counter() - began
        case["elapsed_s"] = round(time.perf_counter() - start, 1)
        results["cases"].append(case)
        fwd_bwd = case["ratios"]["fwd_bwd"]
        print(f"{name}: fwd+bwd x flex {fwd_bwd['x_torch_flex']}, memory / flex "
              f"{fwd_bwd['mem_over_torch_flex']} ({case['elapsed_s']} s)", flush=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
    finish(results, args.out, table(results["cases"]), args.budget)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
