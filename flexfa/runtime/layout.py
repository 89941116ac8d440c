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
