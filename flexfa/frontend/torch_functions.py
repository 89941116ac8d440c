"""The torch functions and tensor methods a mod may call, as handlers over proxies.

Importing this module registers every handler in ``proxy.TORCH_FUNCTIONS``; the error for
anything else lists ``supported_functions()``.
"""
from __future__ import annotations

import torch

from . import ir
from .ir import DType, Op
from .proxy import (_DUNDERS, _SETITEM_MESSAGE, TORCH_FUNCTIONS, Proxy, _binary, _find_tracer,
                    _index_buffer, _ir_dtype, _lift, _unary)


def _where(cond, a, b):
    tracer = _find_tracer(cond, a, b)
    c = _lift(cond, tracer)
    if c.dtype is not DType.BOOL:
        raise tracer.error(f"torch.where needs a bool condition, got {c.dtype.value}")
    return Proxy(ir.where(c, _lift(a, tracer), _lift(b, tracer)), tracer)


def _clamp(x, min=None, max=None):
    out = x
    if min is not None:
        out = _binary(Op.MAX)(out, min)
    if max is not None:
        out = _binary(Op.MIN)(out, max)
    return out


def _relu(x, inplace=False):
    return _binary(Op.MAX)(x, 0.0 if _lift(x, _find_tracer(x)).dtype is DType.FLOAT else 0)


def _full_like(x, fill_value, **kwargs):
    tracer = _find_tracer(x)
    node = ir.const(fill_value)
    dtype = kwargs.get("dtype")
    target = _ir_dtype(tracer, dtype) if dtype is not None else _lift(x, tracer).dtype
    return Proxy(ir.cast(node, target), tracer)


def _getitem(tensor, index):
    tracer = _find_tracer(index)
    if not isinstance(tensor, torch.Tensor):
        raise tracer.error(f"cannot index a {type(tensor).__name__} with a traced value")
    return _index_buffer(tracer, tensor, (), index)


def _setitem(tensor, index, value):
    tracer = _find_tracer(index, value)
    raise tracer.error(_SETITEM_MESSAGE.format(shape=tuple(tensor.shape)))


def _cast_method(dtype):
    def apply(x, *args, **kwargs):
        return Proxy.to(x, dtype) if isinstance(x, Proxy) else x
    return apply


def _table() -> dict:
    F = torch.nn.functional
    unary = {
        Op.EXP: ["exp"], Op.EXP2: ["exp2", "special.exp2"], Op.LOG: ["log"],
        Op.LOG2: ["log2"], Op.SQRT: ["sqrt"], Op.RSQRT: ["rsqrt"], Op.TANH: ["tanh"],
        Op.SIGMOID: ["sigmoid", "special.expit"], Op.SIN: ["sin"], Op.COS: ["cos"],
        Op.TAN: ["tan"], Op.ERF: ["erf", "special.erf"], Op.FLOOR: ["floor"], Op.CEIL: ["ceil"],
        Op.ABS: ["abs", "absolute"], Op.SIGN: ["sign"], Op.NEG: ["neg", "negative"],
        Op.NOT: ["logical_not", "bitwise_not"],
    }
    binary = {
        Op.ADD: ["add"], Op.SUB: ["sub", "subtract"], Op.MUL: ["mul", "multiply"],
        Op.DIV: ["div", "divide", "true_divide"], Op.FLOORDIV: ["floor_divide"],
        Op.MOD: ["remainder"], Op.POW: ["pow"], Op.MAX: ["maximum", "max"],
        Op.MIN: ["minimum", "min"], Op.LT: ["lt", "less"], Op.LE: ["le", "less_equal"],
        Op.EQ: ["eq"], Op.NE: ["ne", "not_equal"], Op.AND: ["logical_and", "bitwise_and"],
        Op.OR: ["logical_or", "bitwise_or"], Op.XOR: ["logical_xor", "bitwise_xor"],
    }
    table = {}

    def add(name, handler):
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
            add(name, _unary(op))
    for op, names in binary.items():
        for name in names:
            add(name, _binary(op))
    for name, op in (("gt", Op.LT), ("greater", Op.LT), ("ge", Op.LE), ("greater_equal", Op.LE)):
        add(name, _binary(op, swap=True))
    add("where", _where)
    add("clamp", _clamp)
    add("clip", _clamp)
    add("zeros_like", lambda x, **kw: _full_like(x, 0, **kw))
    add("ones_like", lambda x, **kw: _full_like(x, 1, **kw))
    add("full_like", _full_like)
    add("relu", _relu)
    add("clamp_min", lambda x, min: _clamp(x, min=min))
    add("clamp_max", lambda x, max: _clamp(x, max=max))
    add("square", lambda x: _binary(Op.MUL)(x, x))
    for name, dtype in (("float", torch.float32), ("double", torch.float64), ("int", torch.int32),
                        ("long", torch.int64), ("bool", torch.bool)):
        table[getattr(torch.Tensor, name)] = _cast_method(dtype)
    for name in ("tanh", "sigmoid"):
        table[getattr(F, name)] = _unary(Op.TANH if name == "tanh" else Op.SIGMOID)
    table[F.relu] = _relu
    table[F.relu6] = lambda x, inplace=False: _clamp(x, 0.0, 6.0)
    table[F.hardtanh] = lambda x, min_val=-1.0, max_val=1.0, inplace=False: _clamp(
        x, min_val, max_val)
    table[torch.Tensor.__getitem__] = _getitem
    table[torch.Tensor.__setitem__] = _setitem
    for dunder, handler in _DUNDERS.items():
        method = getattr(torch.Tensor, dunder, None)
        if method is not None:
            table[method] = handler
    return table


TORCH_FUNCTIONS.update(_table())
