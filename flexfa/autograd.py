"""``FlexAttentionFunction``: flex_attention as a ``torch.autograd.Function``.

The forward runs the generated forward kernel and saves what the backward needs: q, k, v,
out, lse (float32, natural log), the dropout seed (the backward draws the same keep mask) and
the score_mod's captured tensors; the backward reads those as autograd unpacks them (under
saved-tensor hooks, ``save_on_cpu`` offloading, copies of the forward's values; under
non-reentrant activation checkpointing, the recomputation's). ``ctx.call`` keeps the
prepared mods, the block mask, the scale, the kernel options and the sinks; the backward
checks by their version counters that the tensors of ``ctx.call`` it reads besides the saved
ones were not edited since. The
backward runs the generated backward kernels (``flexfa.runtime.backward``): P is recomputed
tile by tile from lse, never stored. Gradients flow into q, k, v, into the score_mod's captured tensors that
require grad, into the attention sinks, and through lse when the caller used it
(``return_lse=True``).

The backward is not differentiable. A backward run with ``create_graph=True`` returns
gradients that raise when they are differentiated in turn (a gradient penalty, a
Hessian-vector product): torch's ``once_differentiable`` raises only when the incoming
gradient requires grad, which ``out.sum()``'s does not, and else returns gradients that
silently have no second derivative. Differentiating them with respect to the incoming
gradients (the double-backward form of a Jacobian-vector product) raises too.

torch.func's transforms (vmap, grad, jvp, ...) and forward-mode AD (dual tensors) are refused
with an InputError: the kernels have neither batching rules nor tangents.
"""
from __future__ import annotations

import dataclasses

import torch

from .blockmask.validate import TABLES, check_tables, table_state, tables_of
from .errors import InputError, dims
from .flops import count as count_flops
from .inputs import refuse_transforms
from .lazy import lazy_function
from .memo import version_of
from .runtime.call import SINKS_GRAD, AttentionCall, Dropout
from .runtime.layout import memory_values

# the runtime (and Triton) load on the first call
run_forward = lazy_function("flexfa.runtime.forward", "run_forward")
run_backward = lazy_function("flexfa.runtime.backward", "run_backward")
joint_graph = lazy_function("flexfa.runtime.backward", "joint_graph")

DOUBLE_BACKWARD_MESSAGE = (
    "flexfa.flex_attention does not support double backward: a gradient computed with "
    "create_graph=True was differentiated again (a gradient penalty, a Hessian-vector product "
    "or another higher-order gradient), and flex_attention's backward kernels have no "
    "derivative. First-order gradients work: call loss.backward() or "
    "torch.autograd.grad(loss, inputs) without create_graph=True, or detach the gradients "
    "before building a loss on them")


_NOTHING: dict = {}  # (read only)


class FlexAttentionFunction(torch.autograd.Function):
    """apply(query, key, value, call: AttentionCall, return_max: bool, sinks or None,
    *score_mod_buffers, *dropped) -> (out, lse, row max or None); ``sinks`` is ``call.sinks``
    (an input here so that it gets its gradient); ``dropped``: captured tensors the trace
    removed that require grad (``TracedMod.dropped``: zero gradients); the row max
    (``AuxRequest(max_scores=True)``) has no gradient, as in torch."""

    @staticmethod
    def forward(ctx, query, key, value, call: AttentionCall, return_max: bool, sinks,
                *buffers):
        joint_graph(call.score)  # derive now: a mod without a derivative fails early
        out, lse, maxs = run_forward(query, key, value, call, return_lse=True,
                                     return_max=return_max)
        ctx.call = call
        # the seed as a saved tensor: a recomputation (non-reentrant checkpointing without
        # the RNG's state restored) draws another one with the out and lse it recomputes
        seed = call.dropout.seed if call.dropout is not None else None
        # inference tensors cannot be saved (torch raises) and have no version counter (an
        # edit inside inference mode before the backward went unseen: the gradients of
        # another forward): a copy of each captured one is kept on ctx for the backward
        ctx.inference = _inference_copies(buffers) if buffers else _NOTHING
        if ctx.inference:
            buffers = [None if n in ctx.inference else t for n, t in enumerate(buffers)]
        mask_buffers = call.mask.buffers if call.mask is not None else ()
        ctx.mask_inference = _inference_copies(mask_buffers) if mask_buffers else _NOTHING
        ctx.save_for_backward(query, key, value, out, lse, seed, *buffers)
        ctx.versions = _read_versions(call)
        ctx.buffer_versions = () if call.score is None else tuple(
            version_of(t) for t in call.score.buffers)
        if maxs is not None:
            ctx.mark_non_differentiable(maxs)
        # unused outputs get None instead of zeros: no lse gradient means no dlse term
        ctx.set_materialize_grads(False)
        return out, lse, maxs

    @staticmethod
    def backward(ctx, grad_out, grad_lse, grad_max):
        # the engine runs backward in create_graph's mode: without it grad mode is off already
        # (a no_grad block costs a few microseconds on every cached backward)
        # read once: under non-reentrant activation checkpointing each read recomputes (and
        # a second read raises CheckpointError)
        saved = ctx.saved_tensors
        refuse_transforms("flex_attention", (grad_out, grad_lse))  # (batched gradients)
        # compiled autograd has Dynamo trace this backward (an eager forward's, or one of a
        # graph break): the kernels run as they are, outside its graph
        gradients = outside_dynamo(_gradients) if torch.compiler.is_compiling() else _gradients
        if not torch.is_grad_enabled():
            return gradients(ctx, saved, grad_out, grad_lse)
        with torch.no_grad():
            grads = gradients(ctx, saved, grad_out, grad_lse)
        # the incoming gradients too: d(dq)/d(grad_out) is a Jacobian-vector product
        return not_differentiable(grads, saved[:3] + saved[6:]
                                  + (ctx.call.sinks, grad_out, grad_lse))


