"""Proxies: the stand-in values a mod is called with while it is traced.

Every Python operator on a ``Proxy`` funnels into ``ir.binary``, ``ir.unary``, ``ir.where`` or
``ir.cast``; torch functions reach the handlers registered in ``TORCH_FUNCTIONS`` (filled by
torch_functions.py) through ``__torch_function__``; captured tensors indexed with traced values
become ``LOAD`` nodes whose ``arg`` is a buffer slot, so the IR never depends on their values.
"""
from __future__ import annotations

import functools
import numbers

import torch

from ..errors import TraceError, UnsupportedOpError
from . import ir
from .ir import DType, Node, Op

# torch function or method -> handler taking the same arguments; see torch_functions.py
TORCH_FUNCTIONS: dict = {}

_SETITEM_MESSAGE = ("assignment into the captured tensor of shape {shape} is not allowed in a "
                    "mod: mods must be pure; compute a new value instead (e.g. torch.where)")


class _Tracer:
    """State of one trace: the mod's name and the captured tensors seen so far."""

    def __init__(self, name: str):
        self.name = name
        self.buffers: list[torch.Tensor] = []
        self._slots: dict[int, int] = {}

    def slot(self, tensor: torch.Tensor) -> int:
        slot = self._slots.get(id(tensor))
        if slot is None:
            slot = self._slots[id(tensor)] = len(self.buffers)
            self.buffers.append(tensor)
        return slot

    def error(self, message: str, cls=TraceError) -> TraceError:
        return cls(f"in mod {self.name!r}: {message}")


_FLOAT_TORCH = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _buffer_dtype(tracer: _Tracer, tensor: torch.Tensor) -> DType:
    if tensor.dtype is torch.bool:
        return DType.BOOL
    if tensor.dtype in _FLOAT_TORCH:
        return DType.FLOAT
    if not tensor.dtype.is_floating_point and not tensor.dtype.is_complex:
        return DType.INT
    raise tracer.error(f"captured tensor of dtype {tensor.dtype} is not supported "
                       "(use bool, an integer type, float16, bfloat16, float32 or float64)")


class Proxy:
    """A traced scalar value. Python control flow on it is an error: use torch.where."""

    __slots__ = ("node", "tracer")

    def __init__(self, node: Node, tracer: _Tracer):
        self.node = node
        self.tracer = tracer

    def __repr__(self):
        return f"Proxy({self.node.op.name}, {self.node.dtype.value})"

    # -- conversions that would need a concrete value
    def __bool__(self):
        raise self.tracer.error(
            "Python control flow on a traced value (if/while, and/or/not, bool(), builtin "
            "max/min) is not supported: the value is not known while tracing; use "
            "torch.where(cond, a, b), torch.maximum/minimum or the operators & | ~")

    def _no_concrete(self, what):
        raise self.tracer.error(
            f"{what} needs a concrete number, which a mod does not have while being traced; "
            "use .int()/.float() for casts, torch.exp etc. instead of math.exp, and "
            "torch.where instead of branches")

    def __int__(self):
        self._no_concrete("int() of a traced value")

    def __float__(self):
        self._no_concrete("float() of a traced value")

    def __index__(self):
        self._no_concrete("using a traced value as a Python index (range(), slices, lists)")

    def __len__(self):
        self._no_concrete("len() of a traced value")

    def __iter__(self):
        self._no_concrete("iterating over a traced value")

    # -- casts
    def float(self):
        return _wrap(ir.cast(self.node, DType.FLOAT), self.tracer)

    double = half = bfloat16 = float

    def int(self):
        # from float this truncates toward zero, like torch
        return _wrap(ir.cast(self.node, DType.INT), self.tracer)

    long = int

    def bool(self):
        return _wrap(ir.binary(Op.NE, self.node, ir.const(0)), self.tracer)

    def to(self, *args, **kwargs):
        dtype = kwargs.get("dtype")
        for a in args:
            if isinstance(a, torch.dtype):
                dtype = a
        if dtype is None:
            return self  # .to(device) and friends change nothing for a scalar
        return _wrap(ir.cast(self.node, _ir_dtype(self.tracer, dtype)), self.tracer)

    def type(self, dtype):
        return self.to(dtype)

    # -- what code written for real index tensors asks of them (torch's noop_mask and
    # and_masks call b.new_ones((), dtype=torch.bool, device=b.device))
    shape = torch.Size([])
    ndim = 0
    device = None  # a traced value lives on no device

    def dim(self):
        return 0

    @property
    def dtype(self) -> torch.dtype:
        return _TORCH_DTYPE[self.node.dtype]

    def new_full(self, size, fill_value, *, dtype=None, **kwargs):
        if tuple(size) != ():
            raise self.tracer.error(
                f"new_full/new_ones/new_zeros with size {tuple(size)}: a mod computes one "
                "scalar per (b, h, q_idx, kv_idx); use size ()")
        target = self.node.dtype if dtype is None else _ir_dtype(self.tracer, dtype)
        return _wrap(ir.cast(_lift(fill_value, self.tracer), target), self.tracer)

    def new_ones(self, *size, dtype=None, **kwargs):
        size = kwargs.pop("size", size[0] if len(size) == 1 else size)
        return self.new_full(size, 1, dtype=dtype)

    def new_zeros(self, *size, dtype=None, **kwargs):
        size = kwargs.pop("size", size[0] if len(size) == 1 else size)
        return self.new_full(size, 0, dtype=dtype)

    def new_tensor(self, data, *, dtype=None, **kwargs):
        return self.new_full((), data, dtype=dtype)

    def __getattr__(self, name):
        # only reached when normal lookup fails: tensor methods (score.exp()) go to the same
        # handlers as the torch functions; everything else gets a clear error
        if name.startswith("__") or name in Proxy.__slots__:
            raise AttributeError(name)
        method = getattr(torch.Tensor, name, None)
        handler = TORCH_FUNCTIONS.get(method)
        if handler is not None:
            return functools.partial(handler, self)
        if method is None:
            raise self.tracer.error(f"traced values have no attribute {name!r}")
        raise _unsupported(self.tracer, method)

    @classmethod
    def __torch_function__(cls, func, types_, args=(), kwargs=None):
        return _dispatch(func, args, kwargs)


