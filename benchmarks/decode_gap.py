"""Decode-shaped calls (few queries, a long KV cache): flexfa against torch FlexAttention
(compiled, which switches to its split-KV decoding kernel for short queries) and SDPA, in one
process. flexfa runs with ``kernel_options={"SPLIT_KV": --split-kv}`` (``0``, the default:
one program per batch, query head and q tile walks the whole cache; ``AUTO``: split-KV
decoding; ``n``: about n splits). Prints median ms (``do_bench``) and the K and V bytes per ms
as GB/s.

    PYTHONPATH=. python benchmarks/decode_gap.py [--split-kv 0|AUTO|n]
"""
from __future__ import annotations

import argparse
import json


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--split-kv", default="0", help="flexfa's SPLIT_KV kernel option: 0, "
                        "AUTO or a number of splits (default 0)")
    return parser


if __name__ == "__main__":  # --help and argument errors before the imports below
    build_parser().parse_args()

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention as torch_flex
from triton.testing import do_bench

import flexfa


def main() -> None:
    setting = build_parser().parse_args().split_kv
    options = {"SPLIT_KV": int(setting) if setting.isdigit() else setting}
    compiled = torch.compile(torch_flex, dynamic=False)
    rows = []
    for B, L, S in ((1, 1, 32768), (8, 1, 32768), (1, 16, 32768), (32, 1, 4096)):
        Hq, Hkv, E = 32, 8, 128
        q = torch.randn(B, Hq, L, E, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, Hkv, S, E, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        fns = {"flexfa": lambda: flexfa.flex_attention(q, k, v, enable_gqa=True,
                                                      kernel_options=options),
               "flex": lambda: compiled(q, k, v, enable_gqa=True),
               "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)}
        ref = fns["sdpa"]().float()
        kv_bytes = 2 * k.numel() * k.element_size()
        for name, fn in fns.items():
            err = float((fn().float() - ref).norm() / ref.norm())
            ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
            row = dict(B=B, L=L, S=S, Hq=Hq, Hkv=Hkv, E=E, impl=name, ms=ms, split_kv=setting,
                       gb_per_s=kv_bytes / ms / 1e6, relerr=err)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'B':>3} {'L':>3} {'S':>6} {'impl':>7} {'ms':>8} {'GB/s':>7} {'relerr':>8}")
    for r in rows:
        print(f"{r['B']:>3} {r['L']:>3} {r['S']:>6} {r['impl']:>7} {r['ms']:8.3f} "
              f"{r['gb_per_s']:7.0f} {r['relerr']:8.1e}")


if __name__ == "__main__":
    main()