def not_differentiable(grads, inputs) -> tuple:
    """``grads`` (a backward's, run with create_graph=True) as gradients that raise
    DOUBLE_BACKWARD_MESSAGE when differentiated, as torch's once_differentiable does when the
    incoming gradients require grad (and only then); ``inputs`` (the Function's, those that
    require grad) join the raising node too, so that differentiating with respect to them
    reaches it."""
    inputs = [t for t in inputs if t is not None and t.requires_grad]
    raising = torch._C._functions.DelayedError(DOUBLE_BACKWARD_MESSAGE,
                                                len(grads) + len(inputs))
    fakes = (None if g is None else g.detach().requires_grad_() for g in grads)
    return raising(*fakes, *inputs)[:len(grads)]


_OUTSIDE: dict = {}  # backward body -> its Dynamo-disabled twin (two module functions)


def outside_dynamo(function):
    """``function`` (a backward's module-level body) as one Dynamo runs without tracing it,
    for compiled autograd tracing an eager call's backward (made on first use: decorating at
    import would load Dynamo with flexfa)."""
    made = _OUTSIDE.get(function)
    if made is None:
        made = _OUTSIDE[function] = torch.compiler.disable(function)
    return made


def _gradients(ctx, saved: tuple, grad_out, grad_lse) -> tuple:
    """The backward's results: (dq, dk, dv, None, None, d sinks or None, *captured-tensor
    gradients); ``saved``: ``ctx.saved_tensors``, read once by the caller."""
    query, key, value, out, lse, seed = saved[:6]
    buffers = saved[6:]
    if ctx.inference:
        buffers = tuple(ctx.inference.get(n, t) for n, t in enumerate(buffers))
    call = _as_saved(ctx.call, seed, buffers, ctx.buffer_versions)
    if ctx.mask_inference:  # the forward's copies of the mask_mod's inference tensors
        mask = call.mask
        call = call.replaced(call.score, call.dropout, dataclasses.replace(
            mask, buffers=tuple(ctx.mask_inference.get(n, t)
                                for n, t in enumerate(mask.buffers))))
    check_tables(call.block_mask, query.shape[2], key.shape[2])  # edited since the forward?
    _check_unedited(call.block_mask, ctx.versions)
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    if torch._C._len_torch_dispatch_stack():  # a FlopCounterMode counts it (flexfa.flops)
        count_flops(query, key.shape[2], value.shape[3], call.block_mask, backward=True)
    dq, dk, dv, buffer_grads = run_backward(
        query, key, value, out, lse, grad_out, grad_lse, call,
        need_dkdv=ctx.needs_input_grad[1] or ctx.needs_input_grad[2])
    if not ctx.needs_input_grad[0]:
        dq = None
    return (dq, dk, dv, None, None, buffer_grads.get(SINKS_GRAD),
            *(_buffer_grad(ctx, buffer_grads, slot, buffer)
              for slot, buffer in enumerate(buffers)))


def _inference_copies(tensors) -> dict:
    """{index: a copy} of the inference tensors among ``tensors`` (none: ``_NOTHING``)."""
    copies = {n: t.clone() for n, t in enumerate(tensors) if t.is_inference()}
    return copies or _NOTHING


