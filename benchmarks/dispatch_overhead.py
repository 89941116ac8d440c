"""Python-side dispatch cost of a cached flexfa call, on a GPU, at a tiny shape.

Times N back-to-back ``flex_attention`` calls (host clock, one synchronize at the end) on a
shape whose kernel takes a few microseconds, against N launches of the same compiled kernel
made directly, and against torch's SDPA. The difference is flexfa's per-call Python work.
Prints one JSON line per measurement.
"""
from __future__ import annotations

import argparse
import json
import time


def _per_call_us(fn, calls: int) -> float:
    import torch

    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main(calls: int = 2000) -> dict:
    import torch
    import torch.nn.functional as F

    import flexfa

    q, k, v = (torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    mask = flexfa.create_block_mask(causal, 1, None, 128, 128, device="cuda")
    results = {
        "flexfa_dense_us": _per_call_us(lambda: flexfa.flex_attention(q, k, v), calls),
        "flexfa_causal_us": _per_call_us(
            lambda: flexfa.flex_attention(q, k, v, block_mask=mask), calls),
        "sdpa_us": _per_call_us(lambda: F.scaled_dot_product_attention(q, k, v), calls),
        # the pointer-load template: no host tensor descriptors to encode per launch
        "flexfa_dense_pointer_template_us": _per_call_us(
            lambda: flexfa.flex_attention(q, k, v, kernel_options={"BACKEND": "AMPERE"}), calls),
        "empty_like_us": _per_call_us(lambda: torch.empty_like(q), calls),
    }
    print(json.dumps(results), flush=True)
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("calls", nargs="?", type=int, default=2000,
                        help="calls per measurement (default 2000)")
    main(parser.parse_args().calls)
