"""Classifying tiles as empty, full or undecided without looking at single elements.

Each IR node depends on some of the leaves b, h, q_idx, kv_idx. A node that does not depend on
both q_idx and kv_idx is *separable*: it is evaluated exactly on a 1-D index grid (O(L) or
O(S) work, e.g. ``doc[q_idx]`` or ``kv_idx < prefix``) and reduced to its per-tile min and max,
which is the exact range of its values over every tile row or column. Nodes that mix q_idx
and kv_idx get their range from ``intervals.RULES`` applied to their sources' ranges, on the
whole ``[B?, H?, Q_TILES, KV_TILES]`` grid at once (in chunks of tile rows, to bound memory).
A mixed captured-tensor read (``table[q_idx, kv_idx]``) is unknown.

The root's range per tile gives the class: surely False everywhere -> EMPTY, surely True ->
FULL (PARTIAL when the tile runs past the sequence end, as in torch, whose padding counts as
masked), otherwise UNDECIDED, for ``exact.py`` to settle element by element.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from ..errors import InputError
from ..frontend.evaluate import evaluate_node
from ..frontend.ir import DType, Node, Op
from ..frontend.trace import TracedMod
from . import intervals
from .intervals import Interval
from .validate import every_tile_partial

EMPTY, PARTIAL, FULL, UNDECIDED = 0, 1, 2, 3
MAX_GRID_ELEMENTS = 1 << 21  # tiles per chunk of the interval pass / values per 1-D evaluation
_LEAF_DEPS = {Op.B: "b", Op.H: "h", Op.Q_IDX: "q", Op.KV_IDX: "kv"}


@dataclasses.dataclass(frozen=True)
class TileGrid:
    """The problem shape: B x H x (Q_LEN / q tile) x (KV_LEN / kv tile) tiles."""

    B: int
    H: int
    Q_LEN: int
    KV_LEN: int
    Q_BLOCK: int
    KV_BLOCK: int
    device: torch.device

    @property
    def q_tiles(self) -> int:
        return -(-self.Q_LEN // self.Q_BLOCK)

    @property
    def kv_tiles(self) -> int:
        return -(-self.KV_LEN // self.KV_BLOCK)

    @property
    def q_span(self) -> int:
        """Offsets inside a q tile that can hold a position: a block longer than the sequence
        (one tile) holds Q_LEN, the rest is padding (BLOCK_SIZE=2**30 for 40 positions)."""
        return min(self.Q_BLOCK, self.Q_LEN)

    @property
    def kv_span(self) -> int:
        return min(self.KV_BLOCK, self.KV_LEN)

    def batch_shape(self, deps: frozenset) -> tuple[int, int]:
        """Leading sizes of a value with these dependencies (size 1 = same for every b / h)."""
        return (self.B if "b" in deps else 1, self.H if "h" in deps else 1)


def dependencies(root: Node) -> dict[int, frozenset]:
    """For every node (by id), which of b, h, q, kv it reads."""
    deps: dict[int, frozenset] = {}
    for node in root.toposort():
        own = {_LEAF_DEPS[node.op]} if node.op in _LEAF_DEPS else set()
        deps[id(node)] = frozenset(own.union(*(deps[id(s)] for s in node.src)))
    return deps


def check_broadcast(traced: TracedMod | None, block_mask, B: int, H: int, L: int,
                    S: int) -> None:
    """An InputError where a block mask's tables of batch (head) size 1 serve a call of more
    batch entries (heads), its mask_mod reads ``b`` (``h``) and the tables mark some tiles
    full or leave some out: create_block_mask classified them for b = 0 (h = 0) only, and the
    other batch entries (heads) would run without the mask in the full tiles and skip the left
    out ones, silently (torch's kernels do). Tables listing every tile as partial are right
    for every b and h (the mask_mod decides each element)."""
    if traced is None:
        return
    mask_B, mask_H = (int(n) for n in block_mask.kv_num_blocks.shape[:2])
    spread = [(name, size, built) for name, size, built in (("b", B, mask_B), ("h", H, mask_H))
              if built == 1 < size]
    if not spread:
        return
    reads = dependencies(traced.root)[id(traced.root)]
    spread = [entry for entry in spread if entry[0] in reads]
    if not spread or every_tile_partial(block_mask, L, S):
        return
    name, size, built = spread[0]
    dim = "B" if name == "b" else "H"
    raise InputError(
        f"block_mask was built for {dim}={built} (create_block_mask's {dim}=None or 1: the "
        f"same mask for every {'batch entry' if name == 'b' else 'head'}) but its mask_mod "
        f"{traced.name} reads {name} and the call has {dim}={size}: the tables mark tiles full "
        f"or empty for {name}=0 only; build the mask with {dim}={size}")


def _mixed(deps: frozenset) -> bool:
    return "q" in deps and "kv" in deps


class TileAnalysis:
    """Per-tile ranges of a mask_mod's IR over one tile grid; ``classify`` gives tile classes."""

    def __init__(self, traced: TracedMod, grid: TileGrid):
        self.traced, self.grid = traced, grid
        self.root = traced.root
        self.deps = dependencies(self.root)
        self.order = [n for n in self.root.toposort() if _mixed(self.deps[id(n)])]
        self.ranges: dict[int, Interval] = {}
        for node in self._separable_inputs():
            self.ranges[id(node)] = self._separable_range(node)
        self.root_shape = grid.batch_shape(self.deps[id(self.root)])

    def _separable_inputs(self) -> list[Node]:
        """Separable nodes whose ranges the mixed nodes (or a separable root) need."""
        if not self.order:
            return [self.root]
        needed: dict[int, Node] = {}
        for node in self.order:
            if node.op is Op.LOAD:
                continue  # a mixed read is unknown: its indices' ranges are not used
            for src in node.src:
                if not _mixed(self.deps[id(src)]):
                    needed[id(src)] = src
        return list(needed.values())

    # ---- separable nodes: exact 1-D evaluation, reduced per tile --------------------------

    def _separable_range(self, node: Node) -> Interval:
        grid, deps = self.grid, self.deps[id(node)]
        Bn, Hn = grid.batch_shape(deps)
        axis = "q" if "q" in deps else "kv" if "kv" in deps else None
        if axis is None:
            values = self._evaluate_1d(node, Bn, Hn, None, 0, 1)
            return _finish_values(node.dtype, values, values)
        length, block = ((grid.Q_LEN, grid.Q_BLOCK) if axis == "q"
                         else (grid.KV_LEN, grid.KV_BLOCK))
        tiles_per_chunk = max(1, MAX_GRID_ELEMENTS // (Bn * Hn * block))
        los, his = [], []
        for first in range(0, -(-length // block), tiles_per_chunk):
            start = first * block
            count = min(tiles_per_chunk * block, length - start)
            values = self._evaluate_1d(node, Bn, Hn, axis, start, count)
            lo, hi = _per_tile_min_max(values.reshape(Bn, Hn, count), block)
            los.append(lo)
            his.append(hi)
        lo, hi = torch.cat(los, -1), torch.cat(his, -1)
        shape = (Bn, Hn, -1, 1) if axis == "q" else (Bn, Hn, 1, -1)
        return _finish_values(node.dtype, lo.reshape(shape), hi.reshape(shape))

    def _evaluate_1d(self, node, Bn, Hn, axis, start, count) -> torch.Tensor:
        """``node`` at positions ``[start, start + count)`` of ``axis``, shaped [Bn, Hn, ., .]."""
        device = self.grid.device
        positions = torch.arange(start, start + count, device=device)
        unused = torch.zeros((), dtype=torch.int64, device=device)  # an axis node ignores
        q = positions.view(1, 1, count, 1) if axis == "q" else unused
        kv = positions.view(1, 1, 1, count) if axis == "kv" else unused
        b = torch.arange(Bn, device=device).view(Bn, 1, 1, 1)
        h = torch.arange(Hn, device=device).view(1, Hn, 1, 1)
        with torch.no_grad():
            value = evaluate_node(node, b=b, h=h, q_idx=q, kv_idx=kv,
                                  buffers=self.traced.buffers, device=device)
        return value.broadcast_to((Bn, Hn, q.shape[2] if axis == "q" else 1,
                                   kv.shape[3] if axis == "kv" else 1))

    # ---- mixed nodes: interval rules over the tile grid -----------------------------------

    def classify(self, q_tile_start: int, q_tile_stop: int) -> torch.Tensor:
        """int8 classes ``[B?, H?, rows, KV_TILES]`` for q tiles ``[start, stop)``."""
        root = self._root_range(q_tile_start, q_tile_stop)
        grid = self.grid
        shape = (*self.root_shape, q_tile_stop - q_tile_start, grid.kv_tiles)
        q_ends = torch.arange(q_tile_start + 1, q_tile_stop + 1, device=grid.device) * grid.Q_BLOCK
        kv_ends = torch.arange(1, grid.kv_tiles + 1, device=grid.device) * grid.KV_BLOCK
        complete = (q_ends <= grid.Q_LEN).view(-1, 1) & (kv_ends <= grid.KV_LEN).view(1, -1)
        int8 = functools.partial(torch.tensor, dtype=torch.int8, device=grid.device)
        kept_class = torch.where(complete, int8(FULL), int8(PARTIAL))
        classes = torch.where(root.lo == 1, kept_class, int8(UNDECIDED))  # surely True
        classes = torch.where(root.hi == 0, int8(EMPTY), classes)  # surely False
        return classes.broadcast_to(shape).contiguous()

    def rows_per_chunk(self) -> int:
        Bn, Hn = self.root_shape
        return max(1, MAX_GRID_ELEMENTS // (Bn * Hn * self.grid.kv_tiles))

    def _root_range(self, start: int, stop: int) -> Interval:
        ranges = {key: _rows(value, start, stop) for key, value in self.ranges.items()}
        if not self.order:
            return ranges[id(self.root)]
        remaining_uses = _use_counts(self.order)
        for node in self.order:
            if node.op is Op.LOAD:
                ranges[id(node)] = intervals.unknown(node.dtype, self.grid.device)
            else:
                ranges[id(node)] = intervals.apply_rule(node, [ranges[id(s)] for s in node.src])
            for src in node.src:  # free what no later node reads
                remaining_uses[id(src)] = remaining_uses.get(id(src), 1) - 1
                if remaining_uses[id(src)] == 0 and src is not self.root:
                    ranges.pop(id(src), None)
        return ranges[id(self.root)]


def _use_counts(order: list[Node]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for node in order:
        for src in node.src:
            counts[id(src)] = counts.get(id(src), 0) + 1
    return counts


def _rows(value: Interval, start: int, stop: int) -> Interval:
    """The q-tile rows ``[start, stop)`` of a range (ranges constant along q pass through)."""
    if value.lo.dim() == 4 and value.lo.shape[2] > 1:
        return Interval(value.lo[:, :, start:stop], value.hi[:, :, start:stop])
    return value


def _per_tile_min_max(values: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max over consecutive groups of ``block`` along the last dim (last may be short).
    The short last group is reduced on its own, not padded: a block far longer than the
    sequence (BLOCK_SIZE=2**30 for 40 positions) would allocate the whole block."""
    count = values.shape[-1]
    whole = count - count % block
    tiles = values[..., :whole].reshape(*values.shape[:-1], -1, block)
    lo, hi = tiles.amin(-1), tiles.amax(-1)
    if whole < count:
        rest = values[..., whole:]
        lo = torch.cat([lo, rest.amin(-1, keepdim=True)], -1)
        hi = torch.cat([hi, rest.amax(-1, keepdim=True)], -1)
    return lo, hi


def _finish_values(dtype: DType, lo: torch.Tensor, hi: torch.Tensor) -> Interval:
    # float32 values are exact here, but finish() also widens them for the later float math
    return intervals.finish(dtype, lo.to(torch.float64), hi.to(torch.float64))