def _as_saved(call: AttentionCall, seed, buffers: tuple, versions: tuple) -> AttentionCall:
    """``call`` with the dropout seed and the score_mod's captured tensors as autograd
    unpacked them, where they are other objects than the call's own: under saved-tensor hooks
    copies of the forward's values (the call's own tensors may have been edited since, which
    torch's version check does not see there), under non-reentrant checkpointing without the
    RNG's state restored the recomputation's seed, drawn with the out and lse the backward
    reads. A replaced captured tensor keeps the requires_grad of the call's (which slots get
    gradients). An InputError where an unpacked captured tensor shares the call's tensor's
    memory and that was edited in place since the forward (``versions``: its version counter
    then): a hook that keeps the tensor itself (``save_on_cpu`` of a CPU tensor), where
    torch checks nothing and the backward would read the new values."""
    score, dropout = call.score, call.dropout
    if score is not None and score.buffers:
        own = score.buffers
        for s, o, version in zip(buffers, own, versions):
            if version is not None and o._version != version and _same_memory(s, o):
                raise InputError(
                    f"a tensor the score_mod captures (shape {dims(o)}) was edited in "
                    "place between flex_attention's forward and its backward, which reads it "
                    "(saved-tensor hooks kept the tensor itself, so torch's own check did not "
                    "run); the gradients would be those of another forward: edit it after the "
                    "backward, or pass a copy to the forward")
        buffers = tuple(memory_values(s) for s in buffers)  # (hooks' negated views)
        if any(s is not o for s, o in zip(buffers, own)):
            score = dataclasses.replace(score, buffers=tuple(
                s if s is o or s.requires_grad == o.requires_grad
                else s.detach().requires_grad_(o.requires_grad)
                for s, o in zip(buffers, own)))
    if dropout is not None and seed is not dropout.seed:
        dropout = Dropout(dropout.p, seed)
    if score is call.score and dropout is call.dropout:
        return call
    return call.replaced(score, dropout)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.device == b.device and a.untyped_storage().data_ptr()
                      == b.untyped_storage().data_ptr())


_TABLE_NAMES = tuple(f"block_mask.{name}" for name in TABLES)
_MASK_TENSOR = "a tensor the mask_mod captures"


def _read_versions(call: AttentionCall) -> tuple:
    """What the backward reads besides q, k, v and the score_mod's captured tensors (which
    autograd saves), as it is now: (the block mask's ``TableState``, which ``check_tables``
    replaces whenever a table may have changed, [(what, tensor, version counter)] of the
    sinks and the mask_mod's captured tensors). A mask without a recorded state (a slotted
    mask object) or with inference tables lists its tables' versions instead; inference
    tensors have no version counter to check. (No generators: this runs on every call that
    needs a gradient.)"""
    reads = []
    sinks = call.sinks
    if sinks is not None and not sinks.is_inference():
        reads.append(("sinks", sinks, sinks._version))
    if call.mask is not None:
        for tensor in call.mask.buffers:
            if not tensor.is_inference():
                reads.append((_MASK_TENSOR, tensor, tensor._version))
    mask = call.block_mask
    state = None if mask is None else table_state(mask)
    if mask is not None and (state is None or state.versions is None):
        state = None
        reads += [(what, t, t._version) for what, t in zip(_TABLE_NAMES, tables_of(mask))
                  if t is not None and not t.is_inference()]
    return state, reads


def _check_unedited(block_mask, versions: tuple) -> None:
    """An InputError if one of ``_read_versions``' tensors was edited in place since the
    forward (the tables: ``check_tables``, run just before, found them changed and recorded a
    new state; the others: their version counter moved): the backward would silently give
    the gradients of another forward, where torch's flex_attention, which saves them for
    backward, raises."""
    state, reads = versions
    if state is not None and table_state(block_mask) is not state:
        reads = [("a table of block_mask", block_mask.kv_num_blocks, None)]
    check_versions(reads)


def check_versions(reads, prefix: str = "",
                   between: str = "flex_attention's forward and its backward, which reads it"
                   ) -> None:
    """An InputError naming the first ``(what, tensor, version)`` of ``reads`` whose version
    counter moved: edited in place ``between`` two points (``prefix``: the entry point)."""
    for what, tensor, version in reads:
        if tensor._version != version:
            raise InputError(
                f"{prefix}{what} (shape {dims(tensor)}) was edited in place between "
                f"{between}; the gradients would be those of another forward: edit it after "
                "the backward, or pass a copy to the forward")


def _buffer_grad(ctx, buffer_grads: dict, slot: int, buffer: torch.Tensor):
    """Captured tensor ``slot``'s gradient; zeros where it requires grad but no score depends
    on it differentiably (read only through a step, ``score + bias.floor()``, or in a branch
    the trace removed: ``TracedMod.dropped``): the kernels compute none, and torch's eager
    gradient is zeros there, not None (an optimizer skips a parameter whose gradient is
    None)."""
    grad = buffer_grads.get(slot)
    if grad is None and ctx.needs_input_grad[6 + slot]:
        grad = torch.zeros_like(buffer)
    return grad
