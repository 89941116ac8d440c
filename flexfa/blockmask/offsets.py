"""Packed documents given by offsets (``cu_seqlens``), checked, and what the kernels read of them.

``cu_seqlens_q = [0, 3, 3, 10]`` says the packed queries hold three documents of 3, 0 and 7
tokens; ``cu_seqlens_k`` has one entry per document too (as ``flash_attn_varlen_func``'s).
``check_offsets`` validates both on the host (for device offsets ``varlen_tables`` runs the
same checks in its kernels, with one device-to-host read) and returns ``Offsets``;
``token_tensors`` gives, per packed token, the int32 tensors the mods read: its document,
its position inside the document and, per query, the key position of its diagonal. They are
padded to a power of two (``padded_length``) so that their shapes, which are part of the
kernels' key, depend on neither the number of documents nor, within a power of two, the
total: new lengths are data, never a new kernel.
"""
from __future__ import annotations

import dataclasses
import numbers

import numpy
import torch

from ..errors import InputError, InputTypeError, dims, shown

MIN_PADDED = 128  # the shortest padded per-token tensor
PAD_DOC_Q, PAD_DOC_K = -1, -2  # documents of padded positions: they never match
INT32_MAX = 2 ** 31 - 1


def padded_length(tokens: int) -> int:
    """The length of the per-token tensors of ``tokens`` tokens: a power of two >= 128."""
    return 1 << max(MIN_PADDED.bit_length() - 1, (max(tokens, 1) - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class Offsets:
    """Checked offsets of packed queries and keys: int32 on ``device``, one entry more than
    documents; totals, longest documents and the number of documents as Python ints."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    total_q: int
    total_k: int
    max_q: int
    max_k: int

    @property
    def documents(self) -> int:
        return self.cu_q.numel() - 1

    @property
    def device(self) -> torch.device:
        return self.cu_q.device


def check_offsets(func: str, cu_seqlens_q, cu_seqlens_k, device: torch.device,
                  total_q: int | None = None, total_k: int | None = None,
                  empty_ok: bool = False) -> Offsets:
    """``Offsets`` of ``cu_seqlens_q`` / ``cu_seqlens_k`` for tensors on ``device``, checked on
    the host (``check_layouts``, then ``host_offsets``: a device sync for device offsets;
    ``varlen_tables`` checks device offsets in its kernels instead)."""
    check_layouts(func, cu_seqlens_q, cu_seqlens_k, device)
    return host_offsets(func, cu_seqlens_q, cu_seqlens_k, device, total_q, total_k, empty_ok)


def check_layouts(func: str, cu_seqlens_q, cu_seqlens_k, device: torch.device) -> None:
    """What the offsets' metadata says (no device sync), or an InputError / InputTypeError:
    each a 1-D int32 or int64 tensor on the CPU or ``device`` with at least 2 entries, both
    with as many."""
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _check_layout(func, name, cu, device)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise InputError(
            f"{func}: cu_seqlens_q has {cu_seqlens_q.numel()} entries "
            f"({cu_seqlens_q.numel() - 1} documents) but cu_seqlens_k has "
            f"{cu_seqlens_k.numel()} ({cu_seqlens_k.numel() - 1} documents); both list the "
            "offsets of the same documents")


def host_offsets(func: str, cu_seqlens_q, cu_seqlens_k, device: torch.device,
                 total_q: int | None = None, total_k: int | None = None,
                 empty_ok: bool = False) -> Offsets:
    """``Offsets`` of offsets whose layout is checked, their values checked on the host (numpy:
    no torch launches) by the rules of ``varlen_kernels._check``: starting at 0, >= 0,
    non-decreasing, the last entry the total (``total_q`` / ``total_k`` where given), not 0
    unless ``empty_ok`` (``varlen_attention`` of no tokens, which launches nothing), within
    int32. Their int32 copies reach ``device`` in one copy (the caller may reuse its
    offsets tensors; a mask kept per offsets tensor must not hold them)."""
    checked = [_check_values(func, name, cu, total, empty_ok) for name, cu, total in (
        ("cu_seqlens_q", cu_seqlens_q, total_q), ("cu_seqlens_k", cu_seqlens_k, total_k))]
    (values_q, last_q, max_q), (values_k, last_k, max_k) = checked
    # one copy; the key offsets 128-byte aligned, as the kernels' every pointer (Triton
    # specializes on alignment: the number of documents must not compile a new kernel)
    entries = len(values_q)
    start = -(-entries // 32) * 32
    both = numpy.zeros(start + entries, dtype=numpy.int32)
    both[:entries], both[start:] = values_q, values_k
    both = torch.from_numpy(both).to(device)
    return Offsets(both[:entries], both[start:], last_q, last_k, max_q, max_k)


def raise_bad_offsets(func: str, cu_seqlens_q, cu_seqlens_k, total_q: int | None,
                      total_k: int | None) -> None:
    """The InputError of offsets the device checks flagged (the host's checks, which name the
    entry and the values; device syncs, on the error path only)."""
    host_offsets(func, cu_seqlens_q, cu_seqlens_k, torch.device("cpu"), total_q, total_k)
    raise AssertionError(f"{func}: the device checks flagged offsets the host's accept: "
                         f"{shown(_values(cu_seqlens_q))}, {shown(_values(cu_seqlens_k))}")


def _values(cu: torch.Tensor):
    return cu.detach().cpu().numpy().astype(numpy.int64, copy=False)


def _check_values(func: str, name: str, cu: torch.Tensor, total: int | None, empty_ok: bool):
    """(int64 values, last entry, longest document) of one offsets tensor, or its InputError."""
    values = _values(cu)
    if values.min() < 0:
        at = int(numpy.argmax(values < 0))
        raise InputError(f"{func}: {name}[{at}] is {values[at]}; offsets must be >= 0, "
                         f"got {shown(values)}")
    if values[0] != 0:
        raise InputError(f"{func}: {name}[0] is {values[0]}; offsets start at 0, got "
                         f"{shown(values)}")
    lengths = numpy.diff(values)
    if (lengths < 0).any():
        bad = int(numpy.argmax(lengths < 0))
        raise InputError(
            f"{func}: {name} decreases at index {bad + 1} ({values[bad]} -> {values[bad + 1]}); "
            f"offsets must be sorted (non-decreasing), got {shown(values)}")
    last = int(values[-1])
    if total is not None and last != total:
        tensor = "query" if name.endswith("q") else "key"
        raise InputError(
            f"{func}: {name}[-1] is {last} but {tensor} has {total} tokens; the last offset "
            "must equal the total number of packed tokens")
    if last == 0 and not empty_ok:
        raise InputError(f"{func}: {name} holds no tokens (its last entry is 0): "
                         f"{shown(values)}")
    if last > INT32_MAX:
        raise InputError(f"{func}: {name}[-1] is {last}; offsets must fit in int32 (at most "
                         f"{INT32_MAX})")
    return values, last, int(lengths.max())


def _check_layout(func: str, name: str, cu, device: torch.device) -> None:
    if not isinstance(cu, torch.Tensor):
        raise InputTypeError(f"{func}: {name} must be a 1-D int32 or int64 tensor of offsets, "
                             f"got {type(cu).__name__}")
    if cu.dtype not in (torch.int32, torch.int64):
        raise InputTypeError(f"{func}: {name} must hold int32 or int64 offsets, got {cu.dtype}")
    if cu.layout is not torch.strided:  # (numpy, which reads the values, takes no other)
        raise InputError(f"{func}: {name} has layout {cu.layout}; pass a dense tensor "
                         "(.to_dense())")
    if cu.dim() != 1 or cu.numel() < 2:
        raise InputError(f"{func}: {name} must be 1-D with at least 2 entries (0 and the total), "
                         f"got shape {dims(cu)}")
    if cu.device.type != "cpu" and cu.device != device:
        raise InputError(f"{func}: {name} is on {cu.device} but the attention runs on {device}; "
                         + (f"pass offsets on {device} or on the CPU"
                            if torch.device(device).type != "cpu" else "pass offsets on the CPU"))


def check_window(func: str, window) -> int | None:
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, numbers.Integral):
        raise InputTypeError(f"{func}: window must be an int or None, got "
                             f"{type(window).__name__} {window!r}")
    if window < 1:
        raise InputError(f"{func}: window must be >= 1 (keys per query), got {window}")
    # positions are int32: a window past INT32_MAX keeps what INT32_MAX keeps (every key of
    # the document on the allowed side), and one past int64 would overflow in torch
    return min(int(window), INT32_MAX)


def window_reach(window: int | None, total_q: int, total_k: int) -> int | None:
    """``window`` for the tables' int32 arithmetic on key indices (``diagonal + window``,
    ``diagonal - (window - 1)``, the diagonal within ``[-total_q, total_k]``): at most
    ``total_q + total_k + 1``, which already keeps every key of a row's document on the
    allowed side (a window near INT32_MAX wrapped there: tiles of kept keys dropped)."""
    return None if window is None else min(window, total_q + total_k + 1)


@dataclasses.dataclass(frozen=True)
class TokenTensors:
    """Per packed token, padded to ``padded_length``: ``doc_q`` / ``doc_k`` the document (padding
    -1 / -2), ``pos_q`` / ``pos_k`` the position inside it (padding 0), ``diag`` the key index
    (packed) of each query's diagonal: documents are aligned at their ends (bottom-right, as
    flash_attn's causal), so query ``i`` of a document with ``lq`` queries and ``lk`` keys sits
    at its key ``i + lk - lq``."""

    doc_q: torch.Tensor
    doc_k: torch.Tensor
    pos_q: torch.Tensor
    pos_k: torch.Tensor
    diag: torch.Tensor


def token_tensors(offsets: Offsets, rows: int = 0) -> tuple[TokenTensors, torch.Tensor,
                                                           torch.Tensor]:
    """(the ``TokenTensors`` of ``offsets``, then for query rows ``0..rows-1`` (table building)
    their documents (-1 past the total) and diagonals)."""
    q_len = padded_length(offsets.total_q)
    q_docs, q_pos = _documents(offsets.cu_q, offsets.total_q, max(q_len, rows), PAD_DOC_Q)
    k_docs, k_pos = _documents(offsets.cu_k, offsets.total_k, padded_length(offsets.total_k),
                               PAD_DOC_K)
    # q + (end_k - end_q) of its document: the key at the query's place, ends aligned
    shift = (offsets.cu_k[1:] - offsets.cu_q[1:])[q_docs.clamp(min=0).long()]
    diag = torch.arange(q_docs.numel(), device=offsets.device, dtype=torch.int32) + shift
    tensors = TokenTensors(q_docs[:q_len], k_docs, q_pos[:q_len], k_pos, diag[:q_len])
    return tensors, q_docs[:rows], diag[:rows]


def _documents(cu: torch.Tensor, total: int, length: int, pad: int):
    """(int32 document of positions 0..length-1 (``pad`` past ``total``), int32 position
    inside it (0 past ``total``))."""
    positions = torch.arange(length, device=cu.device, dtype=torch.int32)
    docs = torch.searchsorted(cu[1:], positions, right=True).to(torch.int32)
    inside = positions < total
    starts = cu[docs.clamp(max=cu.numel() - 2).long()]
    return (torch.where(inside, docs, pad), torch.where(inside, positions - starts, 0))
