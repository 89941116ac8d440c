"""Conversions between a dense 0/1 tile grid and the ordered tables a BlockMask stores.

The ordered form of a ``[..., ROWS, COLS]`` 0/1 grid is ``num_blocks [..., ROWS]`` (how many
ones each row has) and ``indices [..., ROWS, COLS]``: the columns of the ones in ascending
order, then the columns of the zeros in ascending order. That is exactly what torch's
``argsort(dense, descending=True, stable=True)`` gives, so tables compare equal with torch's
entry by entry; here it is computed with a cumulative sum and one scatter, no sort.
"""
from __future__ import annotations

import torch


def dense_to_ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(num_blocks, indices)`` of a 0/1 (or bool) grid, both int32 and contiguous."""
    ones = dense.contiguous().bool()
    ones_through = torch.cumsum(ones, dim=-1, dtype=torch.int32)  # inclusive prefix sum
    # (a grid without columns, an empty slice's transposed, has rows of none)
    num_blocks = ones_through[..., -1:].clone() if ones.shape[-1] else \
        torch.zeros(*ones.shape[:-1], 1, dtype=torch.int32, device=dense.device)
    col = torch.arange(ones.shape[-1], dtype=torch.int32, device=dense.device)
    # a zero goes after all ones, at its rank among the zeros; a one at its rank among ones
    zero_position = (col - ones_through).add_(num_blocks)
    position = torch.where(ones, ones_through.sub_(1), zero_position)
    indices = torch.empty(ones.shape, dtype=torch.int32, device=dense.device)
    indices.scatter_(-1, position.long(), col.expand(ones.shape))
    return num_blocks.squeeze(-1), indices


def ordered_to_dense(num_blocks: torch.Tensor, indices: torch.Tensor, cols: int) -> torch.Tensor:
    """The int32 0/1 grid ``[..., ROWS, cols]``: ones where a row's first ``num_blocks``
    indices point; listed indices of ``cols`` and up (tiles past the lengths, which torch's
    ``_adjust`` leaves listed and its kernels mask) and negative ones (in rows past the
    lengths, which no check reads) are dropped."""
    listed = torch.arange(indices.shape[-1], device=indices.device) < num_blocks.unsqueeze(-1)
    # unlisted entries and tiles past the lengths go to a spare column dropped afterwards
    target = torch.where(listed & (indices >= 0) & (indices < cols), indices.long(), cols)
    dense = torch.zeros(*indices.shape[:-1], cols + 1, dtype=torch.int32, device=indices.device)
    dense.scatter_(-1, target, 1)
    return dense[..., :cols].contiguous()


def transpose_ordered(num_blocks: torch.Tensor, indices: torch.Tensor,
                      cols: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ordered tables of the transposed grid (kv tables -> q tables for the backward)."""
    cols = indices.shape[-1] if cols is None else cols
    dense = ordered_to_dense(num_blocks, indices, cols)
    return dense_to_ordered(dense.transpose(-2, -1))
