"""``FlexAttentionFunction``: flex_attention as a ``torch.autograd.Function``.

The forward runs the generated forward kernel and saves what the backward needs: q, k, v,
out, lse (float32, natural log) and the score_mod's captured tensors; ``ctx.call`` keeps the
prepared mods, the block mask, the scale and the kernel options. The backward runs the
generated backward kernels (``flexfa.runtime.backward``): P is recomputed tile by tile from
lse, never stored. Gradients flow into q, k, v, into the score_mod's captured tensors that
require grad, and through lse when the caller used it (``return_lse=True``).
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .runtime.backward import joint_graph, run_backward
from .runtime.forward import AttentionCall, run_forward


class FlexAttentionFunction(torch.autograd.Function):
    """apply(query, key, value, call: AttentionCall, return_max: bool, *score_mod_buffers) ->
    (out, lse, row max or None); the row max (``AuxRequest(max_scores=True)``) has no
    gradient, as in torch."""

    @staticmethod
    def forward(ctx, query, key, value, call: AttentionCall, return_max: bool, *buffers):
        joint_graph(call.score)  # derive now: a mod without a derivative fails early
        out, lse, maxs = run_forward(query, key, value, call, return_lse=True,
                                     return_max=return_max)
        ctx.call = call
        ctx.save_for_backward(query, key, value, out, lse, *buffers)
        if maxs is not None:
            ctx.mark_non_differentiable(maxs)
        # unused outputs get None instead of zeros: no lse gradient means no dlse term
        ctx.set_materialize_grads(False)
        return out, lse, maxs

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, grad_lse, grad_max):
        query, key, value, out, lse = ctx.saved_tensors[:5]
        call = ctx.call
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        dq, dk, dv, buffer_grads = run_backward(
            query, key, value, out, lse, grad_out, grad_lse, call,
            need_dkdv=ctx.needs_input_grad[1] or ctx.needs_input_grad[2])
        if not ctx.needs_input_grad[0]:
            dq = None
        buffers = call.score.buffers if call.score is not None else ()
        return (dq, dk, dv, None, None, *(buffer_grads.get(slot) for slot in range(len(buffers))))
