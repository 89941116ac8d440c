"""Block-mask table contents, checked before a kernel reads them.

The kernels take the tiles they visit from the tables without bounds checks: an entry edited
in place to an out-of-range value would read outside K, V or Q (a segmentation fault under the
interpreter, an illegal address or garbage on a GPU), and a tile listed twice would count twice.
``check_tables(block_mask, L, S)`` raises InputError, naming the table, the entry and its value,
unless, in the rows the kernels read (the q tiles of L in the kv tables, the kv tiles of S in
the q tables):

- each row's count (``*_num_blocks``) is in 0..(the row's width of ``*_indices``);
- the first count entries of a row are tile indices (not negative), none of the other
  length's tiles (kv tiles of S in the kv tables, q tiles of L in the q tables) twice; entries
  past the count are never read (torch pads them);
- no tile is both partial and full;
- the q tables list the kv tables' (q tile, kv tile) pairs, transposed: the forward walks the
  kv tables, the backward the q tables.

A listed index past the length's tiles is no fault: torch's ``_adjust`` leaves such tiles
listed where it crops a mask (its recount keeps a row's first entries), and torch's kernels
mask their positions, so they add nothing. The check reports whether the tables list any
(``check_tables``' result); the kernels, which read a listed tile without bounds checks, then
run a copy of the tables without them (``coarsen.runnable_block_mask``).

The outcome is kept on the mask object with each table's identity and version counter,
which every in-place edit bumps (views share it): a later call with unchanged tables
costs a few attribute reads and no device sync, and an edited or replaced table is checked
again. Edits through ``.data`` or ``.numpy()`` do not bump the version and are not seen; tables
that are inference tensors (no version counter) are checked on every call.

A passed check is also recorded by what the tables are rather than which objects hold them
(each table's storage, offset, shape, strides, dtype and version; the storages held by weak
reference, so a freed one cannot be mistaken for a new one at its address): a compiled graph's
operators rebuild a BlockMask per call around aliases of the mask's tables (autograd's saved
tensors in the backward), which find their check there instead of syncing again.
"""
from __future__ import annotations

import functools
import itertools
import operator
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..errors import InputError, dims
from ..memo import BoundedMemo, contents_keys, memory_of

PAIRS = ("kv", "full_kv", "q", "full_q")
TABLES = tuple(f"{pair}_{part}" for pair in PAIRS for part in ("num_blocks", "indices"))
_STATE = "_flexfa_tables"  # the attribute of the mask that keeps the outcome
_GENERATION = itertools.count(1)
_table_getter = operator.attrgetter(*TABLES)


class TableState:
    """The tables a mask had when they were last checked: their ids (kept valid by weakref
    callbacks: a table that dies marks the state stale, so its id cannot be taken by a new
    table), contents (``memo.contents_keys``: version counters, memory addresses), views
    (``views``: shape, strides, dtype, device, alignment) and geometry
    (BLOCK_SIZE, L, S). ``layout`` changes when a table is replaced, its view changes or the
    geometry does (plans fix the block size) and ``contents`` whenever a table may have
    changed: memos of what the runtime derives from the tables key on them
    (``table_generations``). ``past``: whether they list tiles past the lengths (None:
    unknown, checked inside a CUDA graph capture)."""

    __slots__ = ("ids", "versions", "storages", "views", "geometry", "layout", "contents",
                 "live", "refs", "past", "__weakref__")

    def __init__(self, tables, versions, views, geometry, layout: int, past: bool | None):
        self.ids, self.versions, self.geometry = tuple(map(id, tables)), versions, geometry
        # (their memory held: the addresses in ``versions`` name no other memory)
        self.storages = [memory_of(t) for t in tables if t is not None]
        self.views, self.layout, self.past = views, layout, past
        self.contents = next(_GENERATION) if versions is not None else None
        self.live = True
        stale = _stale_callback(weakref.ref(self))
        self.refs = [weakref.ref(t, stale) for t in tables if t is not None]

    def matches(self, tables, geometry) -> bool:
        """Same table objects, none edited or given other memory since (``t.data = other``
        keeps the version counter), same geometry."""
        return (self.live and self.versions is not None and geometry == self.geometry
                and self.ids == tuple(map(id, tables))
                and self.versions == contents_keys(list(filter(_present, tables))))


