"""The density class of a block mask: the share of its tiles the kernels visit, as a key of
the kernels' tuning ("dense": no mask; "sparse": under 30% visited; "masked": the rest).

Counting the visited tiles reads the tables back to the host: a device sync, which in the
middle of a step stalls the host behind the GPU. The class is therefore kept on the mask
object and, for masks rebuilt around the same tables (compiled graphs make one per call,
around autograd's saved aliases of the tables in the backward), by the count tables' storage
signature (storages, views, version counters: an in-place edit counts again).
``create_block_mask`` records it where it already reads the tiles' classes, so a new mask's
first call reads nothing. While a CUDA graph
is captured nothing is read: the class is "masked" and not kept.
"""
from __future__ import annotations

from .validate import StorageRecords, capturing, storage_signature

SPARSE_BELOW = 0.3  # visited share under which a mask is "sparse"
_ON_MASK = "_flexfa_density_class"
# the count tables' storage signature -> their class
_BY_STORAGE = StorageRecords(256, "density classes")


def classify(visited: int, tiles: int) -> str:
    return "sparse" if visited / max(1, tiles) < SPARSE_BELOW else "masked"


def density_class(block_mask) -> str:
    if block_mask is None:
        return "dense"
    cached = getattr(block_mask, _ON_MASK, None)
    if cached is not None:
        return cached
    counts = _count_tables(block_mask)
    found = storage_signature(counts)
    result = _BY_STORAGE.get(found[0]) if found is not None else None
    if result is None:
        if capturing():  # no device-to-host read inside a CUDA graph capture
            return "masked"
        visited = counts[0].sum()
        for table in counts[1:]:
            visited = visited + table.sum()
        result = classify(int(visited), _tiles(block_mask))  # one device-to-host read
    _keep(block_mask, result, found)
    return result


def record(block_mask, result: str) -> None:
    """Keep ``result`` as the class of ``block_mask`` and of its count tables as they are."""
    _keep(block_mask, result, storage_signature(_count_tables(block_mask)))


def _keep(block_mask, result: str, found) -> None:
    try:
        setattr(block_mask, _ON_MASK, result)
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
