"""The attention output's memory layout: the query's dimension order, as torch returns it.

torch's flex_attention allocates its output ``[B, Hq, L, Ev]`` with the strides of an
``empty_like(query)``-style layout (``_permute_strides`` in torch's higher-order op, and
``infer_dense_strides`` in its compiled kernels): the dimensions ordered by the query's
strides, outermost first, except that the last dimension is moved innermost (stride 1) when
it would not be. So a query made by ``x.transpose(1, 2)`` of a ``[B, L, H, E]`` tensor gives an
output whose memory is ``[B, L, H, Ev]``, and ``out.transpose(1, 2).reshape(B, L, H * Ev)`` is
a view, without a copy.
"""
from __future__ import annotations

import torch

from ..errors import InputError


def fill_order(strides) -> list[int]:
    """The dimensions from innermost to outermost by stride; equal strides keep the later
    dimension inner, as torch's ``argsort`` of strides does (a contiguous tensor with size-1
    dimensions keeps its own order)."""
    outermost_first = sorted(range(len(strides)), key=strides.__getitem__, reverse=True)
    return outermost_first[::-1]


def dense_strides(shape, order) -> list[int]:
    """Contiguous strides of ``shape`` filling dimensions in ``order`` (innermost first)."""
    strides, step = [0] * len(shape), 1
    for dim in order:
        strides[dim] = step
        step *= shape[dim]
    return strides


def output_strides(shape, query_strides) -> list[int]:
    """torch's strides for an attention output of ``shape`` whose query has ``query_strides``
    (both 4-D): the query's fill order, then the last dimension moved innermost if its stride
    is not 1."""
    order = fill_order(query_strides)
    strides = dense_strides(shape, order)
    if strides[-1] != 1:
        last = len(shape) - 1
        strides = dense_strides(shape, [last] + [d for d in order if d != last])
    return strides


_STRIDES: dict[tuple, list[int]] = {}  # (shape, query strides) -> output strides (ints only)


def output_like(query: torch.Tensor, head_dim_v: int, dtype: torch.dtype | None = None,
                device: torch.device | None = None) -> torch.Tensor:
    """An empty attention output ``[B, Hq, L, head_dim_v]`` laid out as torch lays it out for
    ``query`` (see the module docstring), in ``dtype`` (default: the query's) on ``device``
    (default: the query's). Dense (no gaps or overlaps) and its last dimension has stride 1;
    a contiguous query gives a contiguous output."""
    shape = (*query.shape[:-1], head_dim_v)
    key = (shape, query.stride())
    try:
        strides = _STRIDES.get(key)
    except TypeError:  # symbolic sizes (fake tensors under torch.compile): not memoized
        key = strides = None
    if strides is None:  # the stride sort once per layout: a cached call allocates only
        strides = output_strides(shape, query.stride())
        if key is not None:
            if len(_STRIDES) >= 1024:
                _STRIDES.clear()
            _STRIDES[key] = strides
    return torch.empty_strided(shape, strides,
                               dtype=query.dtype if dtype is None else dtype,
                               device=query.device if device is None else device)


# the kernels add a head's base offset in int64 (``flexfa_head_base``) but its rows' and
# columns' offsets (row * row stride + column * column stride) in int32
HEAD_OFFSET_LIMIT = 2 ** 31


def _head_fits(rows: int, cols: int, row_stride: int, col_stride: int) -> bool:
    return rows * abs(row_stride) + cols * abs(col_stride) < HEAD_OFFSET_LIMIT


def _check_rows(what: str, rows: int, cols: int) -> None:
    if rows * cols >= HEAD_OFFSET_LIMIT:
        raise InputError(f"{what} has {rows} rows of {cols} per head: {rows * cols} elements, "
                         f"past the kernels' int32 offsets inside a head (at most "
                         f"{HEAD_OFFSET_LIMIT - 1})")


def memory_values(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """``tensor`` as a tensor whose memory holds its values, for what the kernels read through
    data pointers: a lazily negated view (the negative bit: its memory holds the negations)
    resolved, an efficient zero tensor (autograd's zero gradient, which has no memory) made
    real zeros; else ``tensor`` itself. For what autograd hands a backward, which the
    forward's checks never saw: the incoming gradients (a loss through ``.conj()`` hands
    negated views) and what saved-tensor hooks unpacked."""
    if tensor is None:
        return None
    if tensor._is_zerotensor():
        return torch.zeros(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    return tensor.resolve_neg() if tensor.is_neg() else tensor


def int32_addressable(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """``tensor`` [B, H, n, D], or a contiguous copy of it where an offset inside one head
    would pass int32 (an int32 product wraps: the kernels would read or write elsewhere).
    Only a layout whose rows lie far apart does: a [B, L, H, E] tensor seen as [B, H, L, E]
    (rows H * E apart) at L * H * E >= 2**31, e.g. L = 512Ki, H = 32, E = 128. The copy's
    rows are D apart; where even they pass int32 (n * D >= 2**31), an InputError names
    ``what``."""
    if tensor.untyped_storage().nbytes() < HEAD_OFFSET_LIMIT:  # (the common case, fast)
        return tensor  # its elements lie within fewer than 2**31 elements of each other
    n, d = tensor.shape[2], tensor.shape[3]
    if _head_fits(n, d, tensor.stride(2), tensor.stride(3)):
        return tensor
    _check_rows(what, n, d)
    return tensor.contiguous()


def int32_addressable_inputs(q, k, v) -> tuple | None:
    """(q, k, v) with ``int32_addressable`` copies, the query copied too where the output
    laid out as its own (``output_like``) would pass int32 inside a head (then the output is
    contiguous); None where every offset fits already (the common case, told apart by the
    sizes of the tensors' storages and of the output alone)."""
    B, H, L, _ = q.shape
    Ev = v.shape[3]
    limit = HEAD_OFFSET_LIMIT
    if (q.untyped_storage().nbytes() < limit and k.untyped_storage().nbytes() < limit
            and v.untyped_storage().nbytes() < limit and B * H * L * Ev < limit):
        return None  # (``int32_addressable``'s fast test of each, and the output's size)
    narrow = [int32_addressable(t, name) for t, name in ((q, "query"), (k, "key"), (v, "value"))]
    if B * H * L * Ev >= limit:  # (else every offset in the output fits)
        strides = output_strides((B, H, L, Ev), narrow[0].stride())
        if not _head_fits(L, Ev, strides[2], strides[3]):
            _check_rows("the output", L, Ev)
            narrow[0] = narrow[0].contiguous()
    return None if all(a is b for a, b in zip(narrow, (q, k, v))) else tuple(narrow)
