"""``create_block_mask`` and ``create_mask``: the public entry points.

create_block_mask = trace -> classify tiles by interval analysis (analysis.py) -> evaluate
only the undecided tiles exactly (exact.py) -> ordered tables (tables.py). No step allocates
``Q_LEN x KV_LEN``: the largest tensors are the ``[B, H, Q_TILES, KV_TILES]`` tables themselves.
"""
from __future__ import annotations

import contextlib
import logging
import time

import torch

from ..errors import InputError, InputTypeError, check_bool
from ..frontend.evaluate import dense_mask, evaluate, index_grids
from ..frontend.trace import MASK_MOD, TracedMod, trace
from ..eager import outside_compile
from . import density
from .analysis import FULL, PARTIAL, TileAnalysis, TileGrid
from .block_mask import BlockMask, TracedMaskMod
from .checks import batch_size, block_size_pair, positive_int, resolve_device
from .derive import dq_write_order
from .exact import settle_undecided
from .tables import dense_to_ordered
from .validate import mark_checked

log = logging.getLogger("flexfa.blockmask")
SLOW_BUILD_S = 2.0  # builds slower than this report at INFO level


def _trace_mask(func: str, mask_mod) -> TracedMod:
    if isinstance(mask_mod, TracedMod):
        if mask_mod.kind != MASK_MOD:
            raise InputError(f"{func}: expected a traced mask_mod, got a traced {mask_mod.kind}")
        return mask_mod
    if not callable(mask_mod):
        raise InputTypeError(f"{func}: mask_mod must be callable (b, h, q_idx, kv_idx) -> bool, "
                             f"got {type(mask_mod).__name__} {mask_mod!r:.60}")
    return trace(mask_mod, MASK_MOD)  # TraceError on wrong arity or a non-bool result


@outside_compile
def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=None, BLOCK_SIZE=128,
                      _compile=False, separate_full_blocks=True, compute_dq_write_order=False,
                      dq_kv_order=True) -> BlockMask:
    """The BlockMask of ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = attend).

    ``B`` / ``H`` ``None`` mean the mask is the same for every batch / head (size-1 tables).
    ``device=None`` is torch's default: the current accelerator (CUDA) if there is one, else
    the CPU. ``BLOCK_SIZE`` is a positive int or a ``(q, kv)`` pair, as torch's (blocks that
    are not multiples of 16 run through an equivalent mask of coarser blocks,
    ``flexfa.blockmask.coarsen``). The result equals torch's ``create_block_mask`` table for
    table. ``mask_mod`` may also be a ``TracedMod`` of kind mask_mod.
    ``separate_full_blocks=False`` lists every non-empty block as partial (no full tables: the
    mask code runs on every visited block), as torch's. ``compute_dq_write_order`` /
    ``dq_kv_order`` add torch's metadata for its deterministic dQ (``dq_write_order``...), for
    masks handed to torch; flexfa's dQ has one writer per tile and does not read it.
    ``_compile`` changes nothing (flexfa never materializes the mask: nothing to compile).
    """
    func = "create_block_mask"
    if not torch.compiler.is_compiling() and \
            torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
        # (its tensors would be fake: the mask_mod's evaluation failed with a message blaming
        # captured tensors)
        raise InputError(f"{func} evaluates the mask_mod on real indices and cannot run under "
                         "FakeTensorMode; build the mask outside the mode (or under "
                         "torch.compile)")
    # (Python bools from here on: a numpy bool is one, and dq_kv_order goes on the mask)
    _compile, separate_full_blocks, compute_dq_write_order, dq_kv_order = (
        check_bool(f"{func}: {name}", flag) for name, flag in (
            ("_compile", _compile), ("separate_full_blocks", separate_full_blocks),
            ("compute_dq_write_order", compute_dq_write_order), ("dq_kv_order", dq_kv_order)))
    block = block_size_pair(func, BLOCK_SIZE)
    B, H = batch_size(func, "B", B), batch_size(func, "H", H)
    Q_LEN, KV_LEN = positive_int(func, "Q_LEN", Q_LEN), positive_int(func, "KV_LEN", KV_LEN)
    device = resolve_device(func, device)
    traced = _trace_mask(func, mask_mod)
    grid = TileGrid(B, H, Q_LEN, KV_LEN, block[0], block[1], device)

    started = time.perf_counter()
    # (on the mask's device whatever torch's default device is: index tensors made on the
    # default one met the mask's and failed)
    with evaluating(func, traced, B, H, Q_LEN, KV_LEN), torch.device(device):
        classes, (undecided, in_full) = tile_classes(traced, grid)
    tables = ordered_tables(classes, B, H, separate_full_blocks)
    elapsed = time.perf_counter() - started
    log.log(logging.INFO if elapsed > SLOW_BUILD_S else logging.DEBUG,
            "block mask %s: %d x %d tiles, %d undecided by intervals, %d of them evaluated "
            "element by element, %.2f s", traced.name, grid.q_tiles, grid.kv_tiles, undecided,
            in_full, elapsed)
    # a plain mod's trace is not pinned: each use looks it up under the mod's guard
    user_mod = TracedMaskMod(traced) if isinstance(mask_mod, TracedMod) else mask_mod
    mask = BlockMask((Q_LEN, KV_LEN), *tables, BLOCK_SIZE=block, mask_mod=user_mod)
    if compute_dq_write_order:
        mask.dq_write_order, mask.dq_write_order_full = dq_write_order(mask, dq_kv_order)
        mask.dq_kv_order_spt = dq_kv_order
    mark_checked(mask)  # correct by construction: its first call needs no table check
    # the tuning's density class, read here after the reads of the tiles' classes above, so
    # that a first call in the middle of a step reads nothing back
    visited = int(((classes == PARTIAL) | (classes == FULL)).sum())
    density.record(mask, visited, classes.numel())
    return mask


