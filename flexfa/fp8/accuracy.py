"""The outlier accuracy study of docs/fp8.md (FlashAttention-3's test, with outlier channels).

Q, K, V are standard normal, except that a few head-dim channels of Q and K (the same ones:
LLM activations have outlier features in fixed channels) are ``factor`` times larger, with
factors spread over [10, 100]. Three results are compared with float64 attention on the same
bf16 inputs: flexfa's bf16 kernel, plain FP8 (one scale per tensor, no rotation) and FP8 with
per-block scales and the Hadamard rotation. ``python -m flexfa.fp8.accuracy`` prints them.
"""
from __future__ import annotations

import argparse
import math

import torch

from ..api import flex_attention
from ..reference import attention_reference
from .api import flex_attention_fp8
from .quantize import quantize


def outlier_inputs(B=1, H=2, L=256, S=256, E=64, channels=4, low=10.0, high=100.0, seed=0,
                   device="cpu", dtype=torch.bfloat16):
    """bf16 q, k, v; ``channels`` channels of q and k scaled by factors from ``low`` to ``high``.

    The outlier channels are scaled by ``factor / sqrt(factor)`` in q and in k, so their
    q.k products grow by ``factor`` while the softmax does not saturate outright.
    """
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, E, generator=generator) for n in (L, S, S))
    picked = torch.randperm(E, generator=generator)[:channels]
    factors = torch.logspace(math.log10(low), math.log10(high), channels)
    for channel, factor in zip(picked.tolist(), factors.tolist()):
        q[..., channel] *= math.sqrt(factor)
        k[..., channel] *= math.sqrt(factor)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)]


def rmse(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).pow(2).mean().sqrt())


def compare(q, k, v, score_mod=None, block_mask=None, block_size=128,
            ablation=False) -> dict[str, float]:
    """RMSE vs float64 of the bf16 kernel, per-tensor FP8 and block-scaled rotated FP8 (with
    ``ablation``, also block scales without rotation and rotation with one scale)."""
    mask_mod = block_mask.mask_mod if block_mask is not None else None
    exact = attention_reference(q, k, v, score_mod, mask_mod)
    with torch.no_grad():
        bf16 = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
        plain = flex_attention_fp8(quantize(q, k, v, block_size, rotate=False, per_tensor=True),
                                   score_mod=score_mod, block_mask=block_mask)
        best = flex_attention_fp8(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                  rotate=True, block_size=block_size)
    result = {"bf16": rmse(bf16, exact), "fp8_per_tensor": rmse(plain, exact),
              "fp8_block_rotated": rmse(best, exact), "out_rms": rmse(exact, 0 * exact)}
    if ablation:
        for name, rotate, per_tensor in (("fp8_block_only", False, False),
                                         ("fp8_rotated_only", True, True)):
            x = quantize(q, k, v, block_size, rotate=rotate, per_tensor=per_tensor)
            with torch.no_grad():
                out = flex_attention_fp8(x, score_mod=score_mod, block_mask=block_mask)
            result[name] = rmse(out, exact)
    result["ratio_vs_per_tensor"] = result["fp8_block_rotated"] / result["fp8_per_tensor"]
    result["ratio_vs_bf16"] = result["fp8_block_rotated"] / result["bf16"]
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flexfa.fp8.accuracy", description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    args = parser.parse_args(argv)
    q, k, v = outlier_inputs(H=args.heads, L=args.seq, S=args.seq, E=args.dim, device=args.device)
    for name, value in compare(q, k, v, ablation=True).items():
        print(f"{name:22} {value:.3e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
