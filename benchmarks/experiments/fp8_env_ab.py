"""FP8 kernel variants selected by an environment variable, timed in one process (H200 runs).

``python benchmarks/experiments/fp8_env_ab.py --env FLEXFA_FP8_EXP16 --values 0,1`` quantizes the
benchmark's inputs once (``flexfa.fp8.quantize``, rotated, 128-row blocks), then for each
case times ``flex_attention_fp8`` on them under each value of the variable, alternating the
values for ``--rounds`` rounds (``triton.testing.do_bench`` medians), next to flexfa's bf16
forward; prints per case and value the median over rounds, TFLOP/s, the ratio to bf16 and
the largest difference from the first value's output. (The descale-fold A/B in
benchmarks/results/fp8_f0b9546/ ran it with a temporary switch, FLEXFA_FP8_FOLD, that the
working tree had then; the fold that won is now chosen by the runtime, not by a variable.)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import triton

import flexfa
from flexfa import fp8
from flexfa.bench import _variants


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", required=True)
    parser.add_argument("--values", required=True)
    parser.add_argument("--cases", default="128:16384:full,128:16384:causal")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rep", type=int, default=100)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16384)
    args = parser.parse_args(argv)
    values = args.values.split(",")
    rows = []
    for case in args.cases.split(","):
        dim, seq, variant = case.split(":")
        D, S = int(dim), int(seq)
        B, H = max(1, args.tokens // S), args.heads
        score_mod, mask_mod = _variants(S, H, "cuda")[variant]
        mask = flexfa.create_block_mask(mask_mod, B, None, S, S, device="cuda") \
            if mask_mod else None
        density = 1.0 - mask.sparsity() / 100.0 if mask is not None else 1.0
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        x = fp8.quantize(q, k, v)
        fns = {"bf16": lambda: flexfa.flex_attention(q, k, v, score_mod, mask)}
        for value in values:
            def run(value=value):
                os.environ[args.env] = value
                return fp8.flex_attention_fp8(x, score_mod=score_mod, block_mask=mask)
            fns[value] = run
        outs = {name: fn().float() for name, fn in fns.items()}
        times = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                times[name].append(triton.testing.do_bench(fn, rep=args.rep,
                                                           return_mode="median"))
        flops = 4 * B * H * S * S * D * density
        base = statistics.median(times["bf16"])
        for name in fns:
            ms = statistics.median(times[name])
            row = {"case": case, "variant_value": name, "ms": ms,
                   "tflops": flops / ms / 1e9, "x_bf16": base / ms,
                   "max_diff_vs_first": (outs[name] - outs[values[0]]).abs().max().item()
                   if name != "bf16" else None, "times": times[name]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'case':22} {args.env + '=':>18} {'ms':>7} {'TF/s':>6} {'x bf16':>7} {'diff':>8}")
    for r in rows:
        diff = "" if r["max_diff_vs_first"] is None else f"{r['max_diff_vs_first']:8.1e}"
        print(f"{r['case']:22} {r['variant_value']:>18} {r['ms']:7.3f} {r['tflops']:6.0f} "
              f"{r['x_bf16']:7.3f} {diff}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
