"""The forward pass: the plan of a call's signature (made once by the family that runs it),
then its launch.

``run_forward(q, k, v, call, return_lse, return_max)`` assumes validated inputs
(``flexfa.api`` checks them). A cached call costs building the plan's key, one lookup and the
family's ``run`` (allocate the outputs, bind the tensors, launch the compiled kernel).
"""
from __future__ import annotations

from .. import memo
from ..codegen.fp8 import FOLD_MIN_SCALE
from . import families  # noqa: F401  (registers the kernel families)
from . import plans, registry
from .call import AttentionCall
from .layout import int32_addressable_inputs, output_like
from .outputs import empty_outputs, out_strides
from .target import target_of

__all__ = ["AttentionCall", "run_forward", "run_fp8_forward", "forward_plan_key"]


def forward_plan_key(q, k, v, call: AttentionCall, return_lse: bool, return_max: bool) -> tuple:
    return ("forward", return_lse, return_max, *plans.layout_key(q, k, v, call))


def run_forward(q, k, v, call: AttentionCall, return_lse: bool, return_max: bool = False):
    """(out [B, Hq, L, Ev] in q's dtype, lse [B, Hq, L] float32 natural log or None, the
    rows' max scores [B, Hq, L] float32 or None): ``return_max`` is torch's
    ``AuxRequest(max_scores=True)``, max over keys of score_mod(q.k * scale) where the mask
    keeps the key, -inf for a row with nothing to attend."""
    kept = call.plans  # a prepared call's plans (flexfa.prepared): valid until a memo is cleared
    if kept is not None:
        found = kept.get((return_lse, return_max))
        if found is not None and found[0] == memo.CLEARS:
            plan = found[1]
            if plan.depends is None or plans.current(plan, call):  # (no call: the hot path)
                return plan.family.run(plan, call, q, k, v, return_lse, return_max)
    narrow = int32_addressable_inputs(q, k, v)
    if narrow is not None:  # copies the kernels can address (never kept: not the hot path)
        out, lse, maxs = _run(*narrow, call, return_lse, return_max, None)
        return _in_layout_of(q, out), lse, maxs
    return _run(q, k, v, call, return_lse, return_max, kept)


def _in_layout_of(q, out):
    """``out`` (computed from a copy of ``q``) laid out as ``q``'s output is (torch's)."""
    if out.stride() == tuple(out_strides(q, out)):
        return out
    return output_like(q, out.shape[3]).copy_(out)


def _run(q, k, v, call: AttentionCall, return_lse: bool, return_max: bool, kept):
    """``run_forward`` past its prepared plans: the plan of the call's key, made where there is
    none (``kept``: the prepared call's plans, which take it; None: not kept)."""
    key = forward_plan_key(q, k, v, call, return_lse, return_max)
    plan = plans.find(call, key)
    if plan is not None:
        if kept is not None:
            kept[(return_lse, return_max)] = (memo.CLEARS, plan)
        return plan.family.run(plan, call, q, k, v, return_lse, return_max)
    if q.numel() == 0 or v.shape[3] == 0:
        return empty_outputs(q, v, return_lse, return_max)
    target = target_of(q.device)
    family = registry.choose("forward", target, call, q, k, v)
    return family.first_call(key, target, call, q, k, v, return_lse, return_max)


def run_fp8_forward(x, call: AttentionCall, return_lse: bool):
    """(out [B, Hq, L, Ev] in ``x.dtype``, lse [B, Hq, L] float32 or None) of the FP8
    forward on quantized inputs ``x`` (``flexfa.fp8.quantize``)."""
    # (the scale's size decides the fold of the descales: FOLD_MIN_SCALE)
    key = ("fp8", return_lse, x.dtype, x.block_q, x.block_kv, x.positive_scales,
           call.scale >= FOLD_MIN_SCALE,
           x.q_scale.stride(), x.k_scale.stride(), x.v_scale.stride(),
           plans.aligned(x.q_scale, x.k_scale, x.v_scale),
           *plans.layout_key(x.q, x.k, x.v, call))
    plan = plans.find(call, key)
    if plan is not None:
        return plan.family.run(plan, call, x, return_lse)
    if x.q.numel() == 0 or x.v.shape[3] == 0:
        out, lse, _ = empty_outputs(x.q, x.v, return_lse, False)
        return out.to(x.dtype), lse
    target = target_of(x.q.device)
    family = registry.choose("fp8", target, call, x)
    return family.first_call(key, target, call, x, return_lse)
