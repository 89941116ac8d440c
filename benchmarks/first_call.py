"""First call of a new mod on the GPU: flexfa's own work (trace, codegen, cache write, module
import) apart from Triton's compile, next to FlexAttention's first call (torch.compile).

Triton's share is the time spent in ``JITFunction._do_compile`` (compile + binary load); the
rest of the first call, minus one cached call's time, is flexfa's. Prints one JSON line.
``--options JSON``: the calls' kernel_options (default ``{"BLOCK_M": 128}``: the Hopper
family's pinned tiles, no tuning; ``{"BACKEND": "GLUON"}`` times the Gluon forward's first
call); ``--backward``: each call is a forward and a backward (FlexAttention's too).

    python benchmarks/first_call.py [OUT.json] [--options JSON] [--backward]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time


def main(out_path: str | None = None, options: dict | None = None,
         backward: bool = False) -> dict:
    import os

    os.environ["FLEXFA_CACHE_DIR"] = tempfile.mkdtemp(prefix="flexfa-first-")
    import torch
    import triton.runtime.jit as jit

    import flexfa

    spent = {"triton_s": 0.0}
    original = jit.JITFunction._do_compile

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            spent["triton_s"] += time.perf_counter() - start
    jit.JITFunction._do_compile = timed

    cap = 27.0 + time.time() % 1.0  # a constant no cache has seen: a new mod

    def new_softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    options = {"BLOCK_M": 128} if options is None else options  # pinned tiles: no tuning
    S, D = 2048, 128
    q, k, v = (torch.randn(8, 16, S, D, device="cuda", dtype=torch.bfloat16,
                           requires_grad=backward) for _ in range(3))
    mask = flexfa.create_block_mask(causal, 8, None, S, S, device="cuda")

    def step(attention, **kwargs):
        out = attention(q, k, v, score_mod=new_softcap, **kwargs)
        if backward:
            out.sum().backward()
        torch.cuda.synchronize()

    torch.cuda.synchronize()
    start = time.perf_counter()
    step(flexfa.flex_attention, block_mask=mask, kernel_options=options)
    first = time.perf_counter() - start
    start = time.perf_counter()
    step(flexfa.flex_attention, block_mask=mask, kernel_options=options)
    cached = time.perf_counter() - start

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    tmask = create_block_mask(causal, 8, None, S, S, device="cuda")
    compiled = torch.compile(flex_attention)
    torch.cuda.synchronize()
    start = time.perf_counter()
    step(compiled, block_mask=tmask)
    flex_first = time.perf_counter() - start
    result = {"options": options, "backward": backward, "flexfa_first_call_s": first,
              "triton_compile_s": spent["triton_s"],
              "flexfa_own_ms": (first - spent["triton_s"] - cached) * 1e3,
              "flexfa_cached_call_ms": cached * 1e3, "flex_attention_first_call_s": flex_first}
    print(json.dumps(result), flush=True)
    if out_path:
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", help="also write the JSON line to this file")
    parser.add_argument("--options", type=json.loads, default=None,
                        help='the calls\' kernel_options as JSON (default {"BLOCK_M": 128})')
    parser.add_argument("--backward", action="store_true",
                        help="time forward + backward first calls")
    args = parser.parse_args()
    main(args.out, args.options, args.backward)