_TORCH_DTYPE = {DType.BOOL: torch.bool, DType.INT: torch.int32, DType.FLOAT: torch.float32}


def _ir_dtype(tracer: _Tracer, dtype: torch.dtype) -> DType:
    if not isinstance(dtype, torch.dtype):
        raise tracer.error(f"expected a torch.dtype, got {type(dtype).__name__} {dtype!r:.40}")
    if dtype is torch.bool:
        return DType.BOOL
    if dtype in _FLOAT_TORCH:
        return DType.FLOAT
    if not dtype.is_floating_point and not dtype.is_complex:
        return DType.INT
    raise tracer.error(f"cast to {dtype} is not supported")


def _wrap(node: Node, tracer: _Tracer) -> Proxy:
    return Proxy(node, tracer)


def _lift(value, tracer: _Tracer) -> Node:
    """Turn an operand (proxy, Python number, 0-d captured tensor) into a node."""
    if isinstance(value, Proxy):
        return value.node
    if isinstance(value, bool):
        return ir.const(value)
    if isinstance(value, numbers.Integral):
        return ir.const(int(value))
    if isinstance(value, numbers.Real):
        return ir.const(float(value))
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise tracer.error(
                f"a captured tensor of shape {tuple(value.shape)} was used as a value; "
                "index it with traced values (e.g. bias[h, q_idx]) to read one element")
        if value.dim() != 0:
            value_dims = value.dim()
            return _finish_load(tracer, value, tuple(ir.const(0) for _ in range(value_dims)))
        return _finish_load(tracer, value, ())
    if isinstance(value, _BufferView):
        raise tracer.error(
            f"captured tensor of shape {tuple(value.tensor.shape)} indexed with "
            f"{len(value.indices)} indices was used as a value; index every dimension")
    raise tracer.error(f"cannot use a value of type {type(value).__name__} ({value!r:.60}) in a mod",
                       UnsupportedOpError)


def _finish_load(tracer: _Tracer, tensor: torch.Tensor, indices: tuple[Node, ...]) -> Node:
    dtype = _buffer_dtype(tracer, tensor)
    return ir.load(tracer.slot(tensor), indices, dtype)


