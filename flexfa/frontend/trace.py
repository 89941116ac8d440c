"""Tracing a Python mod into the IR by calling it with proxy values.

Every Python operator and supported torch function on a ``Proxy`` funnels into ``ir.binary``,
``ir.unary``, ``ir.where`` or ``ir.cast``; captured tensors indexed with traced values become
``LOAD`` nodes whose ``arg`` is a buffer slot, so the IR never depends on a buffer's values.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import math
import numbers
import types
import weakref

import torch

from ..errors import TraceError, UnsupportedOpError
from . import ir
from .ir import DType, Node, Op
from .simplify import simplify

SCORE_MOD = "score_mod"
MASK_MOD = "mask_mod"
_ARGS = {SCORE_MOD: ("score", "b", "h", "q_idx", "kv_idx"), MASK_MOD: ("b", "h", "q_idx", "kv_idx")}


@dataclasses.dataclass(frozen=True, eq=False)
class TracedMod:
    """A traced mod: the IR root plus the captured tensors its LOAD nodes read, by slot."""

    kind: str  # SCORE_MOD or MASK_MOD
    root: Node
    buffers: tuple[torch.Tensor, ...]
    name: str

    @functools.cached_property
    def buffer_specs(self) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
        return tuple((tuple(t.shape), t.dtype) for t in self.buffers)

    @functools.cached_property
    def key(self) -> str:
        """Structural cache key: kind, IR and buffer shapes/dtypes, never buffer values."""
        text = f"{self.kind}|{self.root.key}|{self.buffer_specs!r}"
        return hashlib.sha256(text.encode()).hexdigest()

    @property
    def grad_buffers(self) -> tuple[int, ...]:
        """Slots of captured tensors that require grad."""
        return tuple(i for i, t in enumerate(self.buffers) if t.requires_grad)

    def format(self) -> str:
        """The IR listing under a header naming the mod and its captured buffers."""
        lines = [f"{self.kind} {self.name}"]
        lines += [f"buf{i}: {str(t.dtype).replace('torch.', '')}{list(t.shape)}"
                  + (" requires_grad" if t.requires_grad else "")
                  for i, t in enumerate(self.buffers)]
        return "\n".join(lines) + "\n" + ir.format_ir(self.root)

    def __repr__(self) -> str:
        return f"TracedMod({self.kind} {self.name!r}, key={self.key[:12]})"


# ---- the proxy ---------------------------------------------------------------------------

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
        handler = _TORCH_FUNCTIONS.get(method)
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


# ---- operator and torch-function tables ---------------------------------------------------

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


_SETITEM_MESSAGE = ("assignment into the captured tensor of shape {shape} is not allowed in a "
                    "mod: mods must be pure; compute a new value instead (e.g. torch.where)")


def _cast_method(dtype):
    def apply(x, *args, **kwargs):
        return Proxy.to(x, dtype) if isinstance(x, Proxy) else x
    return apply


def _torch_functions() -> dict:
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


_TORCH_FUNCTIONS = _torch_functions()


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
    names = {_func_name(f) for f in _TORCH_FUNCTIONS}
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


def _dispatch(func, args, kwargs):
    handler = _TORCH_FUNCTIONS.get(func)
    if handler is None:
        raise _unsupported(_find_tracer(*args, *(kwargs or {}).values()), func)
    return handler(*args, **(kwargs or {}))


# ---- trace entry point and cache ----------------------------------------------------------

def mod_kind(fn) -> str:
    """score_mod (5 positional args) or mask_mod (4), from the signature."""
    if not callable(fn):
        raise TraceError(f"a mod must be callable, got {type(fn).__name__} {fn!r:.60}")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise TraceError(f"cannot read the signature of mod {_name(fn)!r}: {exc}") from None
    params = list(sig.parameters.values())
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        raise TraceError(f"mod {_name(fn)!r} takes *args; write score_mod(score, b, h, q_idx, "
                         "kv_idx) or mask_mod(b, h, q_idx, kv_idx) with named parameters")
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                  and p.default is p.empty]
    count = len(positional)
    if count == 5:
        return SCORE_MOD
    if count == 4:
        return MASK_MOD
    raise TraceError(
        f"mod {_name(fn)!r} takes {count} required positional arguments; a score_mod takes 5 "
        "(score, b, h, q_idx, kv_idx) and a mask_mod takes 4 (b, h, q_idx, kv_idx)")


def _name(fn) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _captured_tensors(fn, depth=0):
    """Tensors reachable from the mod's closure and referenced globals (for in-place checks)."""
    found = []
    for value in _referenced_values(fn):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, types.FunctionType) and depth < 4:
            found.extend(_captured_tensors(value, depth + 1))
    return found


def _referenced_values(fn):
    fn = inspect.unwrap(fn) if isinstance(fn, types.FunctionType) else fn
    if isinstance(fn, functools.partial):
        yield fn.func
        yield from fn.args
        yield from fn.keywords.values()
        return
    code = getattr(fn, "__code__", None)
    if code is None:
        return
    for cell in fn.__closure__ or ():
        try:
            yield cell.cell_contents
        except ValueError:  # empty cell
            continue
    globals_ = getattr(fn, "__globals__", {})
    for name in code.co_names:
        if name in globals_:
            yield globals_[name]
    yield from fn.__defaults__ or ()


