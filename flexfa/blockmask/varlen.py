"""``varlen_block_mask``: the BlockMask of packed documents, written from their offsets.

No mask_mod is traced or evaluated per call and nothing of size L x S exists: every query row
of a document keeps one contiguous range of keys, ``[lo, hi)``:

- documents only: the document's keys;
- ``causal``: those up to the row's diagonal (documents aligned at their ends, bottom-right,
  as ``flash_attn_varlen_func``: query ``i`` of a document of ``lq`` queries and ``lk`` keys
  sees its keys ``0..i + lk - lq``; a query before the first key sees none);
- ``window=w``: ``0 <= diagonal - key < w`` with causal, ``|diagonal - key| < w`` without.

A (q tile, kv tile) is computed where some row's range meets the kv tile (a +1/-1 per row at
its range's first and past-last kv tile, summed along the kv tiles), and full where every row
of the q tile keeps the whole kv tile (max of the rows' ``lo`` and min of their ``hi``); tiles
past a sequence end are never full, as in ``create_block_mask``. The tables equal
``create_block_mask``'s of the same mask_mod. For CUDA offsets two Triton kernels write them
and check the offsets (``varlen_tables.py``: one device sync for the checks' outcome and the
totals, nothing per document on the host); CPU offsets take ``torch_tables``, O(rows +
tiles) torch work, the kernels' reference in tests.

The mask's mask_mod reads per-token tensors (``offsets.token_tensors``) whose shapes do not
depend on the lengths, so its trace (made once per (causal, window)) and the kernels compiled
for it serve every new set of lengths.
"""
from __future__ import annotations

import dataclasses

import torch

from ..eager import outside_compile
from ..errors import InputError, check_bool
from ..frontend.trace import MASK_MOD, TracedMod, trace
from ..memo import BoundedMemo
from .analysis import FULL, PARTIAL
from .block_mask import BlockMask
from .checks import block_size_pair, indexed, positive_int, resolve_device
from .create import ordered_tables
from .offsets import (Offsets, TokenTensors, check_layouts, check_window, host_offsets,
                      token_tensors, window_reach)
from .validate import capturing, mark_checked
from .varlen_tables import checked_kernel_tables, device_offsets, kernel_tables


@dataclasses.dataclass(frozen=True)
class Documents:
    """What a varlen BlockMask was built from (``block_mask.documents``): the checked offsets,
    the per-token tensors its mask_mod reads, and the mask's options."""

    offsets: Offsets
    tokens: TokenTensors
    causal: bool
    window: int | None


@outside_compile  # (a graph break inside torch.compile: Dynamo traced its internals and failed)
def varlen_block_mask(cu_seqlens_q, cu_seqlens_k=None, causal=False, window=None, *,
                      Q_LEN=None, KV_LEN=None, BLOCK_SIZE=128, device=None) -> BlockMask:
    """The BlockMask ``[1, 1, Q_LEN, KV_LEN]`` of packed documents: a query attends to keys of
    its own document (``causal``, ``window``: see the module docstring).

    ``cu_seqlens_q`` / ``cu_seqlens_k`` are int32 / int64 offsets (``[0, 3, 3, 10]``: documents
    of 3, 0 and 7 tokens; ``cu_seqlens_k`` defaults to ``cu_seqlens_q``). ``Q_LEN`` / ``KV_LEN``
    default to the last offsets and must equal them when given. ``device`` defaults to
    the offsets' device. ``block_mask.mask_mod`` is the same mask as a function of
    ``(b, h, q_idx, kv_idx)`` (usable with torch's FlexAttention), ``block_mask.documents``
    what it was built from. GPU offsets are checked on the GPU and read once (one device
    sync, with the checks' outcome and the totals); CPU offsets are checked on the host.
    """
    func = "varlen_block_mask"
    cu_seqlens_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
    causal = check_bool(f"{func}: causal", causal)
    window = check_window(func, window)
    block = block_size_pair(func, BLOCK_SIZE)
    totals = [None if n is None else positive_int(func, name, n)
              for name, n in (("Q_LEN", Q_LEN), ("KV_LEN", KV_LEN))]
    if device is None:
        device = getattr(cu_seqlens_q, "device", torch.device("cpu"))
    device = indexed(resolve_device(func, device))  # "cuda": the current device, as q's
    return checked_block_mask(func, cu_seqlens_q, cu_seqlens_k, device, totals, causal, window,
                              block)


