"""``BlockMask``: which tiles of the attention matrix to skip, compute, or compute with masking.

Same tables and meaning as ``torch.nn.attention.flex_attention.BlockMask`` (all int32,
contiguous, on one device; B and H of size 1 broadcast over every batch / head):

- ``kv_num_blocks [B,H,Q_TILES]``, ``kv_indices [B,H,Q_TILES,KV_TILES]``: per q tile, the kv
  tiles that need mask_mod (partial), listed first in ascending order, the rest after them.
- ``full_kv_num_blocks``, ``full_kv_indices``: the same for full tiles (no mask code runs).
- ``q_num_blocks [B,H,KV_TILES]``, ``q_indices [B,H,KV_TILES,Q_TILES]`` and ``full_q_*``: the
  transposed tables, per kv tile, for the backward pass.
- ``BLOCK_SIZE`` ``(q, kv)``, ``seq_lengths`` ``(Q_LEN, KV_LEN)``, ``mask_mod`` the user's
  function, and ``traced_mask`` its traced IR (a ``TracedMod``) for the kernel generator.
"""
from __future__ import annotations

import torch

from ..errors import InputError, InputTypeError
from ..frontend.combinators import noop_mask
from ..frontend.trace import MASK_MOD, TracedMod, trace
from . import draw
from .checks import block_size_pair
from .tables import ordered_to_dense, transpose_ordered
from .validate import check_contents, checked_now, mark_checked

_TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
           "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def sliced_mask_mod(b, h, q_idx, kv_idx):
    """Stands in for the mask_mod of a sliced BlockMask, whose b / h / q tiles are renumbered."""
    raise InputError("this BlockMask was sliced with [], which renumbers its batches, heads or "
                     "q tiles, so its mask_mod was reset; assign block_mask.mask_mod a mask_mod "
                     "written for the sliced positions (e.g. from the original mask)")


