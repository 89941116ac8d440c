"""Settling undecided tiles by evaluating the mask on their elements, a bounded chunk at a time.

Tiles are gathered as coordinates ``(b, h, q_tile, kv_tile)``; a chunk of N tiles is evaluated
with index tensors shaped ``[N, Q_BLOCK, 1]`` and ``[N, 1, KV_BLOCK]``, so one chunk never holds
more than ``MAX_CHUNK_ELEMENTS`` mask values, whatever the sequence lengths. Positions past
the sequence end are evaluated at the last valid index (so captured-tensor reads stay in
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
                     max_elements: int = MAX_CHUNK_ELEMENTS) -> int:
    """Replace every UNDECIDED entry of ``classes`` (in place); returns how many there were."""
    coords = (classes == UNDECIDED).nonzero()
    total = coords.shape[0]
    if total == 0:
        return 0
    tile_elements = grid.Q_BLOCK * grid.KV_BLOCK
    per_chunk = max(1, max_elements // tile_elements)
    started = last_report = time.perf_counter()
    for first in range(0, total, per_chunk):
        chunk = coords[first:first + per_chunk]
        kept = _kept_per_tile(traced, grid, chunk)
        tile_class = torch.where(kept == 0, EMPTY, PARTIAL)
        tile_class = torch.where(kept == tile_elements, FULL, tile_class).to(torch.int8)
        classes[chunk.unbind(1)] = tile_class
        now = time.perf_counter()
        if now - last_report > PROGRESS_EVERY_S:
            last_report = now
            log.info("block mask %s: evaluated %d of %d undecided tiles exactly (%.1f s)",
                     traced.name, first + chunk.shape[0], total, now - started)
    return total


def _kept_per_tile(traced: TracedMod, grid: TileGrid, chunk: torch.Tensor) -> torch.Tensor:
    """Number of kept (True and inside the sequences) elements of each tile of the chunk."""
    device = chunk.device
    n = chunk.shape[0]
    b, h, q_tile, kv_tile = (c.view(n, 1, 1) for c in chunk.unbind(1))
    q = q_tile * grid.Q_BLOCK + torch.arange(grid.Q_BLOCK, device=device).view(1, -1, 1)
    kv = kv_tile * grid.KV_BLOCK + torch.arange(grid.KV_BLOCK, device=device).view(1, 1, -1)
    with torch.no_grad():
        value = evaluate_node(traced.root, b=b, h=h, q_idx=q.clamp(max=grid.Q_LEN - 1),
                              kv_idx=kv.clamp(max=grid.KV_LEN - 1), buffers=traced.buffers,
                              device=device)
    inside = (q < grid.Q_LEN) & (kv < grid.KV_LEN)
    return (value & inside).sum((1, 2))