def checked_block_mask(func: str, cu_seqlens_q, cu_seqlens_k, device: torch.device, totals,
                       causal: bool, window: int | None, block: tuple[int, int],
                       kernels: bool | None = None) -> BlockMask:
    """The BlockMask of the caller's offsets (``totals``: (Q_LEN, KV_LEN), None where not
    given), checked: on the host for CPU offsets (``offsets.host_offsets``); for offsets on
    ``device`` with tables from the kernels (``kernels``: default on CUDA) by the kernels,
    with one device sync (``varlen_tables``)."""
    check_layouts(func, cu_seqlens_q, cu_seqlens_k, device)
    if capturing() and "cuda" in (device.type, cu_seqlens_q.device.type,
                                  cu_seqlens_k.device.type):
        raise InputError(
            f"{func}: a CUDA graph is being captured; the documents' block mask is sized from "
            "the offsets on the host (a device sync or a host-to-device copy, which a capture "
            "cannot record): build it before capturing (flexfa.varlen_block_mask, then "
            "flex_attention with it), or capture varlen_attention with the offsets tensors of "
            "an earlier call, unchanged since (their mask is kept)")
    if kernels is None:
        kernels = device.type == "cuda"
    if not (kernels and cu_seqlens_q.device == device == cu_seqlens_k.device):
        offsets = host_offsets(func, cu_seqlens_q, cu_seqlens_k, device, *totals)
        return document_block_mask(offsets, causal, window, block, kernels)
    if None in totals:  # the tables' shapes need the totals: checks first
        offsets = device_offsets(func, cu_seqlens_q, cu_seqlens_k, *totals)
        return document_block_mask(offsets, causal, window, block, True)
    offsets, tokens, tables = checked_kernel_tables(func, cu_seqlens_q, cu_seqlens_k, *totals,
                                                    causal, window, block)
    return _assembled(offsets, tokens, tables, causal, window, block)


def document_block_mask(offsets: Offsets, causal: bool, window: int | None,
                        block: tuple[int, int], kernels: bool | None = None) -> BlockMask:
    """The BlockMask of checked ``offsets`` (``varlen_block_mask`` without the checks); its
    tables from two Triton kernels (``varlen_tables.py``; default for CUDA offsets) or from
    torch operations (``torch_tables``; the CPU's, and the kernels' reference in tests)."""
    if kernels is None:
        kernels = offsets.device.type == "cuda"
    tokens, tables = (kernel_tables if kernels else torch_tables)(offsets, causal, window, block)
    return _assembled(offsets, tokens, tables, causal, window, block)


def _assembled(offsets: Offsets, tokens: TokenTensors, tables: list, causal: bool,
               window: int | None, block: tuple[int, int]) -> BlockMask:
    mod = document_mask_mod(tokens, causal, window)
    mask = BlockMask((offsets.total_q, offsets.total_k), *tables,
                     BLOCK_SIZE=block, mask_mod=mod, traced_mask=traced_document_mask(mod))
    mask.documents = Documents(offsets, tokens, causal, window)
    mark_checked(mask)  # correct by construction: its first call needs no table check
    return mask


