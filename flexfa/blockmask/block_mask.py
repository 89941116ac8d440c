"""``BlockMask``: which tiles of the attention matrix to skip, compute, or compute with masking.

Same tables and meaning as ``torch.nn.attention.flex_attention.BlockMask``, of which it is a
subclass (so ``isinstance`` checks for torch's class pass and torch's ``flex_attention``
accepts it through the inherited ``as_tuple``). All tables int32, contiguous, on one device;
B and H of size 1 broadcast over every batch / head:

- ``kv_num_blocks [B,H,Q_TILES]``, ``kv_indices [B,H,Q_TILES,KV_TILES]``: per q tile, the kv
  tiles that need mask_mod (partial), listed first in ascending order, the rest after them.
- ``full_kv_num_blocks``, ``full_kv_indices``: the same for full tiles (no mask code runs).
- ``q_num_blocks [B,H,KV_TILES]``, ``q_indices [B,H,KV_TILES,Q_TILES]`` and ``full_q_*``: the
  transposed tables, per kv tile, for the backward pass (None after
  ``from_kv_blocks(compute_q_blocks=False)``: the backward then transposes the kv tables).
- ``BLOCK_SIZE`` ``(q, kv)``, ``seq_lengths`` ``(Q_LEN, KV_LEN)``, ``mask_mod`` the user's
  function, and ``traced_mask`` its traced IR (a ``TracedMod``) for the kernel generator,
  looked up under the mod's guard on each use.
- ``dq_write_order``, ``dq_write_order_full``, ``dq_kv_order``, ``dq_kv_order_spt``: torch's
  metadata for its deterministic block-sparse dQ, carried for torch (flexfa's dQ has one
  writer per tile and does not read them).

The constructor is flexfa's own (torch's is not called): it normalizes the block size and
raises flexfa's errors. Copies (``copy.deepcopy``, pickle) drop flexfa's per-object caches
(the table check, derived masks) and share the mask_mod's trace.
"""
from __future__ import annotations

import copy
import numbers
import operator

import torch
import torch.nn.attention.flex_attention as torch_flex
from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask

from ..errors import InputError, InputTypeError, check_bool, dims, is_bool
from ..frontend.combinators import noop_mask
from ..frontend.evaluate import evaluate
from ..frontend.trace import MASK_MOD, TracedMod, trace
from . import derive, draw
from .checks import MAX_SIZE, block_size_pair, positive_int
from .tables import ordered_to_dense, transpose_ordered
from .validate import check_contents, checked_past, mark_checked

_TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
           "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
_DQ_TENSORS = ("dq_write_order", "dq_write_order_full", "dq_kv_order")
_PRIVATE = "_flexfa_"  # prefix of the per-object caches other modules keep on a mask


SLICED = ("block_mask was sliced with [], which renumbers its batches, heads or q tiles, so "
          "its mask_mod was reset; assign block_mask.mask_mod a mask_mod written for the sliced "
          "positions (e.g. from the original mask) before passing it to flex_attention")


def _sliced_mask_mod(b, h, q_idx, kv_idx):
    raise InputError(SLICED)


# the mask_mod of a sliced BlockMask: torch's placeholder, so that torch's flex_attention
# recognizes flexfa's sliced masks and flexfa torch's (flexfa's own where torch has none)
sliced_mask_mod = getattr(torch_flex, "_sliced_mask_mod_error", _sliced_mask_mod)


class TracedMaskMod:
    """The mask_mod of a BlockMask built from an already traced mask (a ``TracedMod``):
    callable with index tensors like any mask_mod (it evaluates the trace), picklable, and
    recognized by ``BlockMask.traced_mask``, which uses the trace instead of tracing it."""

    def __init__(self, traced: TracedMod):
        self.traced = traced
        self.__name__ = traced.name

    def __call__(self, b, h, q_idx, kv_idx):
        return evaluate(self.traced, b=b, h=h, q_idx=q_idx, kv_idx=kv_idx)


