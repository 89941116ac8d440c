"""A/B of the Hopper forward's lazy rescale (RESCALE_THRESHOLD 0 vs 8) on two large cases.

Prints one JSON line per measurement and, last, the threshold to use: 8 if the lazy rescale
is faster on both cases by more than 1%, else 0.
"""
from __future__ import annotations

import json
import os

os.environ["FLEXFA_AUTOTUNE"] = "0"  # the default tiles for both sides

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import flexfa  # noqa: E402
from flexfa.codegen import hopper as codegen_hopper  # noqa: E402
from flexfa.runtime import hopper  # noqa: E402


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def main() -> int:
    cases = [(16384, 128, causal), (16384, 64, None)]
    times = {}
    for S, D, mask_mod in cases:
        q, k, v = (torch.randn(1, 16, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        mask = flexfa.create_block_mask(mask_mod, 1, None, S, S, device="cuda") if mask_mod else None
        for threshold in (0, 8):
            codegen_hopper.RESCALE_THRESHOLD = threshold
            hopper._KERNELS.clear()
            hopper._PLANS.clear()
            out = flexfa.flex_attention(q, k, v, block_mask=mask)
            ms = do_bench(lambda: flexfa.flex_attention(q, k, v, block_mask=mask), warmup=10,
                          rep=50, return_mode="median")
            times[(S, D, threshold)] = ms
            print(json.dumps({"S": S, "D": D, "threshold": threshold, "ms": ms,
                              "out_norm": float(out.float().norm())}), flush=True)
    lazy_wins = all(times[(S, D, 8)] < 0.99 * times[(S, D, 0)] for S, D, _ in cases)
    print(8 if lazy_wins else 0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