def torch_tables(offsets: Offsets, causal: bool, window: int | None,
                 block: tuple[int, int]) -> tuple[TokenTensors, list]:
    """(per-token tensors, the eight tables ``[1, 1, ...]``) from torch operations."""
    block_q, block_kv = block
    q_tiles = -(-offsets.total_q // block_q)
    kv_tiles = -(-offsets.total_k // block_kv)
    tokens, row_docs, row_diag = token_tensors(offsets, q_tiles * block_q)
    lo, hi = _key_ranges(offsets, row_docs, row_diag, causal,
                         window_reach(window, offsets.total_q, offsets.total_k))
    classes = _tile_classes(lo, hi, q_tiles, kv_tiles, block, offsets.total_k)
    return tokens, ordered_tables(classes, 1, 1)


def _key_ranges(offsets: Offsets, docs, diag, causal: bool, window: int | None):
    """Per query row, the keys it keeps: ``[lo, hi)`` (empty where lo >= hi; rows past the
    total keep none)."""
    doc = docs.clamp(min=0).long()
    lo, hi = offsets.cu_k[doc], offsets.cu_k[doc + 1]
    if causal:
        hi = torch.minimum(hi, diag + 1)
    if window is not None:
        lo = torch.maximum(lo, diag - (window - 1))
        if not causal:
            hi = torch.minimum(hi, diag + window)
    return lo, torch.where(docs >= 0, hi, lo)


def _tile_classes(lo, hi, q_tiles: int, kv_tiles: int, block, total_k: int) -> torch.Tensor:
    """int8 ``[1, 1, q_tiles, kv_tiles]`` EMPTY / PARTIAL / FULL from the rows' key ranges."""
    block_q, block_kv = block
    device = lo.device
    kept = lo < hi
    # coverage: +1 at a row's first kv tile, -1 past its last (both to a spare column when
    # the row keeps nothing), summed along the kv tiles of its q tile
    width = kv_tiles + 1
    first = torch.where(kept, lo // block_kv, kv_tiles)
    past = torch.where(kept, (hi - 1) // block_kv + 1, kv_tiles)
    row_base = torch.arange(lo.numel(), device=device) // block_q * width
    counts = torch.zeros(q_tiles * width, dtype=torch.int32, device=device)
    signs = torch.ones(2, lo.numel(), dtype=torch.int32, device=device)
    signs[1] = -1
    counts.index_put_((torch.cat([row_base + first, row_base + past]),), signs.view(-1),
                      accumulate=True)
    computed = counts.view(q_tiles, width).cumsum(-1, dtype=torch.int32)[:, :kv_tiles] > 0
    # full: every row keeps the whole kv tile (an empty row, lo >= hi, never does)
    starts = torch.arange(kv_tiles, device=device, dtype=torch.int32) * block_kv
    latest_lo = torch.where(kept, lo, total_k).view(q_tiles, block_q).amax(-1, keepdim=True)
    earliest_hi = hi.view(q_tiles, block_q).amin(-1, keepdim=True)
    full = (latest_lo <= starts) & (earliest_hi >= starts + block_kv) & \
        (starts + block_kv <= total_k)
    classes = computed.to(torch.int8) * PARTIAL + (full & computed).to(torch.int8) * (
        FULL - PARTIAL)
    return classes.view(1, 1, q_tiles, kv_tiles)


# ---- the mask_mod ---------------------------------------------------------------------------

def document_mask_mod(tokens: TokenTensors, causal: bool, window: int | None):
    """The mask as a function of ``(b, h, q_idx, kv_idx)`` reading ``tokens``, named after
    its options (``varlen_causal_window_256``)."""
    doc_q, doc_k, diag = tokens.doc_q, tokens.doc_k, tokens.diag
    if window is None and not causal:
        def mask_mod(b, h, q_idx, kv_idx):
            return doc_q[q_idx] == doc_k[kv_idx]
    elif window is None:
        def mask_mod(b, h, q_idx, kv_idx):
            return (doc_q[q_idx] == doc_k[kv_idx]) & (kv_idx <= diag[q_idx])
    elif causal:
        def mask_mod(b, h, q_idx, kv_idx):
            distance = diag[q_idx] - kv_idx
            return (doc_q[q_idx] == doc_k[kv_idx]) & (distance >= 0) & (distance < window)
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return (doc_q[q_idx] == doc_k[kv_idx]) & (abs(diag[q_idx] - kv_idx) < window)
    name = "varlen" + ("_causal" if causal else "") + \
        ("" if window is None else f"_window_{window}")
    mask_mod.__name__ = mask_mod.__qualname__ = name
    mask_mod.options = (causal, window)
    mask_mod.tokens = tokens
    return mask_mod


# (causal, window) -> (IR root, which of doc_q, doc_k, diag each buffer slot reads)
_TEMPLATES = BoundedMemo(64, "varlen mask traces")


def traced_document_mask(mod) -> TracedMod:
    """The trace of a ``document_mask_mod``: the IR traced once per (causal, window) from a
    stand-in, with this mod's tensors in its buffer slots (no trace per new lengths)."""
    template = _TEMPLATES.get(mod.options)
    if template is None:
        stand_in = TokenTensors(*(torch.zeros(1, dtype=torch.int32) for _ in range(5)))
        traced = trace(document_mask_mod(stand_in, *mod.options), MASK_MOD)
        fields = [f.name for f in dataclasses.fields(TokenTensors)]
        by_id = {id(getattr(stand_in, name)): name for name in fields}
        template = _TEMPLATES[mod.options] = (traced.root,
                                             tuple(by_id[id(t)] for t in traced.buffers))
    root, slots = template
    return TracedMod(MASK_MOD, root, tuple(getattr(mod.tokens, name) for name in slots),
                     mod.__name__)
