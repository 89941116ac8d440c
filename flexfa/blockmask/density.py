"""The density class of a block mask: the share of its tiles the kernels visit, as a key of
the kernels' tuning ("dense": no mask; "sparse": under 30% visited; "masked": the rest), and
the share itself (``visited_share``: the Gluon backward's default reads the mean length of a
program's walk from it).

Counting the visited tiles reads the tables back to the host: a device sync, which in the
middle of a step stalls the host behind the GPU. The class and share are therefore kept on
the mask object, with the contents generation of its tables as last checked (an in-place edit
or a replaced table, once ``check_tables`` saw it, counts again), and, for masks rebuilt
around the same tables (compiled graphs make one per call, around autograd's saved aliases of
the tables in the backward), by the count tables' storage signature (storages, views, version
counters).
``create_block_mask`` records them where it already reads the tiles' classes, so a new
mask's first call reads nothing. While a CUDA graph is captured nothing is read: the class
is "masked", the share unknown (None), and neither is kept.
"""
from __future__ import annotations

from .validate import StorageRecords, capturing, storage_signature, table_generations

SPARSE_BELOW = 0.3  # visited share under which a mask is "sparse"
_ON_MASK = "_flexfa_density_class"
_SHARE_ON_MASK = "_flexfa_visited_share"
_CONTENTS_ON_MASK = "_flexfa_density_contents"  # the tables' contents generation they are of
# the count tables' storage signature -> (their class, their visited share)
_BY_STORAGE = StorageRecords(256, "density classes")


def classify(visited: int, tiles: int) -> str:
    return "sparse" if visited / max(1, tiles) < SPARSE_BELOW else "masked"


def density_class(block_mask) -> str:
    if block_mask is None:
        return "dense"
    found = _known(block_mask)
    return "masked" if found is None else found[0]


def visited_share(block_mask) -> float | None:
    """The share of the mask's tiles the kernels visit (partial and full; 1.0 without a
    mask; None while a CUDA graph is captured and the share was not known before)."""
    if block_mask is None:
        return 1.0
    found = _known(block_mask)
    return None if found is None else found[1]


def record(block_mask, visited: int, tiles: int) -> None:
    """Keep the class and share of ``visited`` of ``tiles`` for ``block_mask`` and its count
    tables as they are."""
    _keep(block_mask, (classify(visited, tiles), visited / max(1, tiles)),
          storage_signature(_count_tables(block_mask)))


def _known(block_mask) -> tuple[str, float] | None:
    """(class, share) of a mask: kept on it, by its tables' storages, or read (one
    device-to-host read); None while capturing a CUDA graph, when it was not known."""
    cached = getattr(block_mask, _ON_MASK, None), getattr(block_mask, _SHARE_ON_MASK, None)
    if None not in cached and getattr(block_mask, _CONTENTS_ON_MASK, None) == \
            table_generations(block_mask)[1]:
        return cached
    counts = _count_tables(block_mask)
    found = storage_signature(counts)
    result = _BY_STORAGE.get(found[0]) if found is not None else None
    if result is None:
        if capturing():  # no device-to-host read inside a CUDA graph capture
            return None
        visited = counts[0].sum()
        for table in counts[1:]:
            visited = visited + table.sum()
        visited, tiles = int(visited), _tiles(block_mask)  # one device-to-host read
        result = (classify(visited, tiles), visited / max(1, tiles))
    _keep(block_mask, result, found)
    return result


def _keep(block_mask, result: tuple[str, float], found) -> None:
    try:
        setattr(block_mask, _ON_MASK, result[0])
        setattr(block_mask, _SHARE_ON_MASK, result[1])
        setattr(block_mask, _CONTENTS_ON_MASK, table_generations(block_mask)[1])
    except AttributeError:  # a frozen or slotted mask object
        pass
    if found is not None:  # else inference tensors: edits unseen, nothing kept by storage
        _BY_STORAGE.put(found[0], found[1], result)


def _count_tables(block_mask) -> list:
    full = getattr(block_mask, "full_kv_num_blocks", None)
    return [block_mask.kv_num_blocks] + ([full] if full is not None else [])


def _tiles(block_mask) -> int:
    b, h = block_mask.kv_num_blocks.shape[:2]
    return b * h * block_mask.kv_indices.shape[-2] * block_mask.kv_indices.shape[-1]