def ordered_tables(classes: torch.Tensor, B: int, H: int,
                   separate_full: bool = True) -> list:
    """The eight BlockMask tables (kv, full kv, q, full q), expanded to [B, H, ...];
    ``separate_full=False``: full blocks listed as partial, the full tables None."""
    if separate_full:
        grids = torch.stack([classes == PARTIAL, classes == FULL])
    else:
        grids = ((classes == PARTIAL) | (classes == FULL)).unsqueeze(0)
    # partial and full grids ordered together: half the kernel launches
    kv_num, kv_idx = dense_to_ordered(grids)
    q_num, q_idx = dense_to_ordered(grids.transpose(-2, -1))
    tables = [kv_num[0], kv_idx[0], *_second(kv_num, kv_idx), q_num[0], q_idx[0],
              *_second(q_num, q_idx)]
    if classes.shape[:2] == (B, H):
        return tables
    # computed once for a mask that ignores b / h, then copied out (torch's tables are
    # contiguous [B, H, ...])
    return [None if t is None else t.expand(B, H, *t.shape[2:]).contiguous() for t in tables]


def _second(num_blocks, indices):
    """The full tables of a stacked (partial, full) pair, or (None, None) without them."""
    return (num_blocks[1], indices[1]) if num_blocks.shape[0] == 2 else (None, None)


def tile_classes(traced: TracedMod, grid: TileGrid) -> tuple[torch.Tensor, tuple[int, int]]:
    """int8 ``[B?, H?, Q_TILES, KV_TILES]`` classes (EMPTY/PARTIAL/FULL), with how many tiles
    intervals left undecided and how many of those were evaluated element by element."""
    analysis = TileAnalysis(traced, grid)
    step = analysis.rows_per_chunk()
    classes = torch.cat([analysis.classify(start, min(start + step, grid.q_tiles))
                         for start in range(0, grid.q_tiles, step)], dim=2)
    return classes, settle_undecided(traced, grid, classes)


def create_mask(mod_fn, B, H, Q_LEN, KV_LEN, device=None) -> torch.Tensor:
    """The dense ``[B, H, Q_LEN, KV_LEN]`` bool mask of a mask_mod, or of a score_mod (kept
    where the score is not -inf, scores all 0 before the mod). For small sizes and debugging."""
    func = "create_mask"
    B, H = batch_size(func, "B", B), batch_size(func, "H", H)
    Q_LEN, KV_LEN = positive_int(func, "Q_LEN", Q_LEN), positive_int(func, "KV_LEN", KV_LEN)
    device = resolve_device(func, device)
    traced = mod_fn if isinstance(mod_fn, TracedMod) else trace(mod_fn)
    with evaluating(func, traced, B, H, Q_LEN, KV_LEN), torch.no_grad():
        if traced.kind == MASK_MOD:
            return dense_mask(traced, B, H, Q_LEN, KV_LEN, device)
        b, h, q, kv = index_grids(B, H, Q_LEN, KV_LEN, device)
        score = torch.zeros(B, H, Q_LEN, KV_LEN, device=device)
        out = evaluate(traced, score=score, b=b, h=h, q_idx=q, kv_idx=kv, device=device)
        return ~torch.isneginf(out.expand(B, H, Q_LEN, KV_LEN))


@contextlib.contextmanager
def evaluating(func: str, traced: TracedMod, B: int, H: int, Q_LEN: int, KV_LEN: int):
    """An IndexError or RuntimeError of evaluating ``traced`` over the call's indices (e.g. a
    captured tensor shorter than Q_LEN) as an InputError that names the mod and the sizes."""
    try:
        yield
    except (IndexError, RuntimeError) as exc:
        raise InputError(
            f"{func}: evaluating {traced.kind} {traced.name!r} for Q_LEN={Q_LEN}, KV_LEN={KV_LEN} "
            f"(B={B}, H={H}) failed with {type(exc).__name__}: {exc}; captured tensors must "
            "cover every b, h, q_idx and kv_idx in range") from exc
