"""One benchmark case run a few times, as the target process of Nsight Compute (``ncu``):
flexfa's forward (and backward) on the project's variants (``flexfa.bench_cases``), bf16, B=1.

    ncu --clock-control none -k regex:gluon --launch-skip 2 --launch-count 1 --set full \\
        -o prof python benchmarks/ncu_case.py --variant full --options '{"BACKEND": "GLUON"}'

``--calls`` calls follow one warm-up call (which compiles); ``--backward`` runs each call's
backward too. The kernels' names (``flexfa_fwd_gluon_...``, ``flexfa_bwd_...``) select what
``ncu -k`` profiles.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", default="full")
    parser.add_argument("--E", type=int, default=128)
    parser.add_argument("--S", type=int, default=16384)
    parser.add_argument("--H", type=int, default=16)
    parser.add_argument("--options", default="{}", help="flexfa kernel_options as JSON")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--backward", action="store_true")
    args = parser.parse_args(argv)
    options = json.loads(args.options)
    if not isinstance(options, dict):
        parser.error(f"--options must be a JSON object, got {args.options!r}")

    import torch

    import flexfa
    from flexfa.bench_cases import bench_variants

    variants = bench_variants(args.S, args.H, "cuda")
    if args.variant not in variants:
        parser.error(f"--variant must be one of {sorted(variants)}, got {args.variant!r}")
    score_mod, mask_mod = variants[args.variant]
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, args.H, args.S, args.E, device="cuda", dtype=torch.bfloat16,
                           requires_grad=args.backward) for _ in range(3))
    mask = (flexfa.create_block_mask(mask_mod, None, None, args.S, args.S, device="cuda")
            if mask_mod else None)
    do = torch.randn_like(q)
    for _ in range(1 + args.calls):
        out = flexfa.flex_attention(q, k, v, score_mod=score_mod, block_mask=mask,
                                    kernel_options=options)
        if args.backward:
            out.backward(do)
    torch.cuda.synchronize()
    print(f"{args.variant} E={args.E} S={args.S}: {1 + args.calls} calls done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
