"""Proxies: the stand-in values a mod is called with while it is traced.

Every Python operator on a ``Proxy`` funnels into ``ir.binary``, ``ir.unary``, ``ir.where`` or
``ir.cast``; torch functions reach the handlers registered in ``TORCH_FUNCTIONS`` (filled by
torch_functions.py) through ``__torch_function__``; captured tensors indexed with traced values
become ``LOAD`` nodes whose ``arg`` is a buffer slot, so the IR never depends on their values.

Storage types: a traced value computes as FLOAT (float32) or INT (int64). A cast to a narrower
torch dtype (``.half()``, ``.to(torch.int8)``) rounds or wraps it (``ir.narrow``) and the proxy
remembers that dtype in ``storage``; every later op whose torch result dtype stays narrow
(a float16 value times a Python float, int8 + int8) rounds or wraps again, as torch does.
"""
from __future__ import annotations

import functools
import numbers
import sys

import torch

from ..errors import TraceError, UnsupportedOpError, dims
from . import ir
from .ir import DType, Node, Op
from .names import TORCH_FUNCTIONS, func_name, reduction_error, supported_functions, unsupported

__all__ = ["Proxy", "TORCH_FUNCTIONS", "convert", "reduction_error", "result",
           "supported_functions"]


SETITEM_MESSAGE = ("assignment into the captured tensor of shape {shape} is not allowed in a "
                    "mod: mods must be pure; compute a new value instead (e.g. torch.where)")


# the frame of torch.autograd.Function.apply, which calls a custom Function's forward
_APPLY_CODE = torch.autograd.Function.apply.__func__.__code__


class Tracer:
    """State of one trace: the mod's name and the captured tensors seen so far.

    Created by the function that calls the mod; that frame bounds the stack walk of
    ``check_frames``, and the custom autograd Functions already running when the trace began
    (flexfa called inside a user's Function) are counted so that they never count as the
    mod's."""

    def __init__(self, name: str):
        self.name = name
        self.buffers: list[torch.Tensor] = []
        self._slots: dict[int, int] = {}
        self._entry = sys._getframe(1)
        self._outer_applies = len(_apply_frames(self._entry, None)[0])

    def check_frames(self) -> None:
        """Raise when the mod computes inside a custom autograd Function's forward: its
        backward would be ignored, because gradients are derived from the traced forward."""
        applies, reached_entry = _apply_frames(sys._getframe(2), self._entry)
        if len(applies) > (0 if reached_entry else self._outer_applies):
            cls = applies[0].f_locals.get("cls")
            name = getattr(cls, "__qualname__", "a torch.autograd.Function")
            raise self.error(
                f"the custom autograd Function {name} was called on traced values "
                f"({name}.apply); custom autograd Functions cannot be traced: flexfa derives "
                "the gradient from the traced forward and would never run its backward. Write "
                "the computation in the mod with supported ops, or apply the Function outside "
                "the mod", UnsupportedOpError)

    def slot(self, tensor: torch.Tensor) -> int:
        slot = self._slots.get(id(tensor))
        if slot is None:
            slot = self._slots[id(tensor)] = len(self.buffers)
            self.buffers.append(tensor)
        return slot

    def error(self, message: str, cls=TraceError) -> TraceError:
        return cls(f"in mod {self.name!r}: {message}")


def _apply_frames(frame, stop) -> tuple[list, bool]:
    """The autograd Function.apply frames from ``frame`` up to ``stop`` (excluded), and
    whether ``stop`` was reached."""
    found = []
    while frame is not None:
        if frame is stop:
            return found, True
        if frame.f_code is _APPLY_CODE:
            found.append(frame)
        frame = frame.f_back
    return found, False


_FLOAT_TORCH = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# (uint16, uint32 and uint64 were taken as integers and failed in the code generator with a
# bare KeyError; qint8's dtype is neither float nor complex and failed deep inside)
_INT_TORCH = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


def _buffer_dtype(tracer: Tracer, tensor: torch.Tensor) -> DType:
    if tensor.dtype is torch.bool:
        return DType.BOOL
    if tensor.dtype in _FLOAT_TORCH:
        return DType.FLOAT
    if tensor.dtype in _INT_TORCH and not tensor.is_quantized:
        return DType.INT
    raise tracer.error(f"captured tensor of dtype {tensor.dtype} is not supported (use bool, "
                       "int8, uint8, int16, int32, int64, float16, bfloat16, float32 or "
                       "float64)")


