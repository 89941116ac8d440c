"""Tables derived from a BlockMask's: cropped to new lengths (``BlockMask._adjust``) and
torch's dQ write-order metadata (carried for torch's deterministic backward)."""
from __future__ import annotations

import torch
import torch.nn.attention.flex_attention as torch_flex

from .tables import dense_to_ordered, ordered_to_dense


def crop_pair(num_blocks: torch.Tensor, indices: torch.Tensor, rows: int,
              cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ordered tables of the first ``rows`` x ``cols`` tiles of a (num_blocks, indices)
    pair: the listed tiles inside that corner, the rest dropped; ``min(cols, width)`` wide.

    torch's ``_adjust`` recounts each row as the entries of its first ``cols`` columns below
    ``min(count, cols)``, which is the corner for rows listing a prefix of tiles (causal) but
    can leave a tile past ``cols`` listed, which its kernels then never reach (the keys past
    KV_LEN are masked); flexfa's kernels trust listed tiles, so the corner is taken exactly."""
    num_blocks, indices = num_blocks[..., :rows], indices[..., :rows, :].long()
    listed = torch.arange(indices.shape[-1], device=indices.device) < num_blocks[..., None]
    inside = listed & (indices >= 0) & (indices < cols)
    # listed tiles inside the corner mark their column; everything else a spare column
    dense = torch.zeros(*indices.shape[:-1], cols + 1, dtype=torch.int32, device=indices.device)
    dense.scatter_(-1, torch.where(inside, indices, cols), 1)
    num_blocks, ordered = dense_to_ordered(dense[..., :cols])
    # as wide as torch's (its columns sliced to cols): a row lists at most width tiles
    return num_blocks, ordered[..., :indices.shape[-1]].contiguous()


def grow_partial(partial: tuple, full: tuple, first_row: int | None, first_col: int | None,
                 cols: int) -> tuple[tuple, tuple]:
    """(partial, full) ordered table pairs of ``cols`` kv tiles with every tile of rows
    ``first_row`` and up and of columns ``first_col`` and up (None: none) listed as partial
    and not full (tiles holding positions past the lengths a mask was classified for:
    ``BlockMask._adjust`` to longer lengths); ``cols`` wide."""
    dense = ordered_to_dense(*partial, cols).bool()
    fresh = torch.zeros_like(dense)
    if first_row is not None:
        fresh[..., first_row:, :] = True
    if first_col is not None:
        fresh[..., first_col:] = True
    dense |= fresh
    if full[0] is not None:
        full_dense = ordered_to_dense(*full, cols).bool() & ~fresh
        full = dense_to_ordered(full_dense)
    return dense_to_ordered(dense), full


def dq_write_order(block_mask, descending: bool | None) -> tuple:
    """torch's ``(dq_write_order, dq_write_order_full)`` of ``block_mask`` (``descending``:
    torch's ``dq_kv_order``), or ``(None, None)`` where the installed torch has no such
    metadata or the mask has no q tables."""
    compute = getattr(torch_flex, "_compute_dq_write_order_from_block_mask", None)
    if compute is None or block_mask.q_indices is None:
        return None, None
    return compute(block_mask, dq_kv_order=bool(descending))


def with_dq_metadata(new, source):
    """``new`` (sliced or adjusted from ``source``) with ``source``'s dQ scheduler order and,
    where ``source`` had write-order metadata, its own computed again (as torch does)."""
    new.dq_kv_order_spt = source.dq_kv_order_spt
    if source.dq_write_order is not None:
        new.dq_write_order, new.dq_write_order_full = dq_write_order(new, new.dq_kv_order_spt)
    return new
