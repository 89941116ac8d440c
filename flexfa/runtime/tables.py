"""Kernel arguments every family passes the same way: block-mask tables and captured tensors."""
from __future__ import annotations

import functools

import torch

from ..blockmask.coarsen import block_size_text
from ..blockmask.tables import transpose_ordered
from ..errors import InputError
from ..frontend.trace import TracedMod

TABLE_ARGS = 4 + 14  # two (num_blocks, indices) pairs, then their strides (3 + 4 each)


@functools.cache
def dummy_table(device: torch.device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return torch.zeros(1, dtype=dtype, device=device)


def broadcast_strides(table: torch.Tensor) -> list[int]:
    """Strides of a block-mask table, 0 along size-1 (broadcast) batch/head dims."""
    return [0 if size == 1 else stride for size, stride in zip(table.shape, table.stride())]


def mask_tables(block_mask, name: str) -> tuple:
    """(num_blocks, indices) of table ``name`` ("kv", "full_kv", "q", "full_q"), or ()
    when absent. q tables missing on a duck-typed mask are transposed from the kv tables."""
    num_blocks = getattr(block_mask, f"{name}_num_blocks", None)
    if num_blocks is not None:
        return num_blocks, getattr(block_mask, f"{name}_indices")
    if not name.endswith("q"):
        return ()
    source = mask_tables(block_mask, name[:-1] + "kv")
    return transpose_ordered(*source) if source else ()


def has_full_blocks(block_mask, side: str = "kv") -> bool:
    return block_mask is not None and bool(mask_tables(block_mask, f"full_{side}"))


def table_args(block_mask, side: str, device: torch.device) -> list:
    """``side`` "kv" (the forward and dQ walk kv tiles) or "q" (dK/dV walks the transposed q
    tables): the partial and full tables (the partial ones twice without full tables) and
    their strides, 0 along broadcast batch/head dims; dummies without a mask."""
    if block_mask is None:
        return [dummy_table(device)] * 4 + [0] * 14
    tables = list(mask_tables(block_mask, side))
    tables += list(mask_tables(block_mask, f"full_{side}")) or tables[:2]
    return [*tables, *(s for t in tables for s in broadcast_strides(t))]


def buffer_args(traced: TracedMod | None) -> list:
    """Pointer, strides and sizes of each captured tensor, matching the codegen's
    ``BufferArgs.params``."""
    if traced is None:
        return []
    args = []
    for tensor in traced.buffers:
        args += [tensor, *tensor.stride(), *tensor.shape]
    return args


def largest_tile(block: int) -> int:
    """The largest power of two (<= 128) dividing a block-mask block size."""
    tile = 128
    while tile > 1 and block % tile:
        tile //= 2
    return tile


def check_tile(block_mask, key: str, tile: int, block: int, kernel: str = "kernel") -> None:
    """An InputError unless the pinned or chosen ``tile`` (kernel option ``key``) divides the
    mask's ``block`` size and is at least 16, saying which way out fits."""
    if tile >= 16 and block % tile == 0:
        return
    way = ("build the mask with a BLOCK_SIZE that is a multiple of 16" if largest_tile(block) < 16
           else f"pass a kernel_options {key!r} that divides {block} (16 or more), or build the "
                f"mask with a BLOCK_SIZE that is a multiple of {max(tile, 16)}")
    raise InputError(f"block_mask has {block_size_text(block_mask)}; the {kernel} tile "
                     f"{key}={tile} does not fit its block size {block}: a tile must divide it "
                     f"and be >= 16; {way}")


def mask_blocks(block_mask) -> tuple[int, int] | tuple[None, None]:
    """The block mask's (q, kv) block sizes, or (None, None) without a mask."""
    if block_mask is None:
        return None, None
    sparse_q, sparse_kv = (int(b) for b in block_mask.BLOCK_SIZE)
    return sparse_q, sparse_kv