def _find_tracer(*values) -> _Tracer:
    for v in values:
        if isinstance(v, (Proxy, _BufferView)):
            return v.tracer
        if isinstance(v, (tuple, list)):
            for w in v:
                if isinstance(w, (Proxy, _BufferView)):
                    return w.tracer
    raise AssertionError("no proxy among the operands")


# ---- captured-tensor indexing --------------------------------------------------------------

class _BufferView:
    """A captured tensor indexed along its first dimensions (``table[b]`` before ``[h]``)."""

    __slots__ = ("tensor", "indices", "tracer")

    def __init__(self, tensor, indices, tracer):
        self.tensor, self.indices, self.tracer = tensor, indices, tracer

    def __getitem__(self, index):
        return _index_buffer(self.tracer, self.tensor, self.indices, index)

    def __bool__(self):
        raise self.tracer.error("a partially indexed captured tensor has no truth value")

    def __setitem__(self, index, value):
        raise self.tracer.error(_SETITEM_MESSAGE.format(shape=tuple(self.tensor.shape)))

    @classmethod
    def __torch_function__(cls, func, types_, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__:
            return _dispatch(func, args, kwargs)
        view = next(a for a in args if isinstance(a, _BufferView))
        raise view.tracer.error(
            f"torch function {_func_name(func)} applied to a partially indexed captured "
            f"tensor of shape {tuple(view.tensor.shape)}; index every dimension first",
            UnsupportedOpError)


def _index_buffer(tracer: _Tracer, tensor: torch.Tensor, done: tuple[Node, ...], index):
    items = index if isinstance(index, tuple) else (index,)
    nodes = list(done)
    for item in items:
        if item is None or item is Ellipsis or isinstance(item, slice):
            raise tracer.error(
                f"indexing a captured tensor with {item!r} is not supported; index each "
                "dimension with an integer expression (e.g. bias[h, q_idx - kv_idx])",
                UnsupportedOpError)
        if isinstance(item, torch.Tensor) and item.numel() == 1 and not item.dtype.is_floating_point:
            item = _lift(item, tracer)  # a captured 0-d int tensor used as an index
            item = Proxy(item, tracer)
        if isinstance(item, Proxy):
            if item.node.dtype is DType.FLOAT:
                raise tracer.error(
                    f"a captured tensor of shape {tuple(tensor.shape)} was indexed with a "
                    "float value; indices must be integers (convert with .int() or // )")
            nodes.append(ir.cast(item.node, DType.INT))
        elif isinstance(item, (bool, float)) or not isinstance(item, numbers.Integral):
            raise tracer.error(
                f"a captured tensor of shape {tuple(tensor.shape)} was indexed with "
                f"{type(item).__name__} {item!r:.40}; indices must be integers")
        else:
            nodes.append(ir.const(int(item)))
    if len(nodes) > tensor.dim():
        raise tracer.error(
            f"captured tensor of shape {tuple(tensor.shape)} indexed with {len(nodes)} indices")
    if len(nodes) < tensor.dim():
        return _BufferView(tensor, tuple(nodes), tracer)
    return Proxy(_finish_load(tracer, tensor, tuple(nodes)), tracer)


# ---- operators ----------------------------------------------------------------------------

def _binary(op: Op, swap: bool = False):
    def apply(a, b):
        tracer = _find_tracer(a, b)
        x, y = _lift(a, tracer), _lift(b, tracer)
        if swap:
            x, y = y, x
        if op in (Op.AND, Op.OR, Op.XOR) and DType.FLOAT in (x.dtype, y.dtype):
            raise tracer.error(f"operator {op.name.lower()} needs bool or int operands, got float",
                               UnsupportedOpError)
        return Proxy(ir.binary(op, x, y), tracer)
    return apply


def _unary(op: Op):
    def apply(a):
        tracer = _find_tracer(a)
        x = _lift(a, tracer)
        if op is Op.NEG and x.dtype is DType.BOOL:
            raise tracer.error("unary minus on a bool value; use ~ for logical not")
        if op is Op.NOT and x.dtype is DType.FLOAT:
            raise tracer.error("~ needs a bool or int operand, got float", UnsupportedOpError)
        return Proxy(ir.unary(op, x), tracer)
    return apply


_DUNDERS = {
    "__add__": _binary(Op.ADD), "__radd__": _binary(Op.ADD, swap=True),
    "__sub__": _binary(Op.SUB), "__rsub__": _binary(Op.SUB, swap=True),
    "__mul__": _binary(Op.MUL), "__rmul__": _binary(Op.MUL, swap=True),
    "__truediv__": _binary(Op.DIV), "__rtruediv__": _binary(Op.DIV, swap=True),
    "__floordiv__": _binary(Op.FLOORDIV), "__rfloordiv__": _binary(Op.FLOORDIV, swap=True),
    "__mod__": _binary(Op.MOD), "__rmod__": _binary(Op.MOD, swap=True),
    "__pow__": _binary(Op.POW), "__rpow__": _binary(Op.POW, swap=True),
    "__lt__": _binary(Op.LT), "__le__": _binary(Op.LE),
    "__gt__": _binary(Op.LT, swap=True), "__ge__": _binary(Op.LE, swap=True),
    "__eq__": _binary(Op.EQ), "__ne__": _binary(Op.NE),
    "__and__": _binary(Op.AND), "__rand__": _binary(Op.AND, swap=True),
    "__or__": _binary(Op.OR), "__ror__": _binary(Op.OR, swap=True),
    "__xor__": _binary(Op.XOR), "__rxor__": _binary(Op.XOR, swap=True),
    "__neg__": _unary(Op.NEG), "__abs__": _unary(Op.ABS), "__invert__": _unary(Op.NOT),
    "__pos__": lambda a: a,
}
for _name, _fn in _DUNDERS.items():
    setattr(Proxy, _name, _fn)
Proxy.__hash__ = object.__hash__  # __eq__ is traced, identity hashing stays



# ---- torch functions ----------------------------------------------------------------------

def _dispatch(func, args, kwargs):
    handler = TORCH_FUNCTIONS.get(func)
    if handler is None:
        raise _unsupported(_find_tracer(*args, *(kwargs or {}).values()), func)
    return handler(*args, **(kwargs or {}))


@functools.lru_cache(maxsize=None)
def _public_names() -> dict[int, str]:
    """id(function) -> the public name users write (torch.exp, torch.Tensor.exp, F.relu)."""
    names: dict[int, str] = {}
    spaces = (("torch.nn.functional", torch.nn.functional), ("torch.special", torch.special),
              ("torch.Tensor", torch.Tensor), ("torch", torch))
    for prefix, space in spaces:  # later spaces win: torch.erf over torch.special.erf
        for attr in dir(space):
            if attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__")):
                continue
            obj = getattr(space, attr, None)
            if callable(obj):
                names[id(obj)] = f"{prefix}.{attr}"
    return names


def _func_name(func) -> str:
    public = _public_names().get(id(func))
    if public is not None:
        return public
    module = getattr(func, "__module__", None) or ""
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    if module.startswith("torch") or name.startswith(("_VariableFunctionsClass.", "TensorBase.")):
        return "torch." + name.split(".")[-1]  # torch._C internals print as torch.<name>
    return f"{module}.{name}" if module else name


def supported_functions() -> list[str]:
    """Public names of the torch functions and tensor methods a mod may call."""
    names = {_func_name(f) for f in TORCH_FUNCTIONS}
    names = {n for n in names if "__" not in n}
    # torch.Tensor.exp is listed as torch.exp; methods with no function form stay
    return sorted(n for n in names
                  if not (n.startswith("torch.Tensor.") and "torch." + n[13:] in names))


def _unsupported(tracer: _Tracer, func) -> TraceError:
    name = _func_name(func)
    bare = name.rsplit(".", 1)[-1]
    if (bare.endswith("_") and not bare.startswith("_")) or bare.startswith("__i"):
        return tracer.error(
            f"in-place {name} is not allowed in a mod: mods must be pure, so neither a "
            "captured tensor nor a traced value may be modified; compute a new value instead "
            "(x = x + 1)")
    return tracer.error(
        f"torch function {name} is not supported in mods; supported: "
        + ", ".join(supported_functions()) + "; operators + - * / // % ** < <= == != >= > "
        "& | ^ ~ and abs()", UnsupportedOpError)
