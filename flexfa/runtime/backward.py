"""The backward pass: dQ, dK, dV and the captured tensors' gradients of one flex_attention
call, through the plan of its signature (``flexfa.runtime.families.backward``).

P is recomputed from the saved lse tile by tile and never stored: by default nothing of size
L x S is allocated. Only when the caller opts in (kernel_options ``DS_WORKSPACE=True``) does
the dK/dV kernel store dS for the dQ kernel, in a workspace allocated for the duration of the
backward.
"""
from __future__ import annotations

import torch

from . import families  # noqa: F401  (registers the kernel families)
from . import plans, registry
from .call import SINKS_GRAD, AttentionCall
from .families.backward import (BOUND_BITS, FIXED_POINT_SCALE, REST_SCALE, Inputs,
                                joint_graph)
from .layout import int32_addressable, memory_values
from .target import target_of

__all__ = ["run_backward", "joint_graph", "SINKS_GRAD"]

CONTIGUOUS = torch.contiguous_format  # the gradients' layout, whatever q, k, v's
# sink_limit_lse: the largest float32 whose base-2 value (times float32 log2(e), as the kernels
# convert lse) is finite, 2.3586574e38: past every score the kernels resolve (2**100 was
# not: a finite score past it gave inf * 0 = NaN gradients in a +inf sink's rows)
SINK_LIMIT_LSE = float.fromhex("0x1.62e42ep+127")


def _key(x: Inputs, call: AttentionCall, fusable: bool) -> tuple:
    """The plan's key: the forward's layout key, the layout of out, dO and dlse, and which
    captured tensors require grad."""
    out, grad_out, grad_lse = x.out, x.grad_out, x.grad_lse
    return ("backward", fusable, out.stride(), grad_out.shape, grad_out.stride(),
            grad_out.dtype, (out.data_ptr() % 16 == 0, grad_out.data_ptr() % 16 == 0),
            None if grad_lse is None else (grad_lse.dtype, grad_lse.stride(),
                                           grad_lse.data_ptr() % 16 == 0),
            call.score.grad_buffers if call.score else None,
            *plans.layout_key(x.q, x.k, x.v, call))


def run_backward(q, k, v, out, lse, grad_out, grad_lse, call: AttentionCall,
                 need_dkdv: bool = True):
    """(dq, dk, dv, {slot: grad of captured tensor slot}) for one flex_attention call.

    ``need_dkdv=False`` (key and value need no gradient) skips the dK/dV kernel; dk and dv
    are then None. The dQ kernel always runs: it also produces the captured-tensor
    gradients. With attention sinks that require grad, the buffer gradients hold theirs under
    ``SINKS_GRAD`` (``sinks_grad``)."""
    # autograd's incoming gradients and the unpacked saved tensors as the kernels read them
    q, k, v, out, lse, grad_out, grad_lse = (memory_values(t) for t in (
        q, k, v, out, lse, grad_out, grad_lse))
    # copies where an offset inside a head would pass the kernels' int32 (rare huge layouts)
    q, k, v, out, grad_out = (int32_addressable(t, name) for t, name in (
        (q, "query"), (k, "key"), (v, "value"), (out, "the output"), (grad_out, "grad_out")))
    joint = joint_graph(call.score)
    grad_slots = joint.grad_slots if joint is not None else ()
    accs = accumulators(call, grad_slots)
    grads = {s: acc[0] for s, acc in accs.items()} if call.options.deterministic else accs
    sinks_need_grad = call.sinks is not None and call.sinks.requires_grad
    delta = torch.empty_like(lse, dtype=torch.float32, memory_format=CONTIGUOUS) \
        if sinks_need_grad else None
    # empty_like: a third of torch.empty(shape, dtype=, device=)'s host time. Without dK/dV
    # wanted a cached plan binds no dk, dv (its dK/dV kernel does not run); a plan is made
    # with real ones, whose strides it fixes
    dk, dv = (torch.empty_like(k, memory_format=CONTIGUOUS),
              torch.empty_like(v, memory_format=CONTIGUOUS)) if need_dkdv else (None, None)
    x = Inputs(q, k, v, out, lse if call.sinks is None else sink_limit_lse(call.sinks, lse),
               grad_out, grad_lse, torch.empty_like(q, memory_format=CONTIGUOUS),
               dk, dv, grads, delta)
    if q.numel() and k.numel():
        # the dS workspace only where no captured tensor needs a gradient and dK/dV are
        # wanted; when there is no room for it now (there was when it was planned), the call
        # takes the plan without it (nothing L x S)
        for fusable in (need_dkdv and not grad_slots, False):
            key = _key(x, call, fusable)
            try:
                plan = plans.find(call, key)
                if plan is not None:
                    plan.family.run(plan, call, x, fusable, need_dkdv)
                else:
                    if x.dk is None:
                        x.dk = torch.empty_like(k, memory_format=CONTIGUOUS)
                        x.dv = torch.empty_like(v, memory_format=CONTIGUOUS)
                    target = target_of(q.device)
                    family = registry.choose("backward", target, call, q, k, v)
                    family.first_call(key, target, call, x, fusable, need_dkdv)
                break
            except torch.cuda.OutOfMemoryError:
                if not fusable:
                    raise
    else:  # nothing to attend: all gradients are zero
        for t in (x.dq, x.dk, x.dv):
            if t is not None:
                t.zero_()
        if delta is not None:  # (out is 0: delta is -dlse)
            delta.copy_(-grad_lse if grad_lse is not None else torch.zeros_like(delta))
    buffer_grads = {}
    if sinks_need_grad:
        buffer_grads[SINKS_GRAD] = sinks_grad(call.sinks, lse, delta)
    for slot, acc in accs.items():
        buffer_grads[slot] = (fixed_point_value(acc) if acc.dtype == torch.int64
                              else acc).to(call.score.buffers[slot].dtype)
    if not need_dkdv:
        return x.dq, None, None, buffer_grads
    return x.dq, x.dk, x.dv, buffer_grads