def trace(fn, kind: str | None = None) -> TracedMod:
    """Trace ``fn`` into a ``TracedMod``. ``kind`` defaults to what the arity says.

    Traces are cached by function identity plus a fingerprint of what the function can see
    (closure cells, referenced globals), so calling this per step costs microseconds."""
    if kind not in (None, SCORE_MOD, MASK_MOD):
        raise TraceError(f"kind must be {SCORE_MOD!r}, {MASK_MOD!r} or None, got {kind!r}")
    fingerprint = _fingerprint(fn)
    if fingerprint is not None:
        cached = _cache_get(fn)
        if cached is not None and cached[0] == fingerprint and kind in (None, cached[1].kind):
            return cached[1]
    expected = mod_kind(fn)
    kind = kind or expected
    if kind != expected:
        raise TraceError(f"expected a {kind} but {_name(fn)!r} has the arity of a {expected}")
    traced = _trace_uncached(fn, kind)
    if fingerprint is not None:
        try:
            _CACHE[fn] = (fingerprint, traced)
        except TypeError:  # not weak-referenceable
            pass
    return traced


def _cache_get(fn):
    try:
        return _CACHE.get(fn)
    except TypeError:  # not weak-referenceable: never cached
        return None


def _trace_uncached(fn, kind: str) -> TracedMod:
    name = _name(fn)
    tracer = _Tracer(name)
    leaves = {"score": ir.score(), "b": ir.index(Op.B), "h": ir.index(Op.H),
              "q_idx": ir.index(Op.Q_IDX), "kv_idx": ir.index(Op.KV_IDX)}
    args = [Proxy(leaves[a], tracer) for a in _ARGS[kind]]
    watched = _captured_tensors(fn)
    versions = [t._version for t in watched]
    try:
        result = fn(*args)
    except (TraceError, RecursionError):
        raise
    except Exception as exc:
        raise TraceError(f"in mod {name!r}: tracing raised {type(exc).__name__}: {exc}") from exc
    for tensor, version in zip(watched, versions):
        if tensor._version != version:
            raise tracer.error(
                f"the mod modified the captured tensor of shape {tuple(tensor.shape)} in place "
                "(e.g. bias.add_(1) or bias[0] = 0); mods must be pure")
    root = simplify(_result_node(tracer, result, kind))
    root, buffers = _drop_unused_buffers(root, tuple(tracer.buffers))
    return TracedMod(kind, root, buffers, name)


def _drop_unused_buffers(root: Node, buffers: tuple) -> tuple[Node, tuple]:
    """Renumber LOAD slots after simplification removed reads (``0 * bias[q_idx]``)."""
    used = sorted({n.arg for n in root.toposort() if n.op is Op.LOAD})
    if len(used) == len(buffers):
        return root, buffers
    new_slot = {old: new for new, old in enumerate(used)}
    root = ir.rewrite(root, lambda n: ir.load(new_slot[n.arg], n.src, n.dtype)
                      if n.op is Op.LOAD else n)
    return root, tuple(buffers[i] for i in used)


def _result_node(tracer: _Tracer, result, kind: str) -> Node:
    if result is None:
        raise tracer.error("the mod returned None; a score_mod returns the new score, a "
                           "mask_mod returns a bool")
    if isinstance(result, (Proxy, bool, numbers.Real, torch.Tensor, _BufferView)):
        node = _lift(result, tracer)
    else:
        raise tracer.error(f"the mod returned a {type(result).__name__}; expected a traced value")
    if kind == MASK_MOD:
        if node.dtype is not DType.BOOL:
            raise tracer.error(f"a mask_mod must return bool (True = keep), got {node.dtype.value}")
        return node
    return ir.cast(node, DType.FLOAT)


# Cache by function identity plus a fingerprint of everything the function can see that
# would change its trace: closure cells and referenced globals (scalars by value, tensors by
# identity and shape, nested functions recursively). Anything unfingerprintable disables the
# cache for that function, so a stale trace is never returned.
_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _fingerprint(fn, depth=0):
    if depth > 4:
        return None
    parts = []
    code = getattr(fn, "__code__", None)
    if code is None and not isinstance(fn, functools.partial):
        return None
    parts.append(id(code))
    for value in _referenced_values(fn):
        fp = _value_fingerprint(value, depth)
        if fp is None:
            return None
        parts.append(fp)
    return tuple(parts)


def _value_fingerprint(value, depth):
    if value is None or isinstance(value, (bool, int, float, str, complex)):
        return (type(value), value if not (isinstance(value, float) and math.isnan(value)) else "nan")
    if isinstance(value, torch.Tensor):
        return ("t", id(value), tuple(value.shape), value.dtype, value.requires_grad)
    if isinstance(value, (types.ModuleType, type, torch.dtype, types.BuiltinFunctionType)):
        return ("id", id(value))
    if isinstance(value, (types.FunctionType, functools.partial)):
        inner = _fingerprint(value, depth + 1)
        return None if inner is None else ("fn", id(value), inner)
    if isinstance(value, tuple):
        items = [_value_fingerprint(v, depth) for v in value]
        return None if any(i is None for i in items) else ("tuple",) + tuple(items)
    if callable(value) and getattr(value, "__module__", "").startswith(("torch", "math", "flexfa")):
        return ("id", id(value))
    return None
