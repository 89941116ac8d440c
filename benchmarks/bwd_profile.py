"""Where a fwd+bwd step's time goes: per-kernel CUDA time (torch.profiler) against the wall
time per step, for flexfa and FlexAttention on a few variants.

    PYTHONPATH=. python benchmarks/bwd_profile.py [S] [D] [variants] [impls]

(impls: "flexfa,flex" by default; "flexfa" alone skips FlexAttention's compile; "cudnn":
SDPA's cuDNN backend, on the full and causal variants only)
"""
from __future__ import annotations

import argparse
import time


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("seq_len", nargs="?", type=int, default=2048, help="S (default 2048)")
    parser.add_argument("head_dim", nargs="?", type=int, default=64, help="E (default 64)")
    parser.add_argument("variants", nargs="?", default="causal,sliding,alibi",
                        help="benchmark variants, comma-separated (%(default)s)")
    parser.add_argument("impls", nargs="?", default="flexfa,flex",
                        help="flexfa, flex (torch FlexAttention, compiled) and/or cudnn (SDPA's "
                        "cuDNN backend; full and causal only) (%(default)s)")
    return parser


if __name__ == "__main__":  # --help and argument errors before the imports below
    build_parser().parse_args()

import torch
from torch.profiler import ProfilerActivity, profile

import flexfa
from flexfa.bench_cases import bench_variants as _variants


def _cudnn(q, k, v, causal: bool):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def main() -> None:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    args = build_parser().parse_args()
    S, D, names, wanted = (args.seq_len, args.head_dim, args.variants.split(","),
                           args.impls.split(","))
    B, H = max(1, 16384 // S), 16
    compiled = torch.compile(flex_attention, dynamic=False)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)
    for name in names:
        score_mod, mask_mod = _variants(S, H, "cuda")[name]
        fbm = flexfa.create_block_mask(mask_mod, B, None, S, S, device="cuda") \
            if mask_mod else None
        tbm = create_block_mask(mask_mod, B, None, S, S, device="cuda") if mask_mod else None
        impls = {"flexfa": lambda: flexfa.flex_attention(q, k, v, score_mod, fbm),
                 "flex": lambda: compiled(q, k, v, score_mod=score_mod, block_mask=tbm),
                 "cudnn": lambda: _cudnn(q, k, v, name == "causal")}
        for label, fn in impls.items():
            if label not in wanted or (label == "cudnn" and name not in ("full", "causal")):
                continue

            def step():  # fresh gradients each step, as the benchmark's do_bench(grad_to_none)
                q.grad = k.grad = v.grad = None
                fn().backward(do)
            for _ in range(5):
                step()
            torch.cuda.synchronize()
            steps = 20
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                start = time.perf_counter()
                for _ in range(steps):
                    step()
                torch.cuda.synchronize()
                wall = (time.perf_counter() - start) / steps * 1e3
            kernels: dict[str, float] = {}
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    key = e.name[:60]
                    kernels[key] = kernels.get(key, 0.0) + e.device_time / steps / 1e3
            gpu = sum(kernels.values())
            print(f"{name:8} {label:7} wall {wall:.3f} ms/step, kernels {gpu:.3f} ms/step")
            for key, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:8]:
                print(f"    {ms:.3f}  {key}")


if __name__ == "__main__":
    main()
