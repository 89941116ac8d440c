"""Block masks whose block sizes the kernels cannot tile run as an equivalent coarser mask.

The kernels walk a block mask in tiles of 16 to 128 rows (powers of two) that divide its
blocks, so blocks that are not a multiple of 16 (torch accepts any size: ``(1, 64)`` for
decoding, 24, 100) have no tile. Such a mask runs through a mask of blocks ``lcm(size, 16)``
(a size that is a multiple of 16 stays), the same attention element by element:

- a coarse block is full where every original block in it (within the lengths) is full,
  skipped where every one is empty, partial otherwise;
- the partial ones evaluate ``class == FULL | (class == PARTIAL & mask_mod)``, ``class`` the
  original block of the element, read from a captured ``[B, H, Q_TILES, KV_TILES]`` tensor:
  a full original block skips the mask_mod and an empty one is skipped, as torch does.

Tables that list tiles past the lengths (torch's ``_adjust`` leaves some; its kernels mask
their positions, so they add nothing) run as a copy without them (``clipped``): the kernels
read a listed tile without bounds checks.

The mask the kernels run is kept on the original (``_flexfa_coarse``) for its tables'
contents and mask_mod, so repeated calls reuse it (and its kernels, plans and checks); it
holds nothing that refers back to the original.
"""
from __future__ import annotations

import math

import torch

from ..frontend import ir
from ..frontend.ir import DType, Op
from ..frontend.simplify import simplify
from ..frontend.trace import MASK_MOD, TracedMod
from .block_mask import BlockMask, TracedMaskMod
from .create import ordered_tables
from .tables import dense_to_ordered, ordered_to_dense
from .validate import capturing, mark_checked, table_generations

TILE = 16  # the smallest kernel tile; every block size the kernels run is a multiple of it
EMPTY, PARTIAL, FULL = 0, 1, 2
_MEMO = "_flexfa_coarse"


def runnable_block_mask(block_mask, traced: TracedMod | None, past: bool | None = False):
    """``block_mask`` itself if the kernels can tile its blocks and it lists no tile past its
    lengths, else the equivalent mask of coarser blocks, or without those tiles (see the
    module docstring). ``traced``: the mask's prepared mask_mod; ``past``: ``check_tables``'
    result for the call's lengths (None: unknown), which it must be called after."""
    if block_mask is None:
        return None
    block_q, block_kv = (int(b) for b in block_mask.BLOCK_SIZE)
    tiled = block_q % TILE == 0 and block_kv % TILE == 0
    if tiled and past is False:
        return block_mask
    # None: tables may change unseen; or a CUDA graph records the coarsening (its ops replay
    # with the tables' contents then) where a memo would bake in today's
    contents = None if capturing() else table_generations(block_mask)[1]
    memo = getattr(block_mask, _MEMO, None)
    if memo is not None and contents is not None and memo[0] == contents and memo[1] is traced:
        return memo[2]
    # (coarsening drops the tiles past the lengths too)
    coarse = clipped(block_mask, traced) if tiled else coarsened(block_mask, traced)
    if contents is not None:
        try:
            setattr(block_mask, _MEMO, (contents, traced, coarse))
        except AttributeError:  # a frozen or slotted mask object: built on every call
            pass
    return coarse


