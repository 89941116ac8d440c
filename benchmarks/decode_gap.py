"""Decode-shaped calls (few queries, a long KV cache): flexfa against torch FlexAttention
(compiled, which switches to its split-KV decoding kernel for short queries) and SDPA, in one
process. flexfa runs with the process's ``FLEXFA_SPLIT_KV`` (its default ``0``: one program
per batch, query head and q tile walks the whole cache; ``auto``: split-KV decoding), which
on sm_90 is read when a signature is first planned: run the script once per setting. Prints
median ms (``do_bench``) and the K and V bytes per ms as GB/s.

    PYTHONPATH=. python benchmarks/decode_gap.py
"""
from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention as torch_flex
from triton.testing import do_bench

import flexfa


def main() -> None:
    compiled = torch.compile(torch_flex, dynamic=False)
    setting = os.environ.get("FLEXFA_SPLIT_KV", "0")
    rows = []
    for B, L, S in ((1, 1, 32768), (8, 1, 32768), (1, 16, 32768), (32, 1, 4096)):
        Hq, Hkv, E = 32, 8, 128
        q = torch.randn(B, Hq, L, E, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, Hkv, S, E, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        fns = {"flexfa": lambda: flexfa.flex_attention(q, k, v, enable_gqa=True),
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