def _stale_callback(state_ref):
    def stale(_):
        state = state_ref()
        if state is not None:
            state.live = False
    return stale


def tables_of(block_mask) -> tuple:
    """The mask's tables in ``TABLES`` order (None for those a duck-typed mask lacks)."""
    try:
        return _table_getter(block_mask)
    except AttributeError:  # a duck-typed mask without the full or q tables
        return tuple(getattr(block_mask, name, None) for name in TABLES)


_present = functools.partial(operator.is_not, None)


def check_tables(block_mask, L: int, S: int) -> bool | None:
    """Raise InputError unless ``block_mask``'s tables are safe and consistent for lengths
    (L, S) (the module docstring lists the rules); else whether they list tiles past the
    lengths (None: unknown, inside a CUDA graph capture). Cheap when they were checked before
    and have not changed since; None (no mask) passes."""
    if block_mask is None:
        return False
    tables = tables_of(block_mask)
    state = getattr(block_mask, _STATE, None)
    geometry = (block_mask.BLOCK_SIZE, L, S)
    if state is not None and state.matches(tables, geometry):
        return state.past
    past = _checked_before(tables, geometry)
    if past is None:
        block_q, block_kv = (int(b) for b in block_mask.BLOCK_SIZE)
        past = check_contents(dict(zip(TABLES, tables)), (block_q, block_kv, int(L), int(S)))
        if past is None:  # a device-side assert, run at replay:
            return None  # nothing is proven yet, so nothing is remembered
    _remember(block_mask, tables, geometry, state, past)
    return past


class StorageRecords:
    """Values kept by what tensors are (a key holding their ``storage_signature``), bounded,
    holding no tensor's memory: a value is found only while every storage it was recorded
    with lives, since a freed storage's address may be taken by a new one."""

    def __init__(self, size: int, name: str):
        self._memo = BoundedMemo(size, name)

    def get(self, key, default=None):
        found = self._memo.get(key)
        if found is None or any(ref.expired() for ref in found[1]):
            return default
        return found[0]

    def put(self, key, refs, value) -> None:
        """Keep ``value`` under ``key`` while the storages of ``refs`` (the signature's weak
        references) live."""
        self._memo[key] = (value, refs)


# (geometry, each table's storage and view): tables checked for a geometry, whoever held them
_CHECKED = StorageRecords(256, "checked block-mask tables")


def storage_signature(tensors, versions: bool = True):
    """(signature, weak references to the storages) of ``tensors`` (None entries allowed) as
    they are now: each one's storage, offset, shape, strides, dtype, device and, with
    ``versions``, version counter; aliases (views, ``detach()``, autograd's saved tensors)
    of the same memory have the same signature. None when a tensor is an inference tensor
    (no version counter) or has no plain storage (sparse, a tensor subclass's wrapper). A
    signature names its storages by address: it is only valid while they live, which the weak
    references tell (``expired()``)."""
    views, refs = [], []
    for tensor in tensors:
        if tensor is None:
            views.append(None)
            continue
        try:
            version = tensor._version if versions else None
            ref = StorageWeakRef(tensor.untyped_storage())
        except (RuntimeError, NotImplementedError, TypeError):
            return None
        refs.append(ref)
        views.append((ref.cdata, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(),
                      tensor.dtype, tensor.device, version))
    return tuple(views), refs


def _storage_key(tables, geometry):
    """(key, weak references to the storages) of ``tables`` for ``geometry``, or None."""
    found = storage_signature(tables)
    if found is None:
        return None
    block_size, L, S = geometry
    return (tuple(int(b) for b in block_size), int(L), int(S), found[0]), found[1]


# (geometry, each table's storage and view) -> whether the kv tables list every tile of the
# lengths as partial (``every_tile_partial``)
_EVERY_PARTIAL = StorageRecords(64, "block-mask tables listing every tile")


