"""The backward's dS workspace: dQ from a stored dS (``BackwardSpec.ds_dq``).

The dK/dV kernel stores each tile's dS (q's dtype) in a workspace of block slots, and the
dQ kernel then needs one GEMM per tile (dS @ K) instead of three. The workspace is L x S-sized
(about half of it for causal masks, the band for document and sliding-window masks), and the
memory policy is that nothing of size L x S is allocated unless the caller asks: it is used
only with kernel_options ``DS_WORKSPACE=True`` (the default, False or 'AUTO', never uses it)
and where it fits the budget (``DS_MAX_BYTES``, default ``DEFAULT_MAX_BYTES``, at most a
quarter of the GPU and half of its free memory). docs/performance.md has the measurements.
"""
from __future__ import annotations

import torch

from ..blockmask.validate import capturing, table_generations
from ..errors import InputError
from ..memo import MaskedMemo
from .launch import cdiv
from .tables import mask_tables
from .target import Target

DEFAULT_MAX_BYTES = 8 << 30  # 8 GiB: the benchmark's E = 128 S = 16384 cases, not S = 65536
# sm_90 tiles of this mode by padded head dim: ((BLOCK_M1, BLOCK_N1, warps, stages) of dK/dV
# storing dS, (BLOCK_M2, BLOCK_N2, warps, stages) of dQ from dS): 128-row dQ programs read K
# half as often (docs/performance.md)
HOPPER_DS_TILES = {128: ((64, 64, 4, 2), (128, 64, 8, 3))}


def budget(call, device: torch.device) -> int:
    """The most bytes the workspace may take: kernel_options ``DS_MAX_BYTES``, else
    ``DEFAULT_MAX_BYTES`` (at most a quarter of the GPU's memory); on a GPU never more than
    half of what is free now."""
    chosen = call.options.ds_max_bytes
    if device.type != "cuda":
        return chosen or DEFAULT_MAX_BYTES
    free, total = torch.cuda.mem_get_info(device)
    return min(chosen or min(DEFAULT_MAX_BYTES, total // 4), free // 2)


def allowed(call, fusable: bool, workspace_bytes, device: torch.device) -> bool:
    """Whether to store dS: only where the caller opted in (``DS_WORKSPACE=True``), the call
    is ``fusable`` (no captured tensor needs a gradient, dK and dV are wanted) and the
    workspace (``workspace_bytes()``, computed only when the rest allows it) fits the
    budget."""
    if not fusable or call.options.ds_workspace is not True:
        return False
    return workspace_bytes() <= budget(call, device)


def tiles(target: Target, head_dim_pad: int, dtype: torch.dtype) -> tuple | None:
    """The mode's own tiles (``HOPPER_DS_TILES``), or None: it keeps the two-kernel tiles."""
    if not target.is_sm90 or dtype == torch.float32:
        return None
    return HOPPER_DS_TILES.get(head_dim_pad)


def bands(block_mask, L: int, S: int, sparse_q: int, sparse_kv: int,
          device: torch.device) -> tuple[torch.Tensor, int]:
    """(band, slots) of the workspace's block slots.

    ``band[b, h, j] = (base_j, minq_j)``, int32 ``[Bm, Hm, NKV, 2]`` over the block mask's
    batch and head dims: kv block j meets q blocks ``minq_j`` to ``maxq_j`` (the first and last
    of its partial and full q tables), and (kv block j, q block i) is slot ``base_j + i -
    minq_j`` of its head, ``base_j`` counting the bands before it. ``slots`` is the largest
    count of any head, so the workspace holds ``B * HQ * slots`` tiles of ``sparse_kv x
    sparse_q``. Without a block mask every (kv block, q block) has a slot."""
    nq, nkv = cdiv(L, sparse_q), cdiv(S, sparse_kv)
    if block_mask is None:
        j = torch.arange(nkv, dtype=torch.int32, device=device)
        band = torch.stack([j * nq, torch.zeros_like(j)], -1).reshape(1, 1, nkv, 2)
        return band, nq * nkv
    low = high = None
    for name in ("q", "full_q"):
        found = mask_tables(block_mask, name)
        if not found:
            continue
        num_blocks, indices = found
        valid = torch.arange(indices.shape[-1], device=indices.device) < num_blocks[..., None]
        indices = indices.long()
        lo = torch.where(valid, indices, nq).amin(-1) if indices.shape[-1] else None
        hi = torch.where(valid, indices, -1).amax(-1) if indices.shape[-1] else None
        if lo is not None:
            low = lo if low is None else torch.minimum(low, lo)
            high = hi if high is None else torch.maximum(high, hi)
    if low is None:  # no block meets any other: one empty band per kv block
        shape = tuple(block_mask.kv_num_blocks.shape[:2]) + (nkv,)
        return torch.zeros(*shape, 2, dtype=torch.int32, device=device), 1
    width = (high - low + 1).clamp(min=0)
    base = width.cumsum(-1) - width
    band = torch.stack([base, torch.where(width > 0, low, 0)], -1).to(torch.int32)
    return band.to(device).contiguous(), max(1, int(width.sum(-1).max()))


_BANDS = MaskedMemo(64, per_mask=4, name="dS bands")


def bands_of(block_mask, L: int, S: int, sparse_q: int, sparse_kv: int, device) -> tuple:
    """``bands``, memoized under the block mask (dropped with it) by the state of its tables
    (``table_generations``: an in-place edit changes the bands) and the geometry. Raises
    InputError while a CUDA graph is being recorded: the workspace's size and bands are read
    from the tables on the host, and a replay with other tables would overrun it."""
    if capturing():
        if block_mask is not None:
            raise InputError("kernel_options DS_WORKSPACE=True cannot run inside a CUDA graph "
                             "capture (torch.cuda.graph, torch.compile mode='reduce-overhead'): "
                             "its workspace is sized from the block mask's contents on the "
                             "host, which a replay does not re-read; leave DS_WORKSPACE unset "
                             "there")
        # recorded, not memoized: the graph's kernels write it at each replay, not before
        # (a memo of it would serve a later call unwritten memory)
        return bands(None, L, S, sparse_q, sparse_kv, device)
    contents = table_generations(block_mask)[1] if block_mask is not None else 0
    if contents is None:  # tables whose edits cannot be seen: computed every time
        return bands(block_mask, L, S, sparse_q, sparse_kv, device)
    key = (contents, L, S, sparse_q, sparse_kv, device)
    entry = _BANDS.get(block_mask, key)
    if entry is None:
        entry = bands(block_mask, L, S, sparse_q, sparse_kv, device)
        _BANDS.put(block_mask, key, entry)
    return entry
