"""``python -m flexfa.fp8.bench``: the FP8 forward beside flexfa's bf16 forward, in one process.

Per case (variant, S, D): flexfa bf16 forward, the FP8 kernel on pre-quantized inputs
("fp8", what FlashAttention-3 reports, with pointer loads, kernel_options ``USE_TMA=False``;
"fp8-tma": the same with tiles loaded through tensor descriptors, ``USE_TMA=True``), and
quantize + kernel ("fp8+quant", what ``flex_attention_fp8`` on bf16 inputs costs, default load
path). Times are medians of ``triton.testing.do_bench``;
FLOPs are 4*B*H*L*S*D times the mask's block density. Each row also has the relative L2 error
of the FP8 output against the bf16 one. ``run_fp8(args)`` returns the rows for the main
benchmark (``flexfa/bench.py``) to merge; this module also writes ``fp8_results.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from .. import config

FP8_VARIANTS = ("full", "causal", "alibi", "softcap", "document")


def _case_rows(name, S, D, B, H, q, k, v, score_mod, block_mask, density, rep, options=None):
    import torch
    from triton.testing import do_bench

    import flexfa

    from .api import flex_attention_fp8
    from .quantize import quantize

    x = quantize(q, k, v)

    def fp8(use_tma: bool):
        return flex_attention_fp8(x, score_mod=score_mod, block_mask=block_mask,
                                  kernel_options={**(options or {}), "USE_TMA": use_tma})

    impls = {
        "flexfa-bf16": lambda: flexfa.flex_attention(q, k, v, score_mod=score_mod,
                                                     block_mask=block_mask),
        # the FP8 kernel with pointer loads
        "flexfa-fp8": lambda: fp8(False),
        # what flex_attention_fp8 on bf16 tensors costs, with the default load path
        "flexfa-fp8+quant": lambda: flex_attention_fp8(q, k, v, score_mod=score_mod,
                                                       block_mask=block_mask,
                                                       kernel_options=options),
        # the FP8 kernel with tensor-descriptor (TMA) loads
        "flexfa-fp8-tma": lambda: fp8(True),
    }
    outs, rows = {}, []
    for label, fn in impls.items():
        try:
            outs[label] = fn()
            torch.cuda.synchronize()
        except Exception as exc:  # a failing case is recorded, the run goes on
            rows.append(dict(impl=label, variant=name, S=S, D=D, B=B, H=H, pass_="fwd",
                             error=repr(exc)[:200]))
            continue
        ms = do_bench(fn, warmup=25, rep=rep, return_mode="median")
        flops = 4 * B * H * S * S * D * density
        rows.append(dict(impl=label, variant=name, S=S, D=D, B=B, H=H, pass_="fwd", ms=ms,
                         tflops=flops / ms / 1e9, density=density))
    reference = outs.get("flexfa-bf16")
    for row in rows:
        out = outs.get(row["impl"])
        if reference is not None and out is not None:
            diff = (out.double() - reference.double()).norm() / reference.double().norm()
            row["relerr_vs_bf16"] = float(diff)
    bf16 = next((r["ms"] for r in rows if r["impl"] == "flexfa-bf16" and "ms" in r), None)
    for row in rows:
        if bf16 is not None and "ms" in row:
            row["speedup_vs_bf16"] = bf16 / row["ms"]
    return rows


def run_fp8(args) -> list[dict]:
    """Rows for ``args.seqs`` x ``args.dims`` x ``args.variants`` (all comma-separated)."""
    import torch

    import flexfa
    from flexfa.bench_cases import bench_variants

    torch.manual_seed(0)
    options = json.loads(getattr(args, "kernel_options", "") or "null")
    rows = []
    with torch.no_grad():
        for S in [int(s) for s in args.seqs.split(",")]:
            for D in [int(d) for d in args.dims.split(",")]:
                B, H = max(1, args.tokens // S), args.heads
                q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
                           for _ in range(3))
                variants = bench_variants(S, H, "cuda")
                for name in args.variants.split(","):
                    score_mod, mask_mod = variants[name]
                    block_mask = (flexfa.create_block_mask(mask_mod, B, None, S, S, device="cuda")
                                  if mask_mod else None)
                    density = 1.0 - block_mask.sparsity() / 100.0 if block_mask else 1.0
                    for row in _case_rows(name, S, D, B, H, q, k, v, score_mod, block_mask,
                                          density, args.rep, options):
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                del q, k, v
                torch.cuda.empty_cache()
    return rows


def print_table(rows) -> None:
    print(f"\n{'variant':9} {'S':>6} {'D':>4} {'impl':17} {'ms':>8} {'TF/s':>6} "
          f"{'x bf16':>7} {'relerr':>8}")
    for r in rows:
        if "ms" not in r:
            print(f"{r['variant']:9} {r['S']:6} {r['D']:4} {r['impl']:17} error: {r['error']}")
            continue
        print(f"{r['variant']:9} {r['S']:6} {r['D']:4} {r['impl']:17} {r['ms']:8.3f} "
              f"{r['tflops']:6.0f} {r.get('speedup_vs_bf16', float('nan')):7.2f} "
              f"{r.get('relerr_vs_bf16', float('nan')):8.1e}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flexfa.fp8.bench", description=__doc__)
    parser.add_argument("--seqs", default="4096,16384")
    parser.add_argument("--dims", default="128")
    parser.add_argument("--variants", default=",".join(FP8_VARIANTS))
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--rep", type=int, default=100, help="do_bench repetition time in ms")
    parser.add_argument("--kernel-options", default="",
                        help='FP8 kernel_options as JSON, e.g. \'{"BLOCK_N": 128, "num_stages": 2}\'')
    parser.add_argument("--out", default=config.environment("OUT", "."))
    args = parser.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("the FP8 benchmark needs a CUDA GPU (compute capability >= 8.9)", file=sys.stderr)
        return 2
    from flexfa.bench_cases import versions
    rows = run_fp8(args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fp8_results.json"), "w") as f:
        json.dump({"meta": versions(), "rows": rows}, f, indent=1)
    print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