class Proxy:
    """A traced scalar value. Python control flow on it is an error: use torch.where.
    ``storage``: the narrow torch dtype the value is held in (a key of ``_NARROW_NAMES``), or
    None for flexfa's float32 / int64 / bool."""

    __slots__ = ("node", "tracer", "storage")

    def __init__(self, node: Node, tracer: Tracer, storage: torch.dtype | None = None):
        assert storage is None or storage in _NARROW_NAMES, storage
        tracer.check_frames()
        self.node = node
        self.tracer = tracer
        self.storage = storage

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

    # -- casts (.float(), .half(), .int(), ... are set below): each rounds or wraps as torch
    # stores the value (see convert)
    def to(self, *args, dtype=None, **kwargs):
        for a in args:  # .to(dtype), .to(device, dtype), .to(other): the last dtype given
            if isinstance(a, torch.dtype):
                dtype = a
            elif isinstance(a, (Proxy, torch.Tensor)):
                dtype = a.dtype
            elif not (isinstance(a, (torch.device, bool, torch.memory_format))  # non_blocking, copy
                      or (isinstance(a, str) and _is_device(a))):
                # torch refuses these ("float16" is no device string, np.float16 no dtype):
                # ignoring them left the value uncast
                raise self.tracer.error(f".to({a!r}): not a torch.dtype, device or tensor "
                                        "(torch refuses it too); use .to(torch.float16)")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise self.tracer.error(f".to(dtype={dtype!r}): not a torch.dtype (torch refuses "
                                    "it too)")
        if dtype is None:
            return self  # .to(device) and friends change nothing for a scalar
        return convert(self.tracer, self.node, dtype)

    def type(self, dtype=None, **kwargs):
        if dtype is None:
            raise self.tracer.error(".type() without a dtype returns a type name string; a mod "
                                    "computes numbers: use .dtype, or .type(torch.float16)")
        if isinstance(dtype, type):  # torch.FloatTensor, torch.cuda.HalfTensor
            dtype = f"{dtype.__module__}.{dtype.__name__}"
        if isinstance(dtype, str):
            name = dtype
            dtype = _TYPE_NAMES.get(name.replace("torch.cuda.", "torch."))
            if dtype is None:  # torch: "invalid type"
                raise self.tracer.error(f".type({name!r}): not a tensor type name such as "
                                        "'torch.FloatTensor' (torch refuses it too); use "
                                        ".type(torch.float32) or .to(torch.float32)")
        if not isinstance(dtype, torch.dtype):
            raise self.tracer.error(f".type({dtype!r}): not a torch.dtype or tensor type name "
                                    "(torch refuses it too)")
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
        return self.storage or _TORCH_DTYPE[self.node.dtype]

    def new_full(self, size, fill_value, *, dtype=None, **kwargs):
        if tuple(size) != ():
            raise self.tracer.error(
                f"new_full/new_ones/new_zeros with size {tuple(size)}: a mod computes one "
                "scalar per (b, h, q_idx, kv_idx); use size ()")
        return convert(self.tracer, lift(fill_value, self.tracer), dtype or self.dtype)

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
            return lambda *args, **kwargs: _call(handler, method, (self, *args), kwargs)
        if method is None:
            raise self.tracer.error(f"traced values have no attribute {name!r}")
        raise unsupported(self.tracer, method)

    @classmethod
    def __torch_function__(cls, func, types_, args=(), kwargs=None):
        return _dispatch(func, args, kwargs)


# the torch dtype of a traced value without a narrow storage type: what the eager evaluator
# computes in (the kernels compute INT in int32 where it provably fits)
_TORCH_DTYPE = {DType.BOOL: torch.bool, DType.INT: torch.int64, DType.FLOAT: torch.float32}
# casts that change nothing but the dtype: flexfa's FLOAT is float32 (float64 too: kernels
# compute in float32) and its INT int64
_WIDE = {torch.bool: DType.BOOL, torch.int64: DType.INT, torch.float32: DType.FLOAT,
         torch.float64: DType.FLOAT}
_NARROW_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.int8: "int8",
                 torch.uint8: "uint8", torch.int16: "int16", torch.int32: "int32"}
