"""Pictures of a BlockMask: a text drawing for ``repr`` and a PNG through matplotlib.

A tile is empty (skipped), partial (mask_mod runs on it) or full (computed, no mask code).
In text one character pair stands for a group of tiles: ``##`` all full, two spaces all
empty, ``~~`` anything else.
"""
from __future__ import annotations

import itertools
import numbers
import os

import torch

from ..errors import InputError, InputTypeError, is_bool
from .tables import ordered_to_dense

EMPTY_CHAR, PARTIAL_CHAR, FULL_CHAR = " ", "~", "#"


def tile_classes(block_mask) -> torch.Tensor:
    """``[B, H, Q_TILES, KV_TILES]`` int8: 0 empty, 1 partial, 2 full."""
    kv_tiles = block_mask.kv_indices.shape[-1]
    classes = ordered_to_dense(block_mask.kv_num_blocks, block_mask.kv_indices, kv_tiles)
    if block_mask.full_kv_num_blocks is not None:
        full = ordered_to_dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, kv_tiles)
        classes = torch.maximum(classes, 2 * full)
    return classes.to(torch.int8).cpu()


def _group_char(group: torch.Tensor) -> str:
    if bool((group == 2).all()):
        return FULL_CHAR
    if bool((group == 0).all()):
        return EMPTY_CHAR
    return PARTIAL_CHAR


def _limit(func: str, limit) -> int:
    """How many (b, h) pairs to draw: a positive int (anything else drew every pair, or
    failed inside matplotlib)."""
    if is_bool(limit) or not isinstance(limit, numbers.Integral) or limit < 1:
        raise InputError(f"BlockMask.{func}: limit must be a positive int, got {limit!r:.40}")
    return int(limit)


def to_text(block_mask, grid_size: int | tuple[int, int] = (24, 24), limit: int = 2) -> str:
    """One drawing per (b, h) for the first ``limit`` of them, at most ``grid_size`` cells
    (rows, columns); -1, as torch's ``to_string`` takes it, draws every tile."""
    limit = _limit("to_string", limit)
    classes = tile_classes(block_mask)
    B, H, rows, cols = classes.shape
    row_step, col_step = (_step(tiles, cells) for tiles, cells in
                          zip((rows, cols), _grid_pair(grid_size)))
    drawings = []
    for count, (b, h) in enumerate(itertools.product(range(B), range(H))):
        if count == limit:
            drawings.append(f"... {B * H - limit} more (b, h) pairs; index the mask to see them")
            break
        lines = [f"b={b}, h={h}" + (f" (each cell {row_step}x{col_step} tiles)"
                                    if row_step * col_step > 1 else "")]
        for r in range(0, rows, row_step):
            cells = (_group_char(classes[b, h, r:r + row_step, c:c + col_step]) * 2
                     for c in range(0, cols, col_step))
            lines.append("|" + "".join(cells) + "|")
        drawings.append("\n".join(lines))
    return "\n".join(drawings)


def _grid_pair(grid_size) -> tuple:
    pair = (grid_size, grid_size) if isinstance(grid_size, int) else grid_size
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) for n in pair)):
        raise InputTypeError(f"BlockMask.to_string: grid_size must be an int or a (rows, "
                             f"columns) pair of ints, got {grid_size!r}")
    if any(n == 0 or n < -1 for n in pair):
        raise InputError(f"BlockMask.to_string: grid_size must be positive, or -1 for every "
                         f"tile, got {grid_size!r}")
    return pair


def _step(tiles: int, cells: int) -> int:
    """Tiles per cell along one axis: at most ``cells`` cells, one tile each for -1."""
    return 1 if cells == -1 else max(1, -(-tiles // cells))


def to_png(block_mask, path, limit: int = 4, dpi: int = 100) -> None:
    """Save the tile classes of the first ``limit`` (b, h) pairs as one PNG image."""
    limit = _limit("to_png", limit)
    if not isinstance(path, (str, os.PathLike)):
        raise InputTypeError(f"BlockMask.to_png: path must be a str or os.PathLike, got "
                             f"{type(path).__name__}")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.colors import ListedColormap
        from matplotlib.figure import Figure
    except ImportError as exc:  # plots are an optional extra
        raise ImportError("BlockMask.to_png needs matplotlib (pip install flexfa[plots])") from exc
    classes = tile_classes(block_mask)
    B, H = classes.shape[:2]
    pairs = list(itertools.product(range(B), range(H)))[:limit]
    figure = Figure(figsize=(max(5, 4 * len(pairs)), 5), dpi=dpi)
    FigureCanvasAgg(figure)  # attaches itself; no pyplot, so no global state is touched
    colors = ListedColormap(["#ffffff", "#f4a261", "#264653"])
    for i, (b, h) in enumerate(pairs):
        axes = figure.add_subplot(1, len(pairs), i + 1)
        axes.imshow(classes[b, h].numpy(), cmap=colors, vmin=0, vmax=2, interpolation="nearest")
        axes.set_title(f"b={b}, h={h}")
        axes.set_xlabel("kv tile")
        axes.set_ylabel("q tile")
    title = block_mask.describe().replace(", sparsity", ",\nsparsity")
    figure.suptitle(f"{title}\nwhite: empty, orange: partial, dark: full", fontsize=8)
    figure.subplots_adjust(top=0.8)
    figure.savefig(path)
