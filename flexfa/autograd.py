"""``FlexAttentionFunction``: flex_attention as a ``torch.autograd.Function``.

The forward runs the generated forward kernel and saves what the backward needs: q, k, v,
out, lse (float32, natural log) and the score_mod's captured tensors; ``ctx.call`` keeps the
prepared mods, the block mask, the scale and the kernel options.
"""
from __future__ import annotations

import torch

from .runtime.forward import AttentionCall, run_forward


class FlexAttentionFunction(torch.autograd.Function):
    """apply(query, key, value, call: AttentionCall, *score_mod_buffers) -> (out, lse)."""

    @staticmethod
    def forward(ctx, query, key, value, call: AttentionCall, *buffers):
        out, lse = run_forward(query, key, value, call, return_lse=True)
        ctx.call = call
        ctx.save_for_backward(query, key, value, out, lse, *buffers)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        raise NotImplementedError("flexfa: the backward pass of flex_attention is not "
                                  "implemented yet")
