"""``Plan``: everything about a call signature that is worked out once, and the one cache of plans.

A plan belongs to a kernel family (``flexfa.runtime.registry``) and holds its spec, its
launch steps (``flexfa.runtime.launch.Step``) and what the family precomputed for binding a
call's tensors (``fixed``). The cache key is the call's layout (shapes, strides, dtypes,
device, alignment, captured tensors' layout, the block-mask tables' layout) plus its mods,
options and GQA group: everything a step's kernel is specialized on. Plans that read a block
mask's tables live under the mask (``MaskedMemo``), so dropping the mask drops them. A plan
whose steps also depend on the tables' contents or on whether a CUDA graph is being captured
(the decode family's union walk) says so in ``depends``; ``find`` passes over it when they
changed, and the new plan replaces it under the same key.
"""
from __future__ import annotations

import dataclasses

from ..blockmask.validate import capturing, table_generations
from ..memo import MaskedMemo
from .call import AttentionCall
from .launch import Step

PLANS = MaskedMemo(512, per_mask=32, name="plans")


@dataclasses.dataclass(eq=False)
class Plan:
    family: object  # the KernelFamily that made it and runs it
    spec: object
    steps: tuple[Step, ...]
    fixed: dict = dataclasses.field(default_factory=dict)
    # (capturing, contents generation) the plan was made for where its steps depend on more
    # than its key: values computed from the block mask's table contents of one generation
    # (None: any), made inside or outside a CUDA graph capture; None: valid for any call
    depends: tuple | None = None

    def __repr__(self) -> str:
        return f"Plan({self.family.name}, {self.steps})"


def aligned(*tensors) -> tuple[bool, ...]:
    return tuple(t.data_ptr() % 16 == 0 for t in tensors)


def layout_key(q, k, v, call: AttentionCall) -> tuple:
    """What of q, k, v, the captured tensors and the block mask a kernel specializes on."""
    key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, q.device,
           aligned(q, k, v), call.mods_key, table_generations(call.block_mask)[0])
    for mod in (call.score, call.mask):
        if mod is not None and mod.buffers:
            key += tuple((t.shape, t.stride(), t.data_ptr() % 16 == 0) for t in mod.buffers)
    return key


def current(plan: Plan, call: AttentionCall) -> bool:
    """Whether ``plan`` (found under the call's key; ``plan.depends`` not None) was made for
    what the call is now."""
    capture, contents = plan.depends
    return capture == capturing() and contents in (None, table_generations(call.block_mask)[1])


def find(call: AttentionCall, key: tuple) -> Plan | None:
    plan = PLANS.get(call.block_mask, key)
    return plan if plan is None or plan.depends is None or current(plan, call) else None


def keep(call: AttentionCall, key: tuple, plan: Plan) -> Plan:
    PLANS.put(call.block_mask, key, plan)
    return plan


def q_tables_depends(block_mask) -> tuple | None:
    """``Plan.depends`` of a plan whose steps fix the q side's tables (dK/dV): a mask without
    its own q tables has them transposed from the kv tables' contents when the plan is made
    (``tables.mask_tables``); None where the mask has them (or there is no mask)."""
    if block_mask is None or getattr(block_mask, "q_num_blocks", None) is not None:
        return None
    return capturing(), table_generations(block_mask)[1]


def keep_backward(call: AttentionCall, key: tuple, plan: Plan) -> Plan:
    """``keep`` a backward plan (``depends``: ``q_tables_depends``) unless its transposed
    tables cannot be told apart from a later call's: made inside a CUDA graph capture (memory
    only that graph fills) or from tables whose edits go unseen (inference tensors)."""
    if plan.depends is None or plan.depends[0] is False and plan.depends[1] is not None:
        keep(call, key, plan)
    return plan
