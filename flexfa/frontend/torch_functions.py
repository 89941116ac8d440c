"""The torch functions and tensor methods a mod may call, as handlers over proxies.

Importing this module registers every handler in ``names.TORCH_FUNCTIONS`` (the activations
and rounding functions built from IR ops come from activations.py); the error for anything
else lists ``supported_functions()``, or says that a reduction has nothing to reduce.
"""
from __future__ import annotations

import functools
import math
import numbers

import torch

from . import activations, ir
from .ir import DType, Op
from .proxy import (CAST_METHODS, DUNDERS, SETITEM_MESSAGE, TORCH_FUNCTIONS, Proxy, binary_op,
                    convert, find_tracer, index_buffer, lift, lift_pair, narrow_storage,
                    reduction_error, result, shift_op, unary_op)


def _check_numbers_fit(tracer, name: str, operands, floats: bool = False) -> None:
    """torch.where and torch.clamp convert a Python int beside a narrow int value (int8,
    uint8, int16, int32) to that type and raise where it does not fit ("value cannot be
    converted to type int8_t without overflow"); the kernels would wrap it (300 as 44).
    With ``floats`` (torch.clamp) a finite number past a float value's range (float16,
    bfloat16, float32: 1e5, 1e39) raises too, as in torch's eager mods (torch.where rounds
    it to inf instead)."""
    storage = narrow_storage(operands, DType.INT)
    kind, infinite = numbers.Integral, ""
    if storage is not None:
        info = torch.iinfo(storage)
        low, high = (-info.max if info.min == 0 else info.min), info.max  # (c10: uint8 -255..)
    elif floats and (kinds := [v.dtype for v in operands if isinstance(v, (Proxy, torch.Tensor))
                               and v.dtype.is_floating_point]):
        storage = functools.reduce(torch.promote_types, kinds)
        kind, high, infinite = numbers.Real, torch.finfo(storage).max, " or +-inf"
        low = -high
    else:
        return
    for value in operands:
        if isinstance(value, kind) and not isinstance(value, bool) and not low <= value <= high \
                and (isinstance(value, numbers.Integral) or math.isfinite(value)):
            raise tracer.error(
                f"torch.{name} of the number {value} beside a {storage} value: torch raises "
                f"\"value cannot be converted to type {storage} without overflow\"; widen the "
                "value first (e.g. .int(), .long() or .float()) or use a bound within "
                f"{low:g}..{high:g}{infinite}")


def _where(cond, a, b):
    tracer = find_tracer(cond, a, b)
    _check_numbers_fit(tracer, "where", (a, b))
    c = lift(cond, tracer)
    if c.dtype is not DType.BOOL:
        raise tracer.error(f"torch.where needs a bool condition, got {c.dtype.value}")
    return result(tracer, ir.where(c, lift(a, tracer), lift(b, tracer)), (a, b),
                  lambda nodes: ir.where(c, *nodes))


def _clamp(x, min=None, max=None):
    """torch.clamp: the value of min(max(x, min), max); the gradient goes to x where
    min <= x <= max (bounds included) and to a tensor bound where x is beyond it."""
    tracer = find_tracer(x, min, max)
    if min is None and max is None:
        raise tracer.error("torch.clamp needs min or max (both are None), as in torch")
    sides = [op for op, bound in ((Op.MAX, min), (Op.MIN, max)) if bound is not None]
    operands = [x] + [bound for bound in (min, max) if bound is not None]
    _check_numbers_fit(tracer, "clamp", operands, floats=True)

    def build(nodes):
        value, *bounds = nodes
        node = value
        for op, bound in zip(sides, bounds):
            node = ir.extremum(op, node, bound, ir.TIES_CLAMP)
        if len(bounds) == 2 and any(b.op is not Op.CONST for b in bounds):
            # torch gives neither bound a gradient where they are equal and x is below them.
            # Nested wheres, not one on an AND: under the Triton interpreter a tile's & with a
            # comparison of float scalars (bounds read per head, lo[h] == hi[h]) fails
            low, high = bounds
            stuck = ir.where(ir.binary(Op.EQ, low, high), ir.unary(Op.DETACH, node), node)
            node = ir.where(ir.binary(Op.LT, value, low), stuck, node)
        return node
    # a number bound beside a narrow int is converted to its type first, as torch converts it
    # (uint8: max=-255 is 1)
    nodes = [lift(x, tracer)] + [lift_pair(tracer, x, bound)[1] for bound in operands[1:]]
    return result(tracer, build(nodes), operands, build)