class BlockMask(TorchBlockMask):
    """Tile tables of a mask; build with ``create_block_mask`` or ``BlockMask.from_kv_blocks``."""

    def __init__(self, seq_lengths, kv_num_blocks, kv_indices, full_kv_num_blocks,
                 full_kv_indices, q_num_blocks, q_indices, full_q_num_blocks, full_q_indices,
                 BLOCK_SIZE=(128, 128), mask_mod=None, *, traced_mask: TracedMod | None = None,
                 dq_write_order=None, dq_write_order_full=None, dq_kv_order=None,
                 dq_kv_order_spt=None):
        _check_pairs("BlockMask", kv_num_blocks, kv_indices, full_kv_num_blocks,
                     full_kv_indices, q_num_blocks, q_indices, full_q_num_blocks, full_q_indices)
        if dq_write_order_full is not None and dq_write_order is None:
            raise InputError("BlockMask: dq_write_order_full needs dq_write_order")
        for name, value in (("dq_write_order", dq_write_order),
                            ("dq_write_order_full", dq_write_order_full),
                            ("dq_kv_order", dq_kv_order)):
            if value is not None and not isinstance(value, torch.Tensor):
                raise InputTypeError(f"BlockMask: {name} must be a tensor or None, got "
                                     f"{type(value).__name__}")
        if dq_kv_order_spt is not None:
            dq_kv_order_spt = check_bool("BlockMask: dq_kv_order_spt", dq_kv_order_spt)
        if kv_indices.dim() < 2:  # as torch's
            raise InputError(f"BlockMask: kv_indices must have at least 2 dims ([B, H,] "
                             f"Q_TILES, KV_TILES), got shape {dims(kv_indices)}")
        self.BLOCK_SIZE = block_size_pair("BlockMask", BLOCK_SIZE)
        self.seq_lengths = _seq_lengths("BlockMask", seq_lengths, kv_indices, self.BLOCK_SIZE)
        self.kv_num_blocks, self.kv_indices = kv_num_blocks, kv_indices
        self.full_kv_num_blocks, self.full_kv_indices = full_kv_num_blocks, full_kv_indices
        self.q_num_blocks, self.q_indices = q_num_blocks, q_indices
        self.full_q_num_blocks, self.full_q_indices = full_q_num_blocks, full_q_indices
        self.dq_write_order, self.dq_write_order_full = dq_write_order, dq_write_order_full
        self.dq_kv_order, self.dq_kv_order_spt = dq_kv_order, dq_kv_order_spt
        self.mask_mod = noop_mask if mask_mod is None else _mask_mod("BlockMask", mask_mod)
        if traced_mask is not None and (not isinstance(traced_mask, TracedMod)
                                        or traced_mask.kind != MASK_MOD):
            raise InputTypeError(f"BlockMask: traced_mask must be a mask_mod's TracedMod or "
                                 f"None, got {type(traced_mask).__name__}")
        self._traced = (self.mask_mod, traced_mask) if traced_mask is not None else None

    @classmethod
    def from_kv_blocks(cls, kv_num_blocks, kv_indices, full_kv_num_blocks=None,
                       full_kv_indices=None, BLOCK_SIZE=128, mask_mod=None, seq_lengths=None,
                       compute_q_blocks=True, *, dq_write_order=None, dq_write_order_full=None,
                       dq_kv_order=None, traced_mask: TracedMod | None = None) -> "BlockMask":
        """A BlockMask from forward tables; the transposed q tables are computed here unless
        ``compute_q_blocks=False`` (as torch's; the backward then transposes them per call).

        Tables may have 2 to 4 dims (``[Q_TILES]`` / ``[Q_TILES, KV_TILES]`` with leading B, H);
        missing leading dims become size-1 (broadcast) dims. Entries past a row's count are
        never read: any padding (torch's -1) is accepted. ``dq_kv_order`` is a bool (torch's
        built-in scheduler order) or a tensor (an explicit one), as torch's.
        """
        func = "BlockMask.from_kv_blocks"
        block = block_size_pair(func, BLOCK_SIZE)
        compute_q_blocks = check_bool(f"{func}: compute_q_blocks", compute_q_blocks)
        if mask_mod is not None:
            _mask_mod(func, mask_mod)
        if (full_kv_num_blocks is None) != (full_kv_indices is None):
            raise InputError(f"{func}: full_kv_num_blocks and full_kv_indices must be given "
                             "together or both omitted")
        for name, table in (("kv_num_blocks", kv_num_blocks), ("kv_indices", kv_indices),
                            ("full_kv_num_blocks", full_kv_num_blocks),
                            ("full_kv_indices", full_kv_indices)):
            if isinstance(table, torch.Tensor) and table.device.type not in ("cpu", "cuda"):
                raise InputError(f"{func}: {name} is on {table.device}; flexfa runs on 'cpu' "
                                 "or 'cuda'")  # (meta tables failed inside the table check)
        if is_bool(dq_kv_order):
            dq_kv_order = bool(dq_kv_order)
        elif dq_kv_order is not None and not isinstance(dq_kv_order, torch.Tensor):
            raise InputTypeError(f"{func}: dq_kv_order must be a bool, a tensor or None, got "
                                 f"{type(dq_kv_order).__name__}")
        kv_num_blocks, kv_indices = _table_pair(func, "kv", kv_num_blocks, kv_indices)
        if full_kv_num_blocks is not None:
            full_kv_num_blocks, full_kv_indices = _table_pair(func, "full_kv", full_kv_num_blocks,
                                                              full_kv_indices)
            if full_kv_indices.shape[2:] != kv_indices.shape[2:]:
                raise InputError(f"{func}: full_kv_indices has tile shape "
                                 f"{tuple(full_kv_indices.shape[2:])} but kv_indices has "
                                 f"{tuple(kv_indices.shape[2:])}")
        rows, cols = kv_indices.shape[-2:]
        seq_lengths = _seq_lengths(func, seq_lengths, kv_indices, block)
        # the rows and tiles both the tables and the lengths have (a table too small for the
        # lengths is an error when the mask is used, where the lengths are the call's)
        covered = (min(int(seq_lengths[0]), rows * block[0]),
                   min(int(seq_lengths[1]), cols * block[1]))
        kv_tables = {"kv_num_blocks": kv_num_blocks, "kv_indices": kv_indices,
                     "full_kv_num_blocks": full_kv_num_blocks, "full_kv_indices": full_kv_indices}
        past = check_contents(kv_tables, (*block, *covered), f"{func}: ")
        q_tables = (None,) * 4
        if compute_q_blocks:
            q_tables = (*transpose_ordered(kv_num_blocks, kv_indices),
                        *((None, None) if full_kv_num_blocks is None else
                          transpose_ordered(full_kv_num_blocks, full_kv_indices)))
        mask = cls(seq_lengths, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                   *q_tables, BLOCK_SIZE=block, mask_mod=mask_mod, traced_mask=traced_mask,
                   dq_write_order=dq_write_order, dq_write_order_full=dq_write_order_full,
                   dq_kv_order=dq_kv_order if isinstance(dq_kv_order, torch.Tensor) else None,
                   dq_kv_order_spt=dq_kv_order if isinstance(dq_kv_order, bool) else None)
        if covered == mask.seq_lengths:  # the q tables are the checked kv tables transposed
            mark_checked(mask, past)
        return mask

    @classmethod
    def from_graph(cls, seq_lengths, tables, BLOCK_SIZE, mask_mod) -> "BlockMask":
        """A BlockMask of tables made inside a torch.compile'd function (``flexfa.compiled``):
        the lengths are kept as given (symbolic sizes stay symbolic), nothing is checked
        (the tables are create_block_mask's)."""
        mask = object.__new__(cls)
        mask.seq_lengths = tuple(seq_lengths)
        for name, table in zip(_TABLES, tables):
            setattr(mask, name, table)
        mask.dq_write_order = mask.dq_write_order_full = None
        mask.dq_kv_order = mask.dq_kv_order_spt = None
        mask.BLOCK_SIZE = tuple(BLOCK_SIZE)
        mask.mask_mod = mask_mod
        mask._traced = None
        return mask

    # ---- the mask function ----------------------------------------------------------------

    @property
    def traced_mask(self) -> TracedMod:
        """The traced IR of ``mask_mod``: the trace the mask was built with while that mod is
        its mask_mod (``traced_mask=``, a ``TracedMaskMod``'s), else looked up on every use as
        a score_mod's is (``trace``: memoized under a guard of every Python value the mod
        reads), so that a mod whose state changed since (a global it reads rebound, a closure
        cell, ``self.window = 24``) is traced again, as torch calls its mask_mod again."""
        mod = self.mask_mod
        if self._traced is not None and self._traced[0] is mod:
            return self._traced[1]
        return mod.traced if isinstance(mod, TracedMaskMod) else trace(mod, MASK_MOD)

    def _kept_trace(self) -> TracedMod | None:
        """The trace the mask was built with, while its mask_mod is the same (for derived
        masks)."""
        return self._traced[1] if self._traced and self._traced[0] is self.mask_mod else None

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
        return 100.0 * (1.0 - computed / max(1, self.kv_indices.numel()))  # (an empty slice)

    def __getitem__(self, index) -> "BlockMask":
        """Slice batches, heads and q tiles like a tensor; dims are kept (an integer -> size
        1) and each dim is indexed on its own (``mask[[0, 1], [2, 3]]`` is batches 0 and 1
        with heads 2 and 3 each, not the (batch, head) pairs)."""
        _no_dq_kv_order_tensor(self, "Slicing")
        index = _expand_ellipsis(index if isinstance(index, tuple) else (index,))
        if len(index) > 3:
            raise InputError(f"BlockMask[...] takes at most 3 indices (batch, head, q tile), "
                             f"got {len(index)}")
        sizes = self.kv_num_blocks.shape[:3]
        padded = (*index, slice(None), slice(None), slice(None))[:3]
        index = tuple(_keep_dim(i, n) for i, n in zip(padded, sizes))
        full = (None, None) if self.full_kv_num_blocks is None else \
            (_take(self.full_kv_num_blocks, index), _take(self.full_kv_indices, index))
        sliced = BlockMask.from_kv_blocks(
            _take(self.kv_num_blocks, index), _take(self.kv_indices, index), *full,
            BLOCK_SIZE=self.BLOCK_SIZE, mask_mod=sliced_mask_mod, seq_lengths=self.seq_lengths,
            compute_q_blocks=self.q_indices is not None)
        return derive.with_dq_metadata(sliced, self)

    def _adjust(self, new_q_len: int, new_kv_len: int) -> "BlockMask":
        """This mask cropped to lengths ``(new_q_len, new_kv_len)``, as torch's ``_adjust``
        (which torch's length-mismatch error suggests): the tiles past the new lengths are
        dropped, the upper left corner is kept, the mask_mod is the same; right only for
        masks whose corner is the mask of the new lengths (causal is). Longer lengths keep
        the tables and take the new lengths, as torch's do, but the tables then lack the new
        tiles: attention refuses such a mask (an InputError naming both tile counts); build
        the mask for those lengths instead."""
        _no_dq_kv_order_tensor(self, "Adjusting")
        func = "BlockMask._adjust"
        lengths = (positive_int(func, "new_q_len", new_q_len),
                   positive_int(func, "new_kv_len", new_kv_len))
        rows, cols = (-(-n // b) for n, b in zip(lengths, self.BLOCK_SIZE))
        full = (None, None) if self.full_kv_num_blocks is None else \
            derive.crop_pair(self.full_kv_num_blocks, self.full_kv_indices, rows, cols)
        partial = derive.crop_pair(self.kv_num_blocks, self.kv_indices, rows, cols)
        # longer lengths: the tables were classified with the positions past the old lengths
        # masked; the tiles holding new positions must run the mask_mod (partial), else a
        # tile left out (or full) there drops (or unmasks) the new positions silently. Without
        # a mask_mod the tables are the mask (a listed tile is attended whole): kept; tables
        # without the new lengths' tiles are refused at the call (kept as torch's too)
        grown = [(old // b) if new > old else None
                 for new, old, b in zip(lengths, self.seq_lengths, self.BLOCK_SIZE)]
        if grown != [None, None] and self.mask_mod is not noop_mask \
                and tuple(partial[1].shape[-2:]) == (rows, cols):
            partial, full = derive.grow_partial(partial, full, *grown, cols)
        adjusted = type(self).from_kv_blocks(
            *partial, *full,
            BLOCK_SIZE=self.BLOCK_SIZE, mask_mod=self.mask_mod, seq_lengths=lengths,
            compute_q_blocks=self.q_indices is not None, traced_mask=self._kept_trace())
        return derive.with_dq_metadata(adjusted, self)

    def to(self, device) -> "BlockMask":
        """A copy whose tables live on ``device`` (the mask_mod and its trace are shared)."""
        try:  # (a dtype or a number went on to Tensor.to: int32 tables turned float)
            device = torch.device(device)
        except (RuntimeError, TypeError, ValueError) as exc:
            raise InputError(f"BlockMask.to: device={device!r} is not a torch device "
                             f"({exc})") from None
        if device.type == "cuda" and not torch.cuda.is_available():  # (torch's AssertionError)
            raise InputError(f"BlockMask.to: device={str(device)!r} but CUDA is not available "
                             "on this machine")
        if device.type not in ("cpu", "cuda"):
            raise InputError(f"BlockMask.to: device={str(device)!r} is not supported; flexfa "
                             "runs on 'cpu' or 'cuda'")
        tables = [None if t is None else t.to(device) for t in (getattr(self, n) for n in _TABLES)]
        dq = {n: None if getattr(self, n) is None else getattr(self, n).to(device)
              for n in _DQ_TENSORS}
        moved = BlockMask(self.seq_lengths, *tables, BLOCK_SIZE=self.BLOCK_SIZE,
                          mask_mod=self.mask_mod, traced_mask=self._kept_trace(), **dq,
                          dq_kv_order_spt=self.dq_kv_order_spt)
        past = checked_past(self)
        if past is not None:
            mark_checked(moved, past)  # copies of checked, unchanged tables
        return moved

    # ---- copies ---------------------------------------------------------------------------

    def __copy__(self) -> "BlockMask":
        return self._copied_into(object.__new__(type(self)), self.__getstate__())

    def __deepcopy__(self, memo) -> "BlockMask":
        """Tables and mask_mod copied as ``copy.deepcopy`` copies them (a plain function is
        kept); the trace is shared while the mask_mod is the same object (its captured tensors
        are the mod's own, not copies)."""
        new = memo[id(self)] = object.__new__(type(self))
        return self._copied_into(new, copy.deepcopy(self.__getstate__(), memo))

    def _copied_into(self, new: "BlockMask", state: dict) -> "BlockMask":
        """``new`` with the copied attributes ``state``; flexfa's caches are not copied."""
        new.__dict__.update(state)
        new._traced = self._traced if self._traced and new.mask_mod is self._traced[0] else None
        past = checked_past(self)
        if past is not None:
            mark_checked(new, past)  # the same or copied tables, checked and unchanged
        return new

    def __getstate__(self) -> dict:
        """The attributes without flexfa's per-object caches (the table check holds weak
        references; derived masks are rebuilt on use) and without the trace: an unpickled
        mask traces its mask_mod on first use, so the trace reads the unpickled mod's own
        captured tensors."""
        state = {k: v for k, v in self.__dict__.items() if not k.startswith(_PRIVATE)}
        state["_traced"] = None
        return state

    # ---- checks for flex_attention --------------------------------------------------------

    def _check_compatible(self, B: int, H: int, Q_LEN: int, KV_LEN: int) -> None:
        """Raise InputError unless this mask can serve a call with these sizes (B/H may be 1)."""
        if self.mask_mod is sliced_mask_mod:
            raise InputError(SLICED)
        mask_B, mask_H = self.kv_num_blocks.shape[:2]
        if (mask_B not in (1, B) or mask_H not in (1, H)
                or self.seq_lengths != (Q_LEN, KV_LEN)):
            longer = (mask_B in (1, B) and mask_H in (1, H) and self.seq_lengths[0] >= Q_LEN
                      and self.seq_lengths[1] >= KV_LEN)
            # (int(): under torch.compile's dynamic shapes the sizes are symbolic, which Dynamo
            # cannot format into a message; int() makes them the call's values)
            mask_B, mask_H, B, H, Q_LEN, KV_LEN = (int(n) for n in (mask_B, mask_H, B, H, Q_LEN,
                                                                   KV_LEN))
            lengths = tuple(int(n) for n in self.seq_lengths)
            crop = (f", or crop this one with block_mask._adjust({Q_LEN}, {KV_LEN}) (right "
                    "where its upper left corner is the mask of those lengths, as for causal)"
                    if longer else "")
            raise InputError(
                f"block_mask was built for (B={mask_B}, H={mask_H}, Q_LEN={lengths[0]}, "
                f"KV_LEN={lengths[1]}) but flex_attention got (B={B}, H={H}, "
                f"Q_LEN={Q_LEN}, KV_LEN={KV_LEN}); the mask's B and H must equal the call's or "
                "be 1, and its lengths must match: build it with create_block_mask(mask_mod, "
                f"{B}, {H}, {Q_LEN}, {KV_LEN}, ...){crop}")

    # ---- pictures -------------------------------------------------------------------------

    def describe(self) -> str:
        name = getattr(self.mask_mod, "__name__", type(self.mask_mod).__name__)
        return (f"BlockMask(shape={self.shape}, BLOCK_SIZE={self.BLOCK_SIZE}, "
                f"sparsity={self.sparsity():.2f}%, mask_mod={name})")

    def to_string(self, grid_size=(20, 20), limit: int = 4) -> str:
        """A drawing of the first ``limit`` (b, h) pairs' tiles in at most ``grid_size``
        (an int or a (rows, columns) pair) cells; ``-1`` draws every tile, as torch's (and
        its defaults; ``print(mask)`` draws two pairs in 24 x 24 cells)."""
        return draw.to_text(self, grid_size, limit)

    def __repr__(self) -> str:
        return f"{self.describe()}\n{self.to_string((24, 24), 2)}"

    __str__ = __repr__  # torch's class defines its own __str__

    def to_png(self, path, limit: int = 4) -> None:
        """Save a picture of the tiles (white empty, orange partial, dark full)."""
        draw.to_png(self, path, limit)


def _expand_ellipsis(index: tuple) -> tuple:
    """``...`` as the full slices it stands for among (batch, head, q tile)."""
    if sum(i is Ellipsis for i in index) > 1:
        raise InputError("BlockMask[...] takes at most one '...'")
    if Ellipsis not in index:
        return index
    at = index.index(Ellipsis)
    missing = max(0, 3 - (len(index) - 1))
    return (*index[:at], *(slice(None),) * missing, *index[at + 1:])


_INDICES = "BlockMask[...] takes integers, slices, lists or 1-dim tensors for (batch, head, q tile)"


def _keep_dim(index, size: int):
    """One dim's index with that dim kept: an integer (a Python or numpy int, a 0-dim integer
    tensor; as such they dropped the dim, so the later dims moved up: heads read as batches)
    becomes a slice of one; slices, lists and 1-dim tensors keep it as they are."""
    if isinstance(index, slice):
        for part in ("start", "stop", "step"):
            value = getattr(index, part)
            if value is not None and (is_bool(value) or not isinstance(
                    value, (numbers.Integral, torch.Tensor))):
                raise InputTypeError(f"{_INDICES}: a slice's {part} must be an int, got "
                                     f"{value!r}")
        if index.step is not None and int(index.step) <= 0:
            raise InputError(f"{_INDICES}: a slice's step must be positive (as torch's), got "
                             f"{index.step}")
        return index
    if isinstance(index, torch.Tensor) and index.dim() == 1 or isinstance(index, list):
        _check_entries(index, size)
        return index
    if index is None or is_bool(index) or (  # (np.True_ was read as index 1)
            isinstance(index, torch.Tensor) and (index.dim() or index.dtype is torch.bool)):
        raise InputError(f"{_INDICES}, got {index!r}")
    try:
        index = operator.index(index)
    except TypeError:
        raise InputTypeError(f"{_INDICES}, got {type(index).__name__} {index!r}") from None
    if not -size <= index < size:
        raise InputError(f"BlockMask index {index} is out of range for a dim of size {size}")
    index %= size
    return slice(index, index + 1)


def _check_entries(index, size: int) -> None:
    """A list or 1-dim tensor index of a dim of ``size``: integers in range or a bool mask of
    its length (torch's IndexError and TypeError before; 0.5 in a list read as 0)."""
    try:
        values = torch.as_tensor(index)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise InputTypeError(f"{_INDICES}, got {index!r:.60}") from None
    if values.numel() == 0:
        return
    if values.dim() != 1:
        raise InputError(f"{_INDICES}, got {index!r:.60}")
    if values.dtype is torch.bool:
        if len(values) != size:
            raise InputError(f"a bool BlockMask index of length {len(values)} for a dim of "
                             f"size {size}")
        return
    if values.dtype.is_floating_point or values.dtype.is_complex:
        raise InputTypeError(f"{_INDICES}, got {values.dtype} entries {index!r:.60}")
    if not bool(((values >= -size) & (values < size)).all()):
        raise InputError(f"BlockMask index {index!r:.60} has entries out of range for a dim of "
                         f"size {size}")


def _take(table: torch.Tensor, index: tuple) -> torch.Tensor:
    """``table`` indexed dim by dim (two list or tensor indices together would pick pairs)."""
    ndim = table.dim()
    for dim, i in enumerate(index):
        table = table[(slice(None),) * dim + (i,)]
        if table.dim() != ndim:  # a nested list
            raise InputError(f"{_INDICES}, got {i!r}")
    return table


def _no_dq_kv_order_tensor(mask: BlockMask, what: str) -> None:
    if mask.dq_kv_order is not None:  # as torch's
        raise NotImplementedError(
            f"{what} a BlockMask with a tensor dq_kv_order is not supported (as in torch); "
            "build a new BlockMask with matching precomputed dq_write_order metadata")


def _check_pairs(func: str, *tables) -> None:
    """The constructor's tables: kv tables required, each pair given whole or not at all."""
    for pair, num_blocks, indices in zip(("kv", "full_kv", "q", "full_q"), tables[::2],
                                         tables[1::2]):
        for name, value in ((f"{pair}_num_blocks", num_blocks), (f"{pair}_indices", indices)):
            if value is not None and not isinstance(value, torch.Tensor):
                raise InputTypeError(f"{func}: {name} must be a tensor or None, got "
                                     f"{type(value).__name__}")
        if pair == "kv" and (num_blocks is None or indices is None):
            raise InputError(f"{func}: kv_num_blocks and kv_indices are required, got "
                             f"kv_num_blocks={_given(num_blocks)}, kv_indices={_given(indices)}")
        if (num_blocks is None) != (indices is None):
            raise InputError(f"{func}: {pair}_num_blocks and {pair}_indices must be given "
                             f"together or both be None, got {pair}_num_blocks="
                             f"{_given(num_blocks)}, {pair}_indices={_given(indices)}")


def _seq_lengths(func: str, seq_lengths, kv_indices: torch.Tensor,
                 block: tuple[int, int]) -> tuple[int, int]:
    """``(Q_LEN, KV_LEN)`` as ints in 0..MAX_SIZE; None: the tables' tiles times the block
    size, as torch's ``from_kv_blocks`` derives them (its constructor kept None, and its
    use failed later; flexfa's failed inside Python, and a float or a bool was truncated)."""
    if seq_lengths is None:
        return (kv_indices.shape[-2] * block[0], kv_indices.shape[-1] * block[1])
    try:  # (operator.index: ints of any kind, 0-d int tensors; no float, no bool)
        pair = tuple(seq_lengths)
        lengths = tuple(operator.index(n) for n in pair if not is_bool(n))
    except TypeError:
        pair = lengths = ()
    if len(pair) != 2 or len(lengths) != 2:
        raise InputTypeError(f"{func}: seq_lengths must be a (Q_LEN, KV_LEN) pair of ints or "
                             f"None, got {type(seq_lengths).__name__} {seq_lengths!r:.80}")
    if not all(0 <= n <= MAX_SIZE for n in lengths):
        raise InputError(f"{func}: seq_lengths must be in 0..{MAX_SIZE} (int32), got "
                         f"{lengths}")
    return lengths


def _mask_mod(func: str, mask_mod):
    if not callable(mask_mod):
        raise InputTypeError(f"{func}: mask_mod must be a function (b, h, q_idx, kv_idx) or "
                             f"None, got {type(mask_mod).__name__} {mask_mod!r:.60}")
    return mask_mod


def _given(table) -> str:
    return "None" if table is None else f"a tensor of shape {dims(table)}"


def _table_pair(func: str, name: str, num_blocks, indices):
    for label, value in ((f"{name}_num_blocks", num_blocks), (f"{name}_indices", indices)):
        if not isinstance(value, torch.Tensor):
            raise InputTypeError(f"{func}: {label} must be a tensor, got {type(value).__name__}")
        if value.dtype.is_floating_point or value.dtype is torch.bool:
            raise InputTypeError(f"{func}: {label} must hold integers, got {value.dtype}")
    if not 2 <= indices.dim() <= 4:
        raise InputError(f"{func}: {name}_indices must have 2 to 4 dims ([B, H,] Q_TILES, "
                         f"KV_TILES), got shape {dims(indices)}")
    if tuple(num_blocks.shape) != tuple(indices.shape[:-1]):
        raise InputError(f"{func}: {name}_num_blocks has shape {dims(num_blocks)} but "
                         f"{name}_indices has {dims(indices)}; expected "
                         f"{tuple(indices.shape[:-1])}")
    for label, value in ((f"{name}_num_blocks", num_blocks), (f"{name}_indices", indices)):
        if value.dtype not in _NARROW_INTS and value.numel():  # would wrap in the int32 cast
            low, high = int(value.min()), int(value.max())
            if low < -2 ** 31 or high >= 2 ** 31:
                raise InputError(f"{func}: {label} holds {high if high >= 2 ** 31 else low}, "
                                 "past the int32 range of the tables (it would wrap to another "
                                 "entry)")
    while indices.dim() < 4:
        indices, num_blocks = indices.unsqueeze(0), num_blocks.unsqueeze(0)
    return (num_blocks.to(torch.int32).contiguous(), indices.to(torch.int32).contiguous())


_NARROW_INTS = (torch.int8, torch.uint8, torch.int16, torch.int32)

