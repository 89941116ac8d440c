"""GPU: the forward under a block mask at several ``HEAD_GROUP`` values in one process.

``python benchmarks/experiments/head_group_ab.py --cases 128:16384:causal,... --groups 0,1,2,16
[--fp8] [--rounds 5]`` times flexfa's forward (bf16, or with ``--fp8`` the FP8 forward on
pre-quantized inputs, ``flexfa.fp8.flex_attention_fp8``) on the benchmark's inputs (B x S =
``--tokens``, H = 16) with ``kernel_options={"HEAD_GROUP": g}`` for each g (0: the runtime's
default, ``flexfa.runtime.outputs.head_group``; B x H or more: every head in one group, the
order before groups), ``triton.testing.do_bench`` medians in rounds in
``flexfa.bench.round_order``'s balanced order (fp8_group_effa31e's run rotated it), checks
that every order gives the bit-identical output, and prints each group's median and its
speed against every head in one group. A case's variant takes
``flexfa.bench_cases.split_variant``'s suffixes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="128:16384:causal")
    parser.add_argument("--groups", default="0,1,2,4",
                        help="HEAD_GROUP values; every head in one group is always added")
    parser.add_argument("--fp8", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rep", type=int, default=100)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--out", default="")
    args = parser.parse_args()

    import torch
    from triton.testing import do_bench

    import flexfa
    from flexfa.bench import round_order
    from flexfa.bench_cases import bench_variants, split_variant
    from flexfa.fp8 import flex_attention_fp8, quantize

    rows = []
    for case in args.cases.split(","):
        dim, seq, variant = case.split(":")
        E, S, H = int(dim), int(seq), 16
        B = max(1, args.tokens // S)
        base, group, dropout, nomask = split_variant(variant, H)
        if dropout or nomask:
            raise SystemExit(f"{case}: HEAD_GROUP orders work under a block mask, without dropout")
        score_mod, mask_mod = bench_variants(S, H, "cuda")[base]
        if mask_mod is None:
            raise SystemExit(f"{case}: no block mask, HEAD_GROUP changes nothing")
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, h, S, E, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for h in (H, H // group, H // group))
        mask = flexfa.create_block_mask(mask_mod, B, None, S, S, device="cuda")
        x = quantize(q, k, v) if args.fp8 else None
        values = [int(g) for g in args.groups.split(",")]
        values += [] if B * H in values else [B * H]

        def fn(g):
            options = {"HEAD_GROUP": g}
            if args.fp8:
                return lambda: flex_attention_fp8(x, score_mod=score_mod, block_mask=mask,
                                                  enable_gqa=group > 1, kernel_options=options)
            return lambda: flexfa.flex_attention(q, k, v, score_mod, mask, enable_gqa=group > 1,
                                                 kernel_options=options)
        fns = {g: fn(g) for g in values}
        outs = {g: f() for g, f in fns.items()}
        plain = outs[B * H]
        same = {g: bool(torch.equal(o, plain)) for g, o in outs.items()}
        times = {g: [] for g in values}
        for r in range(args.rounds):
            for g in round_order(values, r):
                times[g].append(do_bench(fns[g], warmup=25, rep=args.rep, return_mode="median"))
        all_heads = statistics.median(times[B * H])
        for g in values:
            ms = statistics.median(times[g])
            row = dict(case=case, fp8=args.fp8, B=B, head_group=g, ms=ms, rounds=times[g],
                       speed_vs_all_heads=all_heads / ms, bit_equal=same[g])
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'case':24} {'fp8':>4} {'group':>6} {'ms':>8} {'speed':>7} {'equal':>6}")
    for r in rows:
        print(f"{r['case']:24} {str(r['fp8']):>4} {r['head_group']:6} {r['ms']:8.3f} "
              f"{r['speed_vs_all_heads']:7.3f} {str(r['bit_equal']):>6}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "head_group_ab.json"), "w") as f:
            json.dump({"rows": rows, "gpu": torch.cuda.get_device_name(),
                       "torch": torch.__version__}, f, indent=1)
    return 0 if all(r["bit_equal"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
