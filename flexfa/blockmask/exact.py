"""Settling undecided tiles from the mask's values on their elements, a bounded chunk at a time.

Two steps, both exact:
1. Probes: the mask is evaluated on each tile's two diagonals (``max(Q_BLOCK, KV_BLOCK)``
   points each). A tile with a kept and a masked probe (or a kept probe and positions past
   the sequence end) is PARTIAL: that needs no more evaluation. Causal diagonals, window
   edges and document boundaries are nearly all settled here.
2. The remaining tiles are evaluated on every element: a chunk of N tiles uses index tensors
   shaped ``[N, Q_BLOCK, 1]`` and ``[N, 1, KV_BLOCK]``.
No chunk holds more than ``MAX_CHUNK_ELEMENTS`` mask values, whatever the lengths. Positions
past the sequence end are evaluated at the last valid index (so captured-tensor reads stay in
bounds) and then counted as masked, which is what torch's padding does.
"""
from __future__ import annotations

import logging
import time

import torch

from ..frontend.evaluate import evaluate_node
from ..frontend.trace import TracedMod
from .analysis import EMPTY, FULL, PARTIAL, UNDECIDED, TileGrid

MAX_CHUNK_ELEMENTS = 1 << 21
PROGRESS_EVERY_S = 5.0
log = logging.getLogger("flexfa.blockmask")


def settle_undecided(traced: TracedMod, grid: TileGrid, classes: torch.Tensor,
                     max_elements: int = MAX_CHUNK_ELEMENTS) -> tuple[int, int]:
    """Replace every UNDECIDED entry of ``classes`` (in place).

    Returns (undecided tiles, tiles that needed every element evaluated)."""
    coords = (classes == UNDECIDED).nonzero()
    if coords.shape[0] == 0:
        return 0, 0
    probes = _probe_points(grid, coords.device)
    per_chunk = max(1, max_elements // probes[0].shape[-1])
    partial = torch.cat([_surely_partial(traced, grid, coords[i:i + per_chunk], probes)
                         for i in range(0, coords.shape[0], per_chunk)])
    classes[coords[partial].unbind(1)] = PARTIAL
    rest = coords[~partial]
    tile_elements = grid.Q_BLOCK * grid.KV_BLOCK  # (a tile with padding is never FULL)
    per_chunk = max(1, max_elements // (grid.q_span * grid.kv_span))
    started = last_report = time.perf_counter()
    for first in range(0, rest.shape[0], per_chunk):
        chunk = rest[first:first + per_chunk]
        kept = _kept_per_tile(traced, grid, chunk)
        tile_class = torch.where(kept == 0, EMPTY, PARTIAL)
        tile_class = torch.where(kept == tile_elements, FULL, tile_class).to(torch.int8)
        classes[chunk.unbind(1)] = tile_class
        now = time.perf_counter()
        if now - last_report > PROGRESS_EVERY_S:
            last_report = now
            log.info("block mask %s: evaluated %d of %d tiles element by element (%.1f s)",
                     traced.name, first + chunk.shape[0], rest.shape[0], now - started)
    return coords.shape[0], rest.shape[0]


def _probe_points(grid: TileGrid, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Offsets (q, kv) inside a tile of the points on its diagonal and anti-diagonal (of the
    part of it that can hold positions)."""
    q_span, kv_span = grid.q_span, grid.kv_span
    count = max(q_span, kv_span)
    step = torch.arange(count, device=device)
    q = step * q_span // count
    kv = step * kv_span // count
    return torch.cat([q, q]).view(1, -1), torch.cat([kv, kv_span - 1 - kv]).view(1, -1)


def _surely_partial(traced: TracedMod, grid: TileGrid, chunk: torch.Tensor,
                    probes: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """bool per tile: its probes prove it PARTIAL (some kept, and some masked or padding)."""
    n = chunk.shape[0]
    b, h, q_tile, kv_tile = (c.view(n, 1) for c in chunk.unbind(1))
    q = q_tile * grid.Q_BLOCK + probes[0]
    kv = kv_tile * grid.KV_BLOCK + probes[1]
    kept, inside = _evaluate(traced, grid, b, h, q, kv)
    incomplete = ((q_tile + 1) * grid.Q_BLOCK > grid.Q_LEN) | \
        ((kv_tile + 1) * grid.KV_BLOCK > grid.KV_LEN)
    some_kept = kept.any(1)
    some_masked = (inside & ~kept).any(1) | incomplete.view(n)
    return some_kept & some_masked


def _kept_per_tile(traced: TracedMod, grid: TileGrid, chunk: torch.Tensor) -> torch.Tensor:
    """Number of kept (True and inside the sequences) elements of each tile of the chunk."""
    device = chunk.device
    n = chunk.shape[0]
    b, h, q_tile, kv_tile = (c.view(n, 1, 1) for c in chunk.unbind(1))
    # (offsets past a span are padding, masked: evaluating them would only cost memory)
    q = q_tile * grid.Q_BLOCK + torch.arange(grid.q_span, device=device).view(1, -1, 1)
    kv = kv_tile * grid.KV_BLOCK + torch.arange(grid.kv_span, device=device).view(1, 1, -1)
    kept, _ = _evaluate(traced, grid, b, h, q, kv)
    return kept.sum((1, 2))


def _evaluate(traced: TracedMod, grid: TileGrid, b, h, q, kv):
    """(kept, inside): the mask at these positions, False past the sequence ends."""
    with torch.no_grad():
        value = evaluate_node(traced.root, b=b, h=h, q_idx=q.clamp(max=grid.Q_LEN - 1),
                              kv_idx=kv.clamp(max=grid.KV_LEN - 1), buffers=traced.buffers,
                              device=q.device)
    inside = (q < grid.Q_LEN) & (kv < grid.KV_LEN)
    return value & inside, inside
