"""``Plan``: everything about a call signature that is worked out once, and the one cache of plans.

A plan belongs to a kernel family (``flexfa.runtime.registry``) and holds its spec, its
launch steps (``flexfa.runtime.launch.Step``) and what the family precomputed for binding a
call's tensors (``fixed``). The cache key is the call's layout (shapes, strides, dtypes,
device, alignment, captured tensors' layout, the block-mask tables' layout) plus its mods,
options and GQA group: everything a step's kernel is specialized on. Plans that read a block
mask's tables live under the mask (``MaskedMemo``), so dropping the mask drops them.
"""
from __future__ import annotations

import dataclasses

from ..blockmask.validate import table_generations
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


def find(call: AttentionCall, key: tuple) -> Plan | None:
    return PLANS.get(call.block_mask, key)


def keep(call: AttentionCall, key: tuple, plan: Plan) -> Plan:
    PLANS.put(call.block_mask, key, plan)
    return plan