def every_tile_partial(block_mask, L: int, S: int) -> bool | None:
    """Whether the kv tables (checked: ``check_tables``) list every kv tile of S as partial in
    every q tile of L, none full: then the mask_mod decides every element, whatever batch or
    head the tables were built for. One device sync per state of the tables (remembered by
    what they are, as checks are); None inside a CUDA graph capture when not known before."""
    tables = tables_of(block_mask)
    geometry = (block_mask.BLOCK_SIZE, L, S)
    found = _storage_key(tables, geometry)
    if found is not None:
        known = _EVERY_PARTIAL.get(found[0])
        if known is not None:
            return known
    block_q, block_kv = (int(b) for b in block_mask.BLOCK_SIZE)
    q_tiles, kv_tiles = -(-int(L) // block_q), -(-int(S) // block_kv)
    # (the tables passed check_tables: the faults and past entries it collects are not needed)
    result = _listed_tiles("", "kv", block_mask.kv_num_blocks, block_mask.kv_indices, q_tiles,
                           kv_tiles, "", [], []).all()
    full = block_mask.full_kv_num_blocks
    if full is not None:
        result = result & (full[..., :q_tiles] == 0).all()
    if _capturing(result):
        return None
    result = bool(result)  # the sync
    if found is not None:
        _EVERY_PARTIAL.put(found[0], found[1], result)
    return result


def _record_checked(tables, geometry, past: bool | None) -> None:
    found = _storage_key(tables, geometry)
    if found is not None and past is not None:
        _CHECKED.put(found[0], found[1], past)


def _checked_before(tables, geometry) -> bool | None:
    """Whether tables with these storages, views and versions that passed a check for
    ``geometry`` list tiles past the lengths; None: no such check, or their storages died
    since (a freed storage's address may be reused)."""
    found = _storage_key(tables, geometry)
    return None if found is None else _CHECKED.get(found[0])


def checked_past(block_mask) -> bool | None:
    """None unless the mask's tables were checked for its own lengths and are unchanged
    since; then whether they list tiles past the lengths (``TableState.past``)."""
    state = getattr(block_mask, _STATE, None)
    if state is not None and state.matches(
            tables_of(block_mask), (block_mask.BLOCK_SIZE, *block_mask.seq_lengths)):
        return state.past
    return None


def mark_checked(block_mask, past: bool | None = False) -> None:
    """Record ``block_mask``'s tables (built by flexfa, correct by construction, or copies of
    checked ones) as checked for its own lengths, so that its first call needs no check (no
    device sync); ``past``: whether they list tiles past the lengths (None: unknown)."""
    _remember(block_mask, tables_of(block_mask), (block_mask.BLOCK_SIZE, *block_mask.seq_lengths),
              None, past)


def _views(tables) -> tuple:
    """Each table's shape, strides, dtype, device and 16-byte alignment: what plans fix
    besides the objects (``set_`` or ``resize_`` changes them in place, the table staying the
    same object; a cached plan launches the kernel its first call compiled for them)."""
    return tuple(None if t is None else (t.shape, t.stride(), t.dtype, t.device,
                                         t.data_ptr() % 16 == 0) for t in tables)


def _remember(block_mask, tables, geometry, state, past: bool | None) -> None:
    _record_checked(tables, geometry, past)
    views = _views(tables)
    same = (state is not None and state.live and state.ids == tuple(map(id, tables))
            and state.views == views and state.geometry == geometry)
    layout = state.layout if same else next(_GENERATION)
    try:
        keys = contents_keys(list(filter(_present, tables)))
        setattr(block_mask, _STATE, TableState(tables, keys, views, geometry, layout, past))
    except AttributeError:  # a frozen or slotted mask object: checked on every call
        pass


def table_state(block_mask) -> TableState | None:
    """The state of the mask's tables as last checked (a new object after every check that
    found them changed), or None."""
    return getattr(block_mask, _STATE, None)


def still_checked(block_mask, state: TableState, L: int, S: int) -> bool:
    """Whether ``state`` is the mask's table state and still matches its tables for lengths
    (L, S): ``check_tables`` would pass without looking at the contents."""
    return (getattr(block_mask, _STATE, None) is state
            and state.matches(tables_of(block_mask), (block_mask.BLOCK_SIZE, L, S)))


def table_generations(block_mask) -> tuple:
    """(layout, contents) of the mask's tables as last checked: ``layout`` changes when a
    table is replaced (memos holding the tables themselves key on it), ``contents`` whenever a
    table may have changed (memos of what the runtime computes from their values key on it;
    None: unknown, do not memoize). (None, None) for no mask or an unchecked one."""
    state = getattr(block_mask, _STATE, None)
    if state is None:
        return None, None
    return state.layout, state.contents


# ---- the checks -----------------------------------------------------------------------------

def check_contents(tables: dict, geometry: tuple, where: str = "block_mask.") -> bool | None:
    """Raise InputError unless ``tables`` (name -> tensor or None; absent pairs are skipped)
    obey the module's rules for ``geometry`` (block_q, block_kv, L, S); else whether they list
    tiles past the lengths (None: unknown, inside a CUDA graph capture, where a fault is a
    device-side assert). One device sync; ``where`` prefixes the table names in messages."""
    block_q, block_kv, L, S = geometry
    q_tiles, kv_tiles = -(-L // block_q), -(-S // block_kv)
    grids, faults, past = {}, [], []
    for pair, rows, tiles, what in (("kv", q_tiles, kv_tiles, f"the kv tiles of S={S}"),
                                    ("full_kv", q_tiles, kv_tiles, f"the kv tiles of S={S}"),
                                    ("q", kv_tiles, q_tiles, f"the q tiles of L={L}"),
                                    ("full_q", kv_tiles, q_tiles, f"the q tiles of L={L}")):
        num_blocks, indices = tables.get(f"{pair}_num_blocks"), tables.get(f"{pair}_indices")
        if num_blocks is None or indices is None:
            continue
        _check_layout(where, pair, num_blocks, indices, tables["kv_num_blocks"], rows)
        grids[pair] = _listed_tiles(where, pair, num_blocks, indices, rows, tiles, what, faults,
                                    past)
    for kv, q in (("kv", "q"), ("full_kv", "full_q")):
        if q in grids and kv not in grids:  # (a q table without its kv table: none listed)
            faults.append((grids[q], lambda at, kv=kv, q=q: (
                f"{where}{q}_indices lists (kv tile {at[2]}, q tile {at[3]}) of batch {at[0]}, "
                f"head {at[1]} but {where}{kv}_num_blocks/{kv}_indices are None: the q tables "
                "must be the kv tables transposed")))
        if kv in grids and q not in grids:
            # no q tables: the backward transposes the kv tables whole, so listed tiles in
            # rows past L's q tiles become q tiles past L (clipped: ``past``)
            num_blocks, indices = tables[f"{kv}_num_blocks"], tables[f"{kv}_indices"]
            extra_n, extra_i = num_blocks[..., q_tiles:], indices[..., q_tiles:, :]
            listed = torch.arange(extra_i.shape[-1], device=extra_i.device) < extra_n[..., None]
            past.append(listed & (extra_i >= 0))
        if kv in grids and q in grids:
            differ = grids[kv] != grids[q].transpose(-2, -1)
            faults.append((differ, lambda at, kv=kv, q=q: _untransposed(where, kv, q, grids, at)))
    if "kv" in grids and "full_kv" in grids:
        faults.append((grids["kv"] & grids["full_kv"], lambda at: (
            f"{where}kv_indices and {where}full_kv_indices both list kv tile {at[3]} of q tile "
            f"{at[2]} (batch {at[0]}, head {at[1]}); a tile is either partial or full")))
    if not faults:
        return False
    found = torch.stack([bad.any() for bad, _ in faults] + [listed.any() for listed in past])
    if _capturing(found):  # no sync inside a CUDA graph: a device-side assert instead
        torch._assert_async(~found[:len(faults)].any(), f"flexfa: {where}* tables are "
                            "inconsistent (checked during CUDA graph capture; outside a capture "
                            "the message names the table and tile)")
        return None
    found = found.tolist()  # the one sync
    for (bad, message), hit in zip(faults, found):
        if hit:
            raise InputError(message(tuple(bad.nonzero()[0].tolist())))
    return any(found[len(faults):])


def _capturing(tensor) -> bool:
    """Whether ``tensor``'s device is recording a CUDA graph on its current stream."""
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def capturing() -> bool:
    """Whether the current CUDA stream is recording a CUDA graph. What the host derives from
    the tables' values would be baked into the graph, stale once a replay reads new contents
    (cudagraph trees copy new tables into the graph's inputs; a static mask may be edited in
    place): memos of such values are not used while capturing, and values the host must read
    are not computed then."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _check_layout(where: str, pair: str, num_blocks, indices, kv_num_blocks, rows: int) -> None:
    """Shapes and dtypes of one table pair: what the kernels' pointer arithmetic assumes."""
    for name, table, ndim in ((f"{pair}_num_blocks", num_blocks, 3),
                              (f"{pair}_indices", indices, 4)):
        if table.dtype.is_floating_point or table.dtype.is_complex or table.dtype is torch.bool:
            raise InputError(f"{where}{name} must hold integers, got {table.dtype}")
        if table.dim() != ndim or table.device != kv_num_blocks.device:
            raise InputError(f"{where}{name} has shape {dims(table)} on {table.device}; "
                             f"expected {ndim} dims on {kv_num_blocks.device}, as kv_num_blocks")
    if num_blocks.shape != indices.shape[:-1] or num_blocks.shape[:2] != kv_num_blocks.shape[:2]:
        raise InputError(f"{where}{pair}_num_blocks has shape {dims(num_blocks)} and "
                         f"{pair}_indices {dims(indices)}; expected [B, H, ROWS] and "
                         f"[B, H, ROWS, COLS] with the (B, H) of kv_num_blocks "
                         f"{tuple(kv_num_blocks.shape[:2])}")
    if num_blocks.shape[-1] < rows:
        raise InputError(f"{where}{pair}_num_blocks has {num_blocks.shape[-1]} rows but the "
                         f"lengths need {rows}")


def _listed_tiles(where: str, pair: str, num_blocks, indices, rows: int, tiles: int, what: str,
                  faults: list, past: list) -> torch.Tensor:
    """The bool grid ``[B, H, rows, tiles]`` of the tiles that the first ``rows`` rows of a
    table pair list; appends to ``faults`` (bad entries, message of the first) a count outside
    0..width, a negative listed index and a tile listed twice in a row, and to ``past`` the
    listed entries past the tiles."""
    num_blocks, indices = num_blocks[..., :rows], indices[..., :rows, :].long()
    width = indices.shape[-1]
    listed = torch.arange(width, device=indices.device) < num_blocks.unsqueeze(-1)
    bad_index = listed & (indices < 0)
    past.append(listed & (indices >= tiles))
    # listed entries of a tile add 1 to it; the rest go to a spare column
    target = torch.where(listed & (indices >= 0) & (indices < tiles), indices, tiles)
    counts = torch.zeros(*indices.shape[:-1], tiles + 1, dtype=torch.int32,
                         device=indices.device)
    counts.scatter_add_(-1, target, torch.ones_like(target, dtype=torch.int32))
    counts = counts[..., :tiles]
    faults += [
        ((num_blocks < 0) | (num_blocks > width), lambda at: (
            f"{where}{pair}_num_blocks{list(at)} is {int(num_blocks[at])}; counts must be in "
            f"0..{width} (the columns of {pair}_indices)")),
        (bad_index, lambda at: (
            f"{where}{pair}_indices{list(at)} is {int(indices[at])}; the first "
            f"{pair}_num_blocks entries of a row must be tile indices, 0 and up ({what} are "
            f"0..{tiles - 1}; tiles past them are skipped, entries past the count not read)")),
        (counts > 1, lambda at: (
            f"{where}{pair}_indices{list(at[:3])} lists tile {at[3]} {int(counts[at])} times; "
            "a row lists each tile at most once"))]
    return counts > 0


def _untransposed(where: str, kv: str, q: str, grids: dict, at: tuple) -> str:
    b, h, i, j = at
    listed, missing = (kv, q) if bool(grids[kv][at]) else (q, kv)
    return (f"{where}{listed}_indices lists (q tile {i}, kv tile {j}) of batch {b}, head {h} but "
            f"{where}{missing}_indices does not: the q tables must be the kv tables transposed "
            "(the forward walks the kv tables, the backward the q tables); after editing kv "
            "tables, rebuild the mask with BlockMask.from_kv_blocks, which derives the q tables")