def clipped(block_mask, traced: TracedMod) -> BlockMask:
    """``block_mask`` (whose mask_mod is ``traced``) without the tiles past its lengths, the
    same attention (their positions are masked): all eight tables rebuilt over the lengths'
    tiles, in ascending order."""
    L, S = (int(n) for n in block_mask.seq_lengths)
    block_q, block_kv = (int(b) for b in block_mask.BLOCK_SIZE)
    classes = block_classes(block_mask, -(-L // block_q), -(-S // block_kv))
    mask = BlockMask((L, S), *ordered_tables(classes, *classes.shape[:2]),
                     BLOCK_SIZE=(block_q, block_kv),
                     mask_mod=TracedMaskMod(traced), traced_mask=traced)
    mark_checked(mask)  # built from checked tables, over the lengths
    return mask


def coarsened(block_mask, traced: TracedMod) -> BlockMask:
    """The mask of blocks ``lcm(BLOCK_SIZE, 16)`` (or one block covering a length the lcm
    passes: ``_coarse``) equal to ``block_mask`` (whose mask_mod is ``traced``) element by
    element, over its lengths."""
    L, S = (int(n) for n in block_mask.seq_lengths)
    block_q, block_kv = (int(b) for b in block_mask.BLOCK_SIZE)
    (coarse_q, per_q), (coarse_kv, per_kv) = _coarse(block_q, L), _coarse(block_kv, S)
    classes = block_classes(block_mask, -(-L // block_q), -(-S // block_kv))
    full, partial = _coarse_grids(classes, per_q, per_kv, -(-L // coarse_q), -(-S // coarse_kv))
    tables = [*dense_to_ordered(partial), *dense_to_ordered(full),
              *dense_to_ordered(partial.transpose(-2, -1)),
              *dense_to_ordered(full.transpose(-2, -1))]
    mod = _classed_mask_mod(traced, classes, block_q, block_kv)
    mask = BlockMask((L, S), *tables, BLOCK_SIZE=(coarse_q, coarse_kv),
                     mask_mod=TracedMaskMod(mod), traced_mask=mod)
    mark_checked(mask)  # built from checked tables
    mask._flexfa_given_block = (block_q, block_kv)  # (block_size_text: errors name it)
    return mask


def _coarse(block: int, length: int) -> tuple[int, int]:
    """(coarse block, original blocks per coarse one) along one dimension: ``lcm(block,
    16)``, or where that passes the length one block covering it (the same single block:
    an odd block near 2**28 had an lcm past int32, refused at the call)."""
    coarse = math.lcm(block, TILE)
    whole = -(-max(length, 1) // TILE) * TILE
    if coarse > whole:
        return whole, max(1, -(-length // block))
    return coarse, coarse // block


def block_size_text(block_mask) -> str:
    """The BLOCK_SIZE a user gave ``block_mask``, for errors about the mask the kernels run
    (``runnable_block_mask``'s): a coarsened one names both."""
    given = getattr(block_mask, "_flexfa_given_block", None)
    run = tuple(int(b) for b in block_mask.BLOCK_SIZE)
    if given is None:
        return f"BLOCK_SIZE {run}"
    return f"BLOCK_SIZE {given} (run as {run}, its blocks' least multiple of {TILE})"


def block_classes(block_mask, rows: int, cols: int) -> torch.Tensor:
    """int32 ``[B, H, rows, cols]``: EMPTY, PARTIAL or FULL per block of the first rows x
    cols blocks (the tables cover them: checked before; listed blocks past them dropped)."""
    classes = ordered_to_dense(block_mask.kv_num_blocks[..., :rows],
                               block_mask.kv_indices[..., :rows, :], cols)
    if getattr(block_mask, "full_kv_num_blocks", None) is not None:
        full = ordered_to_dense(block_mask.full_kv_num_blocks[..., :rows],
                                block_mask.full_kv_indices[..., :rows, :], cols)
        classes = torch.maximum(classes, FULL * full)
    return classes


def _coarse_grids(classes: torch.Tensor, per_q: int, per_kv: int, rows: int,
                  cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(full, partial) bool ``[B, H, rows, cols]`` of the coarse blocks, each ``per_q`` x
    ``per_kv`` original blocks; blocks past the lengths (padding) count as neither."""
    B, H, fine_rows, fine_cols = classes.shape
    padded = torch.full((B, H, rows * per_q, cols * per_kv), -1, dtype=classes.dtype,
                        device=classes.device)
    padded[..., :fine_rows, :fine_cols] = classes
    grouped = padded.view(B, H, rows, per_q, cols, per_kv)
    full = ((grouped == FULL) | (grouped < 0)).all(5).all(3)
    empty = ((grouped == EMPTY) | (grouped < 0)).all(5).all(3)
    return full, ~full & ~empty


def _classed_mask_mod(traced: TracedMod, classes: torch.Tensor, block_q: int,
                      block_kv: int) -> TracedMod:
    """``traced`` with the original blocks' classes: ``class == FULL | (class == PARTIAL &
    traced)``, ``class = classes[b, h, q_idx // block_q, kv_idx // block_kv]`` (b / h 0 on
    a broadcast dim), read as a new captured tensor after the mask_mod's own."""
    def index(op: Op, size: int) -> ir.Node:
        return ir.index(op) if size > 1 else ir.const(0)

    def block(op: Op, size: int) -> ir.Node:
        # (a decode row at a negative position, kv_lens < L, reads q block 0's classes, as
        # the kernels read its tables there: -1 // size read the last block's, wrapped)
        at = ir.extremum(Op.MAX, ir.index(op), ir.const(0), ir.TIES_NONE) \
            if op is Op.Q_IDX else ir.index(op)
        return ir.binary(Op.FLOORDIV, at, ir.const(size))

    slot = len(traced.buffers)
    klass = ir.load(slot, (index(Op.B, classes.shape[0]), index(Op.H, classes.shape[1]),
                           block(Op.Q_IDX, block_q), block(Op.KV_IDX, block_kv)), DType.INT)
    partial = ir.binary(Op.AND, ir.binary(Op.EQ, klass, ir.const(PARTIAL)), traced.root)
    root = ir.binary(Op.OR, ir.binary(Op.EQ, klass, ir.const(FULL)), partial)
    name = f"{traced.name}_in_blocks_{block_q}x{block_kv}"
    return TracedMod(MASK_MOD, simplify(root), (*traced.buffers, classes), name)