_TYPE_NAMES = {f"torch.{name}Tensor": dtype for name, dtype in (
    ("Float", torch.float32), ("Double", torch.float64), ("Half", torch.float16),
    ("BFloat16", torch.bfloat16), ("Long", torch.int64), ("Int", torch.int32),
    ("Short", torch.int16), ("Char", torch.int8), ("Byte", torch.uint8), ("Bool", torch.bool))}


def convert(tracer: Tracer, node: Node, dtype) -> Proxy:
    """``node`` cast to the torch dtype ``dtype`` as torch does it: float16/bfloat16 round to
    nearest even, int8/uint8/int16/int32 wrap (a float is truncated first, see
    ``evaluate.narrow``), bool is ``!= 0`` (a bool as it is); float32/float64/int64 only
    change the IR dtype."""
    if not isinstance(dtype, torch.dtype):
        raise tracer.error(f"expected a torch.dtype, got {type(dtype).__name__} {dtype!r:.40}")
    if dtype is torch.bool:
        return Proxy(node if node.dtype is DType.BOOL else ir.binary(Op.NE, node, ir.const(0)),
                      tracer)
    if dtype in _WIDE:
        return Proxy(ir.cast(node, _WIDE[dtype]), tracer)
    if dtype in _NARROW_NAMES:
        return Proxy(ir.narrow(node, _NARROW_NAMES[dtype]), tracer, dtype)
    raise tracer.error(
        f"cast to {dtype} is not supported in mods; supported: "
        + ", ".join(str(d).replace("torch.", "") for d in (*_WIDE, *_NARROW_NAMES)),
        UnsupportedOpError)


def result(tracer: Tracer, node: Node, operands, rebuild=None) -> Proxy:
    """The proxy of an op's result ``node`` computed from ``operands`` (proxies, numbers,
    captured tensors), rounded or wrapped where torch's result dtype is narrow.

    torch's promotion treats traced values and captured elements as 0-d tensors, which Python
    numbers never widen (a float16 value * 0.1 stays float16, int8 + 300 wraps in int8) and
    which widen each other only within the result's kind (float16 + float32 is float32). A
    tensor operand of a lower kind is converted to the result's dtype before the op (float16
    + an int 65535 is inf): ``rebuild(nodes)`` makes the op again from such converted nodes."""
    if node.dtype is DType.BOOL:
        return Proxy(_compared_narrow(tracer, node, operands, rebuild), tracer)
    storage = narrow_storage(operands, node.dtype)
    if storage is None:
        return Proxy(node, tracer)
    name = _NARROW_NAMES[storage]
    if rebuild is not None and node.dtype is DType.FLOAT:
        nodes = [lift(v, tracer) for v in operands]
        lower = [isinstance(v, (Proxy, torch.Tensor)) and n.dtype is DType.INT
                 for v, n in zip(operands, nodes)]
        if any(lower):
            node = rebuild([ir.narrow(n, name) if low else n for n, low in zip(nodes, lower)])
    return Proxy(ir.narrow(node, name), tracer, storage)


def _compared_narrow(tracer: Tracer, node: Node, operands, rebuild) -> Node:
    """A comparison ``node`` as torch computes it where a float operand is float16 or
    bfloat16: in that dtype, so an int operand (a tensor or a Python number) and a Python
    float are converted to it first (``(kv_idx + 2049).half() == kv_idx + 2049`` is True,
    2049 being 2048 in float16; compared as float32 it was False)."""
    if rebuild is None or node.op not in _COMPARISONS:
        return node
    floats = [v.dtype for v in operands if isinstance(v, (Proxy, torch.Tensor))
              and _kind(v.dtype) is DType.FLOAT]
    storage = functools.reduce(torch.promote_types, floats) if floats else None
    if storage not in (torch.float16, torch.bfloat16):
        return node
    name = _NARROW_NAMES[storage]
    nodes = [lift(v, tracer) for v in operands]
    lower = [not isinstance(v, (Proxy, torch.Tensor)) or _kind(v.dtype) is not DType.FLOAT
             for v in operands]
    if not any(low and n.dtype is not DType.BOOL for n, low in zip(nodes, lower)):
        return node
    return rebuild([ir.narrow(n, name) if low else n for n, low in zip(nodes, lower)])


