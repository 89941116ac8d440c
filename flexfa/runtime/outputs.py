"""The outputs of a forward call and how the forward kernels receive them."""
from __future__ import annotations

import torch

from ..blockmask.density import density_class
from .layout import output_like, output_strides


def allocate_outputs(q, v, return_lse: bool, return_max: bool) -> tuple:
    """Empty (out [B, Hq, L, Ev] in q's dtype, laid out in the query's dimension order as
    torch does (``layout.output_like``), lse and row max [B, Hq, L] float32 or None)."""
    B, Hq, L, _ = q.shape
    device = q.device
    out = output_like(q, v.shape[3])
    if not (return_lse or return_max):  # the common case, on every cached call
        return out, None, None
    lse = torch.empty(B, Hq, L, dtype=torch.float32, device=device) if return_lse else None
    maxs = torch.empty(B, Hq, L, dtype=torch.float32, device=device) if return_max else None
    return out, lse, maxs


def stat_args(out, lse, maxs) -> list:
    """The LSE and MAXS kernel arguments: each statistic, or ``out`` as an unused pointer where
    it was not requested (RETURN_LSE / RETURN_MAX off)."""
    return [lse if lse is not None else out, maxs if maxs is not None else out]


def present_or(tensor, other):
    """``tensor``, or ``other`` where it is None (an unused pointer argument)."""
    return other if tensor is None else tensor


def forward_grid(batch_heads: int, q_tiles: int, has_block_mask: bool) -> tuple[int, int]:
    """The grid of the Hopper and FP8 forward templates: under a block mask (B * HQ, q tiles),
    which fwd_common.tmpl's flexfa_longest_first reads in dispatch order (HEAD_GROUP
    heads at a time, each group's longest q tiles first:
    ``head_group``); dense (q tiles, B * HQ), where the programs of one head running
    together share its K and V in L2."""
    return (batch_heads, q_tiles) if has_block_mask else (q_tiles, batch_heads)


# the K and V bytes a head group's programs aim to keep in L2 (kernel argument HEAD_GROUP):
# the Gluon forward's dynamic tiles at S = 16384, E = 128 (8 MiB a head) ran causal, ALiBi,
# softcap and prefix forwards in 0.92-0.95x the time of all 16 heads at once with groups of
# 1 and 2 heads, 0.95-0.98x with 4; the Hopper family's grid with these groups causal at E =
# 64 0.90-0.96x, E = 128 0.92-0.99x; the FP8 forward's (K and V of one byte) causal 0.92-0.97x
# at S = 2048-16384. Under sparse masks grouped heads ran slower (Gluon: document 1.07x,
# sliding 1.01x the time; Hopper: document 1.08x; FP8: document 1.02-1.08x), so those keep
# every head in one group (docs/gluon.md, "Heads in groups")
L2_GROUP_BYTES = 16 * 2 ** 20


def head_group(call, q, k, v) -> int:
    """Query heads per group of the forward's order under a block mask: kernel_options
    HEAD_GROUP, else under a sparse block mask all of them (B * Hq, the plain longest-first
    order), else as many kv heads as ``L2_GROUP_BYTES`` of K and V hold, at least one, times
    the GQA group (the query heads of a kv head share its K and V); never more than B * Hq
    (the same order), so the kernels' q tiles * HEAD_GROUP stays within their program count
    (an int32)."""
    batch_heads = q.shape[0] * q.shape[1]
    if call.options.head_group:
        return min(call.options.head_group, batch_heads)
    if density_class(call.block_mask) == "sparse":
        return batch_heads
    per_head = k.shape[2] * (k.shape[3] * k.element_size() + v.shape[3] * v.element_size())
    return min(call.gqa_group * max(1, L2_GROUP_BYTES // max(per_head, 1)), batch_heads)


def empty_outputs(q, v, return_lse: bool, return_max: bool) -> tuple:
    """The outputs of a call with no query row or no head: lse and row max are -inf."""
    out, lse, maxs = allocate_outputs(q, v, return_lse, return_max)
    for stat in (lse, maxs):
        if stat is not None:
            stat.fill_(float("-inf"))
    return out, lse, maxs


def out_strides(q, v) -> list[int]:
    """The strides of the output ``allocate_outputs`` gives for these q and v."""
    return output_strides((*q.shape[:3], v.shape[3]), q.stride())