def _max_or_min(op: Op, name: str):
    """torch.max / torch.min: elementwise with a second value, a reduction otherwise (no
    second argument, or an int, which torch reads as a dimension)."""
    def apply(input, other=None, *args, **kwargs):
        if other is None and not args and not kwargs:
            how = "one argument"
        elif args or kwargs or isinstance(other, numbers.Integral):
            how = "a dimension"
        else:
            return binary_op(op)(input, other)
        raise reduction_error(find_tracer(input, other), f"torch.{name} with {how}")
    return apply


def _full_like(x, fill_value, *, dtype=None, **kwargs):
    tracer = find_tracer(x, fill_value)
    return convert(tracer, lift(fill_value, tracer), dtype or x.dtype)


def _add(sign: int):
    """torch.add / torch.sub with ``alpha``: input + alpha * other (input - alpha * other)."""
    def apply(input, other, *, alpha=1):
        op = Op.ADD if sign > 0 else Op.SUB
        if alpha == 1:
            return binary_op(op)(input, other)
        if isinstance(other, numbers.Number):
            return binary_op(op)(input, other * alpha)
        return binary_op(op)(input, binary_op(Op.MUL)(other, alpha))
    return apply


def _div(input, other, *, rounding_mode=None):
    """torch.div: true division, or with rounding_mode "floor" (``//``) or "trunc"."""
    if rounding_mode is None:
        return binary_op(Op.DIV)(input, other)
    if rounding_mode == "floor":
        return binary_op(Op.FLOORDIV)(input, other)
    if rounding_mode != "trunc":
        raise find_tracer(input, other).error(
            f"torch.div rounding_mode must be None, 'floor' or 'trunc', got {rounding_mode!r}")
    tracer = find_tracer(input, other)
    a, b = lift(input, tracer), lift(other, tracer)
    if ir.promote(a.dtype, b.dtype) is DType.FLOAT:
        node = activations.truncate(ir.binary(Op.DIV, a, b))
    else:  # floor, plus one where the exact quotient was negative and not whole
        floor = ir.binary(Op.FLOORDIV, a, b)
        inexact = ir.binary(Op.NE, ir.binary(Op.MOD, a, b), ir.const(0))
        negative = ir.binary(Op.NE, ir.binary(Op.LT, a, ir.const(0)),
                             ir.binary(Op.LT, b, ir.const(0)))
        node = ir.where(ir.binary(Op.AND, inexact, negative),
                        ir.binary(Op.ADD, floor, ir.const(1)), floor)
    return result(tracer, node, (input, other))


def _logical(op: Op):
    """torch.logical_and / _or / _xor: on the operands' truth values (``.bool()``: nonzero,
    NaN is true), a bool (not bitwise on ints: logical_and(2, 1) is True)."""
    def apply(input, other):
        tracer = find_tracer(input, other)
        a, b = (convert(tracer, lift(v, tracer), torch.bool).node for v in (input, other))
        return Proxy(ir.binary(op, a, b), tracer)
    return apply


def _logical_not(input):
    """torch.logical_not: True where the operand is zero (not ~ on ints: logical_not(2) is
    False)."""
    tracer = find_tracer(input)
    return Proxy(ir.unary(Op.NOT, convert(tracer, lift(input, tracer), torch.bool).node), tracer)


def _detach(x):
    """The value without its gradient (straight-through tricks: x + (f(x) - x).detach())."""
    return Proxy(ir.unary(Op.DETACH, x.node), x.tracer, x.storage)


def _getitem(tensor, index):
    tracer = find_tracer(index)
    if not isinstance(tensor, torch.Tensor):
        raise tracer.error(f"cannot index a {type(tensor).__name__} with a traced value")
    return index_buffer(tracer, tensor, (), index)


def _setitem(tensor, index, value):
    tracer = find_tracer(index, value)
    raise tracer.error(SETITEM_MESSAGE.format(shape=tuple(tensor.shape)))


def _cast_method(name):
    def apply(x, *args, **kwargs):
        return getattr(Proxy, name)(x, *args, **kwargs)
    return apply