_COMPARISONS = (Op.LT, Op.LE, Op.EQ, Op.NE)


def narrow_storage(operands, dtype: DType) -> torch.dtype | None:
    """torch's result dtype for ``operands`` when it is narrower than flexfa's own."""
    if dtype is DType.BOOL:
        return None
    kinds = [v.dtype for v in operands if isinstance(v, (Proxy, torch.Tensor))
             and _kind(v.dtype) is dtype]
    storage = functools.reduce(torch.promote_types, kinds) if kinds else None
    return storage if storage in _NARROW_NAMES else None


def _kind(dtype: torch.dtype) -> DType | None:
    if dtype is torch.bool:
        return DType.BOOL
    if dtype.is_complex:
        return None
    return DType.FLOAT if dtype.is_floating_point else DType.INT


def lift(value, tracer: Tracer) -> Node:
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
                f"a captured tensor of shape {dims(value)} was used as a value; "
                "index it with traced values (e.g. bias[h, q_idx]) to read one element")
        if value.dim() != 0:
            value_dims = value.dim()
            return _finish_load(tracer, value, tuple(ir.const(0) for _ in range(value_dims)))
        return _finish_load(tracer, value, ())
    if isinstance(value, BufferView):
        raise value.row_error("a partially indexed captured tensor was used as a value")
    raise tracer.error(f"cannot use a value of type {type(value).__name__} ({value!r:.60}) in a mod",
                       UnsupportedOpError)


def _finish_load(tracer: Tracer, tensor: torch.Tensor, indices: tuple[Node, ...]) -> Node:
    dtype = _buffer_dtype(tracer, tensor)
    return ir.load(tracer.slot(tensor), indices, dtype)


def find_tracer(*values) -> Tracer:
    for v in values:
        if isinstance(v, (Proxy, BufferView)):
            return v.tracer
        if isinstance(v, (tuple, list)):
            for w in v:
                if isinstance(w, (Proxy, BufferView)):
                    return w.tracer
    raise AssertionError("no proxy among the operands")


# ---- captured-tensor indexing --------------------------------------------------------------