class BlockMask:
    """Tile tables of a mask; build with ``create_block_mask`` or ``BlockMask.from_kv_blocks``."""

    def __init__(self, seq_lengths, kv_num_blocks, kv_indices, full_kv_num_blocks,
                 full_kv_indices, q_num_blocks, q_indices, full_q_num_blocks, full_q_indices,
                 BLOCK_SIZE=(128, 128), mask_mod=None, traced_mask: TracedMod | None = None):
        self.seq_lengths = (int(seq_lengths[0]), int(seq_lengths[1]))
        self.kv_num_blocks, self.kv_indices = kv_num_blocks, kv_indices
        self.full_kv_num_blocks, self.full_kv_indices = full_kv_num_blocks, full_kv_indices
        self.q_num_blocks, self.q_indices = q_num_blocks, q_indices
        self.full_q_num_blocks, self.full_q_indices = full_q_num_blocks, full_q_indices
        self.BLOCK_SIZE = tuple(BLOCK_SIZE)
        self.mask_mod = noop_mask if mask_mod is None else mask_mod
        self._traced = (self.mask_mod, traced_mask) if traced_mask is not None else None

    @classmethod
    def from_kv_blocks(cls, kv_num_blocks, kv_indices, full_kv_num_blocks=None,
                       full_kv_indices=None, BLOCK_SIZE=128, mask_mod=None, seq_lengths=None,
                       traced_mask: TracedMod | None = None) -> "BlockMask":
        """A BlockMask from forward tables; the transposed q tables are computed here.

        Tables may have 2 to 4 dims (``[Q_TILES]`` / ``[Q_TILES, KV_TILES]`` with leading B, H);
        missing leading dims become size-1 (broadcast) dims.
        """
        func = "BlockMask.from_kv_blocks"
        block = block_size_pair(func, BLOCK_SIZE)
        kv_num_blocks, kv_indices = _table_pair(func, "kv", kv_num_blocks, kv_indices)
        if (full_kv_num_blocks is None) != (full_kv_indices is None):
            raise InputError(f"{func}: full_kv_num_blocks and full_kv_indices must be given "
                             "together or both omitted")
        if full_kv_num_blocks is not None:
            full_kv_num_blocks, full_kv_indices = _table_pair(func, "full_kv", full_kv_num_blocks,
                                                              full_kv_indices)
            if full_kv_indices.shape[2:] != kv_indices.shape[2:]:
                raise InputError(f"{func}: full_kv_indices has tile shape "
                                 f"{tuple(full_kv_indices.shape[2:])} but kv_indices has "
                                 f"{tuple(kv_indices.shape[2:])}")
        rows, cols = kv_indices.shape[-2:]
        if seq_lengths is None:
            seq_lengths = (rows * block[0], cols * block[1])
        # the rows and tiles both the tables and the lengths have (a table too small for the
        # lengths is an error when the mask is used, where the lengths are the call's)
        covered = (min(int(seq_lengths[0]), rows * block[0]),
                   min(int(seq_lengths[1]), cols * block[1]))
        check_contents({"kv_num_blocks": kv_num_blocks, "kv_indices": kv_indices,
                        "full_kv_num_blocks": full_kv_num_blocks,
                        "full_kv_indices": full_kv_indices}, (*block, *covered), f"{func}: ")
        q_num_blocks, q_indices = transpose_ordered(kv_num_blocks, kv_indices)
        full_q = (None, None) if full_kv_num_blocks is None else \
            transpose_ordered(full_kv_num_blocks, full_kv_indices)
        mask = cls(seq_lengths, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                   q_num_blocks, q_indices, *full_q, BLOCK_SIZE=block, mask_mod=mask_mod,
                   traced_mask=traced_mask)
        if covered == mask.seq_lengths:
            mark_checked(mask)  # the q tables are the checked kv tables transposed
        return mask

    # ---- the mask function ----------------------------------------------------------------

    @property
    def traced_mask(self) -> TracedMod:
        """The traced IR of ``mask_mod`` (traced again only if ``mask_mod`` was replaced)."""
        if self._traced is None or self._traced[0] is not self.mask_mod:
            self._traced = (self.mask_mod, trace(self.mask_mod, MASK_MOD))
        return self._traced[1]

    # ---- shape and contents ---------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (*self.kv_indices.shape[:2], *self.seq_lengths)

    @property
    def device(self) -> torch.device:
        return self.kv_indices.device

    def numel(self) -> int:
        B, H, L, S = self.shape
        return B * H * L * S

    def to_dense(self) -> torch.Tensor:
        """``[B, H, Q_TILES, KV_TILES]`` int32: 1 where a tile is computed (partial or full)."""
        kv_tiles = self.kv_indices.shape[-1]
        dense = ordered_to_dense(self.kv_num_blocks, self.kv_indices, kv_tiles)
        if self.full_kv_num_blocks is not None:
            full = ordered_to_dense(self.full_kv_num_blocks, self.full_kv_indices, kv_tiles)
            dense = dense | full
        return dense

    def sparsity(self) -> float:
        """Percent of tiles skipped (neither partial nor full), over all batches and heads.

        Equals torch's ``sparsity()`` when the lengths are tile multiples; torch counts area
        instead, which goes negative when the last tiles run past the sequence ends.
        """
        computed = int(self.kv_num_blocks.sum())
        if self.full_kv_num_blocks is not None:
            computed += int(self.full_kv_num_blocks.sum())
        return 100.0 * (1.0 - computed / self.kv_indices.numel())

    def __getitem__(self, index) -> "BlockMask":
        """Slice batches, heads and q tiles like a tensor; dims are kept (an int -> size 1)."""
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > 3:
            raise InputError(f"BlockMask[...] takes at most 3 indices (batch, head, q tile), "
                             f"got {len(index)}")
        sizes = self.kv_num_blocks.shape[:3]
        padded = (*index, slice(None), slice(None), slice(None))[:3]
        index = tuple(_keep_dim(i, n) for i, n in zip(padded, sizes))
        full = (None, None) if self.full_kv_num_blocks is None else \
            (self.full_kv_num_blocks[index], self.full_kv_indices[index])
        return BlockMask.from_kv_blocks(self.kv_num_blocks[index], self.kv_indices[index], *full,
                                        BLOCK_SIZE=self.BLOCK_SIZE, mask_mod=sliced_mask_mod,
                                        seq_lengths=self.seq_lengths)

    def to(self, device) -> "BlockMask":
        """A copy whose tables live on ``device`` (the mask_mod and its trace are shared)."""
        tables = [None if t is None else t.to(device) for t in (getattr(self, n) for n in _TABLES)]
        traced = self._traced[1] if self._traced is not None else None
        moved = BlockMask(self.seq_lengths, *tables, BLOCK_SIZE=self.BLOCK_SIZE,
                          mask_mod=self.mask_mod, traced_mask=traced)
        if checked_now(self):
            mark_checked(moved)  # copies of checked, unchanged tables
        return moved

    # ---- checks for flex_attention --------------------------------------------------------

    def _check_compatible(self, B: int, H: int, Q_LEN: int, KV_LEN: int) -> None:
        """Raise InputError unless this mask can serve a call with these sizes (B/H may be 1)."""
        if self.mask_mod is sliced_mask_mod:
            raise InputError("block_mask was sliced, which resets its mask_mod; assign "
                             "block_mask.mask_mod before passing it to flex_attention")
        mask_B, mask_H = self.kv_num_blocks.shape[:2]
        if (mask_B not in (1, B) or mask_H not in (1, H)
                or self.seq_lengths != (Q_LEN, KV_LEN)):
            raise InputError(
                f"block_mask was built for (B={mask_B}, H={mask_H}, Q_LEN={self.seq_lengths[0]}, "
                f"KV_LEN={self.seq_lengths[1]}) but flex_attention got (B={B}, H={H}, "
                f"Q_LEN={Q_LEN}, KV_LEN={KV_LEN}); the mask's B and H must equal the call's or "
                "be 1, and its lengths must match: build it with create_block_mask(mask_mod, "
                f"{B}, {H}, {Q_LEN}, {KV_LEN}, ...)")

    # ---- pictures -------------------------------------------------------------------------

    def describe(self) -> str:
        name = getattr(self.mask_mod, "__name__", type(self.mask_mod).__name__)
        return (f"BlockMask(shape={self.shape}, BLOCK_SIZE={self.BLOCK_SIZE}, "
                f"sparsity={self.sparsity():.2f}%, mask_mod={name})")

    def to_string(self, grid_size=(24, 24), limit: int = 2) -> str:
        return draw.to_text(self, grid_size, limit)

    def __repr__(self) -> str:
        return f"{self.describe()}\n{self.to_string()}"

    def to_png(self, path, limit: int = 4) -> None:
        """Save a picture of the tiles (white empty, orange partial, dark full)."""
        draw.to_png(self, path, limit)


