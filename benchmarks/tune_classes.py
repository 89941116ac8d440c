"""Tune the forward and the backward once per class on this GPU, before a benchmark run.

One fwd+bwd call per (head dim, mask density class, short/long kv length) of the benchmark's
grid (full, causal, document and sliding window at S = 2048 and 16384 cover every class), so
that the tuning happens here and the benchmark run reads the winners from
``<cache dir>/autotune.json`` instead of tuning inside its own time. Prints every class's
candidate timings (the backward's: the two kernels against the fused dK/dV + dQ kernel) and
copies autotune.json to --out.

    PYTHONPATH=. FLEXFA_CACHE_DIR=/tmp/fxc python benchmarks/tune_classes.py --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import time


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."),
                        help="where autotune.json is copied ($OUT, else .)")
    parser.add_argument("--dims", default="128,64", help="head dims (%(default)s)")
    parser.add_argument("--seqs", default="16384,2048", help="sequence lengths (%(default)s)")
    parser.add_argument("--variants", default="full,causal,document,sliding",
                        help="benchmark variants (%(default)s)")
    return parser


if __name__ == "__main__":  # --help and argument errors before the imports below
    build_parser().parse_args()

import torch

import flexfa
from flexfa.bench_cases import bench_variants
from flexfa.runtime import autotune
from flexfa.runtime.cache_location import usable_cache_dir


def main() -> None:
    args = build_parser().parse_args()
    start = time.perf_counter()
    for D in map(int, args.dims.split(",")):
        for S in map(int, args.seqs.split(",")):
            B, H = max(1, 16384 // S), 16
            q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3))
            do = torch.randn_like(q)
            variants = bench_variants(S, H, "cuda")
            for name in args.variants.split(","):
                score_mod, mask_mod = variants[name]
                mask = flexfa.create_block_mask(mask_mod, B, None, S, S, device="cuda") \
                    if mask_mod else None
                t0 = time.perf_counter()
                flexfa.flex_attention(q, k, v, score_mod=score_mod, block_mask=mask).backward(do)
                torch.cuda.synchronize()
                print(f"[{time.perf_counter() - start:5.0f}s] E={D} S={S} {name} "
                      f"({autotune.density_class(mask)}): first fwd+bwd "
                      f"{time.perf_counter() - t0:.1f} s", flush=True)
            del q, k, v, do
            torch.cuda.empty_cache()
    path = usable_cache_dir() / "autotune.json"
    data = json.loads(path.read_text())
    print("\nclass                                          winner            candidates (ms)")
    for key in sorted(k for k in data if not k.startswith("_")):
        timings = data["_timings_ms"].get(key, {})
        shown = ", ".join(f"{label} {ms:.3f}" if isinstance(ms, float) else f"{label} {ms}"
                          for label, ms in timings.items())
        print(f"{key:46} {str(data[key]):17} {shown}")
    os.makedirs(args.out, exist_ok=True)
    shutil.copy(path, os.path.join(args.out, "autotune.json"))


if __name__ == "__main__":
    main()