class BufferView:
    """A captured tensor indexed along its first dimensions (``table[b]`` before ``[h]``)."""

    __slots__ = ("tensor", "indices", "tracer")

    def __init__(self, tensor, indices, tracer):
        self.tensor, self.indices, self.tracer = tensor, indices, tracer

    def __getitem__(self, index):
        return index_buffer(self.tracer, self.tensor, self.indices, index)

    def __bool__(self):
        raise self.tracer.error("a partially indexed captured tensor has no truth value")

    def __setitem__(self, index, value):
        raise self.tracer.error(SETITEM_MESSAGE.format(shape=tuple(self.tensor.shape)))

    def row_error(self, what: str) -> TraceError:
        """The error for using this row (not one element) as a value, in ``what``."""
        shape = tuple(self.tensor.shape)
        return self.tracer.error(
            f"{what}: the captured tensor of shape {shape} indexed in {len(self.indices)} of "
            f"its {len(shape)} dimensions is a row of values, but a mod computes one scalar per "
            "(b, h, q_idx, kv_idx); index every dimension (e.g. t[q_idx, 0]), and to reduce "
            "over a dimension combine its elements in Python: sum(t[q_idx, d] * t[kv_idx, d] "
            "for d in range(t.shape[1]))", UnsupportedOpError)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise self.row_error(f".{name}() on a partially indexed captured tensor")

    @classmethod
    def __torch_function__(cls, func, types_, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__:
            return _dispatch(func, args, kwargs)
        operands = [*args, *(kwargs or {}).values()]
        view = next(a for v in operands for a in (v if isinstance(v, (tuple, list)) else (v,))
                    if isinstance(a, BufferView))
        raise view.row_error(f"{func_name(func)} applied to a partially indexed captured tensor")


def index_buffer(tracer: Tracer, tensor: torch.Tensor, done: tuple[Node, ...], index):
    items = index if isinstance(index, tuple) else (index,)
    nodes = list(done)
    for item in items:
        if item is None or item is Ellipsis or isinstance(item, slice):
            raise tracer.error(
                f"indexing a captured tensor with {item!r} is not supported; index each "
                "dimension with an integer expression (e.g. bias[h, q_idx - kv_idx])",
                UnsupportedOpError)
        if isinstance(item, torch.Tensor) and item.numel() == 1 and not item.dtype.is_floating_point:
            item = lift(item, tracer)  # a captured 0-d int tensor used as an index
            item = Proxy(item, tracer)
        if isinstance(item, Proxy):
            if item.node.dtype is DType.FLOAT:
                raise tracer.error(
                    f"a captured tensor of shape {dims(tensor)} was indexed with a "
                    "float value; indices must be integers (convert with .int() or // )")
            if item.node.dtype is DType.BOOL or item.storage == torch.uint8:
                # (torch takes a bool or uint8 index as a mask)
                what = "bool" if item.node.dtype is DType.BOOL else "uint8"
                raise tracer.error(
                    f"a captured tensor of shape {dims(tensor)} was indexed with a "
                    f"{what} value, which torch reads as a mask, not as an integer; convert it "
                    "with .int() (or choose with torch.where)")
            nodes.append(ir.cast(item.node, DType.INT))
        elif isinstance(item, (bool, float)) or not isinstance(item, numbers.Integral):
            raise tracer.error(
                f"a captured tensor of shape {dims(tensor)} was indexed with "
                f"{type(item).__name__} {item!r:.40}; indices must be integers")
        else:
            nodes.append(ir.const(int(item)))
    if len(nodes) > tensor.dim():
        raise tracer.error(
            f"captured tensor of shape {dims(tensor)} indexed with {len(nodes)} indices")
    if len(nodes) < tensor.dim():
        return BufferView(tensor, tuple(nodes), tracer)
    # an element of a narrow integer tensor is held in its dtype, as torch's is (t8[i] + 100
    # wraps in int8); float16 / bfloat16 elements are read as float32 (docs/mods.md)
    narrow_int = tensor.dtype in _NARROW_NAMES and _kind(tensor.dtype) is DType.INT
    return Proxy(_finish_load(tracer, tensor, tuple(nodes)), tracer,
                 tensor.dtype if narrow_int else None)


# ---- operators ----------------------------------------------------------------------------

_BOOL_OPS = {Op.ADD: Op.OR, Op.MUL: Op.AND}


# the ops whose torch CPU kernels convert a Python number to a float16 / bfloat16 operand's
# type before computing (mul, true and floor division keep it in float32 instead)
_ROUNDS_NUMBER = frozenset({Op.ADD, Op.SUB, Op.LT, Op.LE, Op.EQ, Op.NE, Op.MOD, Op.FMOD, Op.POW})


def lift_pair(tracer: Tracer, a, b, op: Op | None = None) -> tuple[Node, Node]:
    """The nodes of two operands, a Python number converted to the narrow type of the other
    operand first, as torch converts it: wrapped into an int type (t8 // 200 divides by -56,
    t8 == 128 compares with -128; not for t8 / 200, float math), rounded to float16 /
    bfloat16 by the ops that do (``_ROUNDS_NUMBER``: h == 2049.0 is True at 2048)."""
    x, y = lift(a, tracer), lift(b, tracer)
    if DType.FLOAT in (x.dtype, y.dtype):
        storage = narrow_storage((a, b), DType.FLOAT) if op in _ROUNDS_NUMBER else None
    else:
        storage = narrow_storage((a, b), DType.INT) if op is not Op.DIV else None
    if storage is None:
        return x, y
    return tuple(ir.narrow(n, _NARROW_NAMES[storage])
                 if n.dtype is not DType.BOOL and not isinstance(v, (Proxy, torch.Tensor))
                 else n for v, n in ((a, x), (b, y)))


def binary_op(op: Op, swap: bool = False):
    def apply(a, b):
        tracer = find_tracer(a, b)
        x, y = lift_pair(tracer, a, b, op)
        if swap:
            x, y = y, x
        if op in (Op.AND, Op.OR, Op.XOR) and DType.FLOAT in (x.dtype, y.dtype):
            raise tracer.error(f"operator {op.name.lower()} needs bool or int operands, got float",
                               UnsupportedOpError)
        bools = (x.dtype is DType.BOOL) + (y.dtype is DType.BOOL)
        if bools == 2 and op is Op.POW and not swap and isinstance(b, bool):
            # torch takes a bool tensor to a Python bool power (pow(x, 1), pow(x, 0)): x ** True
            # is x, x ** False is True; two bool tensors it refuses (below)
            return a if b else Proxy(ir.const(True), tracer)
        if bools and op is Op.SUB:  # torch refuses it too (Python's bools would subtract as ints)
            raise tracer.error("subtraction with a bool value; use ^ or torch.logical_xor for two "
                               "masks, ~ to invert one", UnsupportedOpError)
        if bools == 2 and op in (Op.FLOORDIV, Op.MOD, Op.POW):
            raise tracer.error(f"operator {op.name.lower()} on two bool values (torch refuses "
                               "it too); cast one with .int() or .float() first",
                               UnsupportedOpError)
        if (op is Op.POW and not swap and x.dtype is DType.INT and isinstance(b, numbers.Integral)
                and not isinstance(b, bool) and b < 0):
            raise tracer.error(f"an integer to the power {b}: torch raises \"Integers to "
                               "negative integer powers are not allowed\"; use a float "
                               f"(x.float() ** {b})", UnsupportedOpError)
        # torch adds bool tensors as a logical or and multiplies them as a logical and, with a
        # bool result (True + True is True; Python's bools alone would give 2)
        op_ = _BOOL_OPS.get(op, op) if x.dtype is y.dtype is DType.BOOL else op
        return result(tracer, ir.binary(op_, x, y), (a, b),
                      lambda nodes: ir.binary(op_, *(nodes[::-1] if swap else nodes)))
    return apply


def shift_op(left: bool, swap: bool = False):
    """``x << n`` and ``x >> n`` on ints as torch computes them:
    ``x * 2 ** n`` wrapping like torch's shift (a count outside 0..63 gives 0), and
    ``x // 2 ** n``, floor division being the arithmetic shift (a count outside 0..62 gives
    the sign: -1 or 0)."""
    symbol = "<<" if left else ">>"

    def apply(a, b):
        tracer = find_tracer(a, b)
        if swap:
            a, b = b, a
        # a Python bool beside an int tensor is the int 0 or 1 to torch (True << kv_idx)
        a, b = (int(v) if isinstance(v, bool) else v for v in (a, b))
        x, n = lift_pair(tracer, a, b)
        if DType.INT is not x.dtype or DType.INT is not n.dtype:
            raise tracer.error(f"operator {symbol} needs int operands, got {x.dtype.value} "
                               f"and {n.dtype.value} (torch.compile refuses it too); cast a "
                               "bool value with .long() first", UnsupportedOpError)
        if left:  # 2 ** n wraps to -2**63 at 63 and to 0 from 64, is 0 below 0, as torch's
            node = ir.binary(Op.MUL, x, ir.binary(Op.POW, ir.const(2), n))
        else:
            inside = ir.binary(Op.AND, ir.binary(Op.LE, ir.const(0), n),
                               ir.binary(Op.LT, n, ir.const(63)))
            count = ir.where(inside, n, ir.const(0))  # no division by 2 ** 63 or by 0
            sign = ir.where(ir.binary(Op.LT, x, ir.const(0)), ir.const(-1), ir.const(0))
            node = ir.where(inside, ir.binary(Op.FLOORDIV, x, ir.binary(Op.POW, ir.const(2),
                                                                         count)), sign)
        return result(tracer, node, (a, b))
    return apply


def _is_device(text: str) -> bool:
    """Whether torch takes ``text`` as a device string ("cpu", "cuda:0")."""
    try:
        torch.device(text)
    except (RuntimeError, ValueError):
        return False
    return True


def unary_op(op: Op):
    def apply(a):
        tracer = find_tracer(a)
        x = lift(a, tracer)
        if op is Op.NEG and x.dtype is DType.BOOL:
            raise tracer.error("unary minus on a bool value; use ~ for logical not")
        if op is Op.NOT and x.dtype is DType.FLOAT:
            raise tracer.error("~ needs a bool or int operand, got float", UnsupportedOpError)
        return result(tracer, ir.unary(op, x), (a,))
    return apply


def _rtruediv(a, b):
    """``b / a`` for a traced ``a``: torch computes a Python number over a tensor as
    ``a.reciprocal() * b`` (two roundings; Tensor.__rdiv__), a tensor over it as a division."""
    if isinstance(b, numbers.Number):
        return _MUL(_RDIV(a, 1.0), b)
    return _RDIV(a, b)


_MUL, _RDIV = binary_op(Op.MUL), binary_op(Op.DIV, swap=True)
DUNDERS = {
    "__add__": binary_op(Op.ADD), "__radd__": binary_op(Op.ADD, swap=True),
    "__sub__": binary_op(Op.SUB), "__rsub__": binary_op(Op.SUB, swap=True),
    "__mul__": binary_op(Op.MUL), "__rmul__": binary_op(Op.MUL, swap=True),
    "__truediv__": binary_op(Op.DIV), "__rtruediv__": _rtruediv,
    "__floordiv__": binary_op(Op.FLOORDIV), "__rfloordiv__": binary_op(Op.FLOORDIV, swap=True),
    "__mod__": binary_op(Op.MOD), "__rmod__": binary_op(Op.MOD, swap=True),
    "__pow__": binary_op(Op.POW), "__rpow__": binary_op(Op.POW, swap=True),
    "__lt__": binary_op(Op.LT), "__le__": binary_op(Op.LE),
    "__gt__": binary_op(Op.LT, swap=True), "__ge__": binary_op(Op.LE, swap=True),
    "__eq__": binary_op(Op.EQ), "__ne__": binary_op(Op.NE),
    "__and__": binary_op(Op.AND), "__rand__": binary_op(Op.AND, swap=True),
    "__or__": binary_op(Op.OR), "__ror__": binary_op(Op.OR, swap=True),
    "__xor__": binary_op(Op.XOR), "__rxor__": binary_op(Op.XOR, swap=True),
    "__lshift__": shift_op(left=True), "__rlshift__": shift_op(left=True, swap=True),
    "__rshift__": shift_op(left=False), "__rrshift__": shift_op(left=False, swap=True),
    "__neg__": unary_op(Op.NEG), "__abs__": unary_op(Op.ABS), "__invert__": unary_op(Op.NOT),
    "__pos__": lambda a: a,
}
for _name, _fn in DUNDERS.items():
    setattr(Proxy, _name, _fn)
Proxy.__hash__ = object.__hash__  # __eq__ is traced, identity hashing stays

# the tensor methods that cast to a fixed dtype
CAST_METHODS = {"float": torch.float32, "double": torch.float64, "half": torch.float16,
                "bfloat16": torch.bfloat16, "long": torch.int64, "int": torch.int32,
                "short": torch.int16, "char": torch.int8, "byte": torch.uint8,
                "bool": torch.bool}


def _cast_to(dtype: torch.dtype):
    def cast(self):
        return convert(self.tracer, self.node, dtype)
    return cast


for _name, _dtype in CAST_METHODS.items():
    setattr(Proxy, _name, _cast_to(_dtype))


def _row_operator(name: str):
    def refuse(view, *other):
        raise view.row_error(f"operator {name.strip('_')} on a partially indexed captured tensor")
    return refuse


# arithmetic on a row (means[q_idx] - means[kv_idx]) is refused by name, not by Python's
# "unsupported operand type(s)"
for _name in DUNDERS:
    setattr(BufferView, _name, _row_operator(_name))
BufferView.__hash__ = object.__hash__



# ---- torch functions ----------------------------------------------------------------------

def _dispatch(func, args, kwargs):
    handler = TORCH_FUNCTIONS.get(func)
    if handler is None:
        raise unsupported(find_tracer(*args, *(kwargs or {}).values()), func)
    return _call(handler, func, args, kwargs or {})


def _call(handler, func, args, kwargs):
    """``handler(*args, **kwargs)``; arguments it does not take (``alpha=``, ``out=``) are a
    TraceError naming ``func`` instead of the handler's own TypeError."""
    try:
        return handler(*args, **kwargs)
    except TypeError as exc:
        if isinstance(exc, TraceError) or exc.__traceback__.tb_next is not None:
            raise  # raised inside the handler, not by binding its arguments
        detail = str(exc).split("() ", 1)[-1]
        raise find_tracer(*args, *kwargs.values()).error(
            f"{func_name(func)} was called with arguments flexfa does not support ({detail}); "
            "see docs/mods.md for the supported forms", UnsupportedOpError) from None