def _keep_dim(index, size: int):
    if isinstance(index, int) and not isinstance(index, bool):
        if not -size <= index < size:
            raise InputError(f"BlockMask index {index} is out of range for a dim of size {size}")
        index %= size
        return slice(index, index + 1)
    return index


def _table_pair(func: str, name: str, num_blocks, indices):
    for label, value in ((f"{name}_num_blocks", num_blocks), (f"{name}_indices", indices)):
        if not isinstance(value, torch.Tensor):
            raise InputTypeError(f"{func}: {label} must be a tensor, got {type(value).__name__}")
        if value.dtype.is_floating_point or value.dtype is torch.bool:
            raise InputTypeError(f"{func}: {label} must hold integers, got {value.dtype}")
    if not 2 <= indices.dim() <= 4:
        raise InputError(f"{func}: {name}_indices must have 2 to 4 dims ([B, H,] Q_TILES, "
                         f"KV_TILES), got shape {tuple(indices.shape)}")
    if tuple(num_blocks.shape) != tuple(indices.shape[:-1]):
        raise InputError(f"{func}: {name}_num_blocks has shape {tuple(num_blocks.shape)} but "
                         f"{name}_indices has {tuple(indices.shape)}; expected "
                         f"{tuple(indices.shape[:-1])}")
    while indices.dim() < 4:
        indices, num_blocks = indices.unsqueeze(0), num_blocks.unsqueeze(0)
    return (num_blocks.to(torch.int32).contiguous(), indices.to(torch.int32).contiguous())

