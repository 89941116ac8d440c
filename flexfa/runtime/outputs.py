"""The outputs of a forward call and how the forward kernels receive them."""
from __future__ import annotations

import torch

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
    heads on the fast axis, so the longest q tiles of every head start first; dense (q tiles,
    B * HQ), where the programs of one head running together share its K and V in L2."""
    return (batch_heads, q_tiles) if has_block_mask else (q_tiles, batch_heads)


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