def _table() -> dict:
    unary = {
        Op.EXP: ["exp"], Op.EXP2: ["exp2", "special.exp2"], Op.EXPM1: ["expm1", "special.expm1"],
        Op.LOG: ["log"], Op.LOG2: ["log2"], Op.LOG1P: ["log1p", "special.log1p"],
        Op.SQRT: ["sqrt"], Op.RSQRT: ["rsqrt"], Op.TANH: ["tanh", "nn.functional.tanh"],
        Op.SIGMOID: ["sigmoid", "special.expit", "nn.functional.sigmoid"], Op.SIN: ["sin"],
        Op.COS: ["cos"], Op.TAN: ["tan"], Op.ERF: ["erf", "special.erf"], Op.FLOOR: ["floor"],
        Op.CEIL: ["ceil"], Op.ABS: ["abs", "absolute"], Op.SIGN: ["sign"],
        Op.NEG: ["neg", "negative"], Op.NOT: ["bitwise_not"],
    }
    binary = {
        Op.MUL: ["mul", "multiply"], Op.DIV: ["true_divide"], Op.FLOORDIV: ["floor_divide"],
        Op.MOD: ["remainder"], Op.FMOD: ["fmod"], Op.POW: ["pow"], Op.MAX: ["maximum"],
        Op.MIN: ["minimum"], Op.LT: ["lt", "less"], Op.LE: ["le", "less_equal"],
        Op.EQ: ["eq"], Op.NE: ["ne", "not_equal"], Op.AND: ["bitwise_and"],
        Op.OR: ["bitwise_or"], Op.XOR: ["bitwise_xor"],
    }
    table = {}

    def add(name, handler):
        """Register torch.<name> (a dotted name reaches into torch.special / nn.functional)
        and, for a plain name, the tensor method of that name."""
        obj = torch
        for part in name.split("."):
            obj = getattr(obj, part, None)
        if obj is not None:
            table[obj] = handler
        method = getattr(torch.Tensor, name, None) if "." not in name else None
        if method is not None:
            table[method] = handler

    for op, names in unary.items():
        for name in names:
            add(name, unary_op(op))
    for op, names in binary.items():
        for name in names:
            add(name, binary_op(op))
    for name, op in (("gt", Op.LT), ("greater", Op.LT), ("ge", Op.LE), ("greater_equal", Op.LE)):
        add(name, binary_op(op, swap=True))
    for op, name in ((Op.AND, "logical_and"), (Op.OR, "logical_or"), (Op.XOR, "logical_xor")):
        add(name, _logical(op))
    add("logical_not", _logical_not)
    add("bitwise_left_shift", shift_op(left=True))
    add("bitwise_right_shift", shift_op(left=False))
    for name in ("add", "sub", "subtract"):
        add(name, _add(-1 if name.startswith("sub") else 1))
    for name in ("div", "divide"):
        add(name, _div)
    add("max", _max_or_min(Op.MAX, "max"))
    add("min", _max_or_min(Op.MIN, "min"))
    add("where", _where)
    # x.where(condition, y) is torch.where(condition, x, y): the method's first argument is
    # the value (registered with torch.where's handler, x was read as the condition)
    table[torch.Tensor.where] = lambda self, condition, other: _where(condition, self, other)
    add("clamp", _clamp)
    add("clip", _clamp)
    add("clamp_min", lambda x, min: _clamp(x, min=min))
    add("clamp_max", lambda x, max: _clamp(x, max=max))
    add("zeros_like", lambda x, **kw: _full_like(x, 0, **kw))
    add("ones_like", lambda x, **kw: _full_like(x, 1, **kw))
    add("full_like", _full_like)
    add("square", lambda x: binary_op(Op.MUL)(x, x))
    add("detach", _detach)
    for name, handler in activations.HANDLERS.items():
        add(name, handler)
    for name in (*CAST_METHODS, "to", "type"):
        table[getattr(torch.Tensor, name)] = _cast_method(name)
    table[torch.Tensor.__getitem__] = _getitem
    table[torch.Tensor.__setitem__] = _setitem
    for dunder, handler in DUNDERS.items():
        method = getattr(torch.Tensor, dunder, None)
        if method is not None:
            table[method] = handler
    return table



TORCH_FUNCTIONS.update(_table())
