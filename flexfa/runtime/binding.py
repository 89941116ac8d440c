"""Kernel arguments by name: each kernel's positional parameters come from its one description
(``flexfa.codegen.params``); a plan fixes what its key fixes, a call fills in the rest.

A ``Binder`` is made per plan step from the kernel's parameter names and the values the plan
fixes (strides, block-mask tables, lengths, the captured tensors' strides and sizes); ``bind``
puts a call's values (q, k, v, outputs, scale, the captured tensors themselves) in place.
No family keeps an argument order of its own.
"""
from __future__ import annotations

import functools

from ..codegen.forward import mod_buffer_args
from ..codegen.params import table_names
from ..codegen.render import buffer_args as buffer_arg_names
from .dropout import kernel_values as dropout_values
from .tables import table_args

_UNSET = object()


class Binder:
    """The positional arguments of one kernel: ``names`` in order, ``fixed`` placed once."""

    __slots__ = ("names", "template", "slots")

    def __init__(self, names: tuple[str, ...], fixed: dict):
        self.names = names
        self.template = [fixed.get(name, _UNSET) for name in names]
        self.slots = tuple((i, name) for i, name in enumerate(names) if name not in fixed)

    def bind(self, values: dict) -> list:
        """The argument list with ``values`` (every name the plan does not fix) in place."""
        args = self.template.copy()
        for i, name in self.slots:
            args[i] = values[name]
        return args

    def position(self, name: str) -> int:
        """Where ``name`` is in the argument list (to change a bound list in place)."""
        return self.names.index(name)

    def __repr__(self) -> str:
        return f"Binder(per call: {[name for _, name in self.slots]})"


def strides(prefix: str, dims: str, values) -> dict:
    """``stride_<prefix><d>`` for each dimension letter (``params.strides``)."""
    return {f"stride_{prefix}{d}": s for d, s in zip(dims, values, strict=True)}


def tables(table: str, row: str, col: str, block_mask, side: str, device) -> dict:
    """A block mask's tables and strides under the names ``params.block_mask_tables`` gives
    them (``side``: the "kv" tables or the transposed "q" tables; dummies without a mask)."""
    return dict(zip(table_names(table, row, col), table_args(block_mask, side, device),
                    strict=True))


def buffer_layout(score, mask) -> dict:
    """The captured tensors' strides and sizes (fixed by a plan's key)."""
    fixed = {}
    for args, traced in zip(mod_buffer_args(score, mask), (score, mask)):
        for arg, tensor in zip(args, traced.buffers if traced is not None else ()):
            fixed.update(zip(arg.strides, tensor.stride()))
            fixed.update(zip(arg.sizes, tensor.shape))
    return fixed


_POINTER_NAMES: dict[tuple, tuple] = {}  # the mods' keys -> ((name, mod, slot), ...)


def buffer_pointers(score, mask) -> dict:
    """The captured tensors themselves (a call's values), as they are: a launch reads only
    their data (Triton's launcher their pointers, the interpreter their storages), and both
    passes run without grad mode, so a tensor that requires grad needs no detached view (an
    op per tensor in every cached backward). The parameter names depend only on the mods'
    keys (structure, the tensors' shapes and dtypes): found once per pair of keys, so a
    cached call does not render them again."""
    key = (score.key if score is not None else None, mask.key if mask is not None else None)
    names = _POINTER_NAMES.get(key)
    if names is None:
        names = tuple((arg.ptr, which, slot)
                      for which, args in enumerate(mod_buffer_args(score, mask))
                      for slot, arg in enumerate(args))
        if len(_POINTER_NAMES) >= 1024:
            _POINTER_NAMES.clear()
        _POINTER_NAMES[key] = names
    mods = (score, mask)
    return {name: mods[which].buffers[slot] for name, which, slot in names}


def call_values(call) -> dict:
    """A forward call's per-call values besides q, k, v, the outputs and the scale: the
    captured tensors (``buffer_pointers``) and the optional features' (``feature_values``)."""
    score, mask = call.score, call.mask
    values = (buffer_pointers(score, mask) if (score is not None and score.buffers)
              or (mask is not None and mask.buffers) else {})
    if call.sinks is not None or call.dropout is not None:
        values.update(feature_values(call))
    return values


def gradient_strides(grads: dict) -> dict:
    """The score_mod's gradient accumulators' strides by slot (``gbuf<i>_stride*``): a plan
    fixes them (each accumulator is contiguous in its captured tensor's shape)."""
    values = {}
    for slot, grad in grads.items():
        values.update(zip(buffer_arg_names(slot, grad.dim(), "gbuf").strides, grad.stride()))
    return values


def gradient_pointers(grads: dict) -> dict:
    """{the gradient accumulator pointer's parameter name: its tensor} of each slot (a
    call's values)."""
    return {gradient_pointer(slot): grad for slot, grad in grads.items()}


@functools.lru_cache(maxsize=64)
def gradient_pointer(slot: int) -> str:
    """The parameter name of gradient accumulator ``slot``'s pointer (a call's value)."""
    return buffer_arg_names(slot, 0, "gbuf").ptr


def feature_values(call) -> dict:
    """The arguments of a call's optional features (``params.feature_params``): the sinks
    tensor, the dropout seed, threshold and scale; a kernel without them ignores them."""
    values = {}
    if call.sinks is not None:
        values["SINKS"] = call.sinks.detach()
    if call.dropout is not None:
        values.update(dropout_values(call.dropout.p, call.dropout.seed))
    return values