def check_early(call: AttentionCall, q, k, v) -> None:
    """Raise at the forward of a call that needs a gradient what its backward family would
    raise on its first call because of kernel_options (GLUON_BWD_STAGES that do not fit
    shared memory was refused at the backward, after the forward ran). The caller calls it
    only where such an option is set (no family choice on the common path)."""
    if not (q.numel() and k.numel()):
        return
    registry.choose("backward", target_of(q.device), call, q, k, v).check_options(call, q, k, v)


def accumulators(call: AttentionCall, grad_slots) -> dict:
    """{slot: the kernels' gradient accumulator}, contiguous in the captured tensor's shape
    (the kernels bind its pointer and strides): float32, or with ``deterministic=True`` int64
    ``[3, *shape]``, the value words, their rests and the bound words (flexfa_grad_add,
    ``fixed_point_value``), whose first third the kernels bind."""
    if not call.options.deterministic:
        return {s: torch.zeros_like(call.score.buffers[s], dtype=torch.float32,
                                    memory_format=CONTIGUOUS) for s in grad_slots}
    return {s: torch.zeros((3, *call.score.buffers[s].shape), dtype=torch.int64,
                           device=call.score.buffers[s].device) for s in grad_slots}


def fixed_point_value(words: torch.Tensor) -> torch.Tensor:
    """The float64 gradient of a deterministic accumulator (``accumulators``): its value
    words over 2**32 plus their rests over 2**62, NaN where the entry's bound word is outside
    0 .. 2**BOUND_BITS - 1 (the magnitudes added sum to 2**30 or more, or 2**32 terms were
    nonzero: a word may have wrapped)."""
    value, rest, bound = words.unbind(0)
    return torch.where(bound >> BOUND_BITS == 0, value.double() / FIXED_POINT_SCALE
                       + rest.double() / REST_SCALE, float("nan"))


def sink_limit_lse(sinks, lse) -> torch.Tensor:
    """The lse the kernels read with attention sinks: in the heads whose sink is +inf, where
    the sink takes all the probability (out 0, lse +inf: the limit), lse becomes
    ``SINK_LIMIT_LSE``, past any finite score, so those rows give the limit's gradients (P
    is 0: nothing into q, k, v or captured tensors) instead of reading as rows that saw a
    +inf score (flexfa_poisoned_rows: NaN). A NaN lse stays NaN; beside a +inf score the
    row's NaN output makes its delta, and so its gradients, NaN."""
    return torch.where(sinks.detach().view(1, -1, 1) == float("inf"),
                       lse.clamp(max=SINK_LIMIT_LSE), lse)


def sinks_grad(sinks, lse, delta) -> torch.Tensor:
    """d loss / d sink_h = -sum over batches and rows of p_sink * delta, where p_sink =
    exp(sink_h - lse) is the sink's share of the row's softmax and delta = rowsum(dO * O)
    - dlse (the kernels' DELTA). A sink is a score whose value vector is 0: its dS is
    p_sink * (0 - delta), and d lse / d sink = p_sink adds the dlse term. Rows with lse -inf
    give 0: the sink is one of the row's scores, so lse >= sink and lse is -inf only where
    the sink is; lse clamped to the lowest finite float makes their exponent -inf - (finite)
    (one op where a test for -inf and a select took three) and changes no other row. A sink
    of +inf has p_sink 1, the limit (exp(inf - inf) is NaN): d sink = the sum of its rows'
    dlse, their out being 0. p_sink is NaN only there or where lse is NaN, whose rows' delta
    is NaN (their out is): NaN to 1 is one op and keeps those NaN."""
    lowest = torch.finfo(torch.float32).min
    p_sink = torch.exp(sinks.detach().float().view(1, -1, 1)
                       - lse.clamp(min=lowest)).nan_to_num(nan=1.0)
    return (-(p_sink * delta).sum(dim=(0, 2))).to(sinks.dtype)
