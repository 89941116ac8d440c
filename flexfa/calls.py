"""``attention_call``: the checks after tracing and the ``AttentionCall`` they allow.

Shared by ``flexfa.flex_attention`` (eager) and the ``flexfa::`` operators (``flexfa.ops``,
what a ``torch.compile``d graph runs), so both make a call the same way.
"""
from __future__ import annotations

from .blockmask.analysis import check_broadcast
from .blockmask.coarsen import runnable_block_mask
from .blockmask.validate import check_tables
from .frontend.grad import check_mask_mod_grad
from .frontend.trace import TracedMod
from .inputs import broadcast_batch, check_buffers
from .lazy import lazy_function
from .runtime.call import AttentionCall, Dropout
from .runtime.options import KernelOptions
from .runtime.pipeline import prepare_mask
from .scores import check_score_range


# its range analysis loads the code generator: on the first call, not at import
check_captured_indices = lazy_function("flexfa.runtime.indices", "check_captured_indices")


def attention_call(query, key, value, score: TracedMod | None, block_mask, scale: float,
                   options: KernelOptions, grad_enabled: bool, sinks=None,
                   dropout: Dropout | None = None) -> tuple:
    """(the AttentionCall, key, value) of a call whose tensors, shapes and block mask passed
    ``flexfa.inputs``' checks: the tables' contents (again after any edit), the score range,
    the mask the kernels can tile (``runnable_block_mask``), the captured tensors' devices
    and index ranges. key and value come back broadcast over the query's batch. ``sinks``
    (checked: ``flexfa.features.check_sinks``) and ``dropout`` are the call's features."""
    past = check_tables(block_mask, query.shape[2], key.shape[2])  # again after any edit
    key, value = broadcast_batch(query, key, value)
    check_score_range(query, key, scale)  # only for an enormous scale
    mask = prepare_mask(block_mask)
    check_broadcast(mask, block_mask, *query.shape[:3], key.shape[2])
    runnable = runnable_block_mask(block_mask, mask, past)
    if runnable is not block_mask:  # blocks the kernels cannot tile: an equal coarser mask
        block_mask, mask = runnable, runnable.traced_mask
    if mask is not None and grad_enabled:
        check_mask_mod_grad(mask)  # a mask has no gradient: error on grad-requiring captures
    check_buffers(score, "score_mod", query.device)
    check_buffers(mask, "mask_mod", query.device)
    check_captured_indices(score, mask, query.shape, key.shape[2], query.device)
    call = AttentionCall(score, mask, block_mask, scale, options, query.shape[1] // key.shape[1],
                         sinks, dropout)
    return call, key, value
