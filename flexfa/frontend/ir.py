"""The IR: one ``Op`` enum and one immutable, hash-consed ``Node`` type.

A node is ``(op, dtype, src, arg)``. Nodes are built only through ``Node.make`` (or the
helpers below), which returns the existing node for an equal key, so structurally equal
graphs are the same Python object and ``node.key`` (a sha256 over the structure) is a stable
cache key across processes.

dtypes: ``INT`` is index math (int32 in kernels, int64 in eager evaluation), ``FLOAT`` is
score math (float32 in kernels; the eager reference may evaluate it in float64), ``BOOL`` is
mask logic. ``NARROW`` models torch's narrower storage types (float16, bfloat16, int8, uint8,
int16, int32): the value is rounded or wrapped as torch stores it, then computed on as FLOAT
or INT.
"""
from __future__ import annotations

import enum
import hashlib
import math
import threading
import weakref


class DType(enum.Enum):
    BOOL = "bool"
    INT = "int"
    FLOAT = "float"

    def __repr__(self) -> str:  # short in IR dumps
        return self.value


class Op(enum.Enum):
    # leaves
    CONST = enum.auto()  # arg: the Python value (bool, int or float)
    SCORE = enum.auto()  # float32 q.k * scale
    B = enum.auto()
    H = enum.auto()
    Q_IDX = enum.auto()
    KV_IDX = enum.auto()
    # captured tensor read; arg: buffer slot (int); src: one INT index per dimension
    LOAD = enum.auto()
    # binary arithmetic (both operands already promoted to the node's dtype)
    ADD = enum.auto()
    SUB = enum.auto()
    MUL = enum.auto()
    DIV = enum.auto()  # true division, always FLOAT
    FLOORDIV = enum.auto()  # Python semantics: rounds toward -inf
    MOD = enum.auto()  # Python semantics: sign of the divisor
    FMOD = enum.auto()  # C semantics (torch.fmod): sign of the dividend
    POW = enum.auto()
    # arg: how the gradient treats ties (see TIES_SPLIT and friends); the value ignores it
    MAX = enum.auto()
    MIN = enum.auto()
    # comparisons -> BOOL (a > b is written LT(b, a))
    LT = enum.auto()
    LE = enum.auto()
    EQ = enum.auto()
    NE = enum.auto()
    # logic: on BOOL these are logical, on INT bitwise
    AND = enum.auto()
    OR = enum.auto()
    XOR = enum.auto()
    NOT = enum.auto()
    WHERE = enum.auto()  # src: (cond BOOL, a, b)
    CAST = enum.auto()  # dtype is the target; src: (x,)
    # x stored as the torch dtype named by arg (a key of NARROW_TYPES) and read back: FLOAT
    # rounds to nearest even (overflow to inf); INT wraps (two's complement); a FLOAT source
    # of an INT narrow converts like torch on the CPU (see evaluate.narrow)
    NARROW = enum.auto()
    DETACH = enum.auto()  # x's value without its gradient, like torch's .detach()
    # unary
    NEG = enum.auto()
    ABS = enum.auto()
    SIGN = enum.auto()
    FLOOR = enum.auto()
    CEIL = enum.auto()
    EXP = enum.auto()
    EXP2 = enum.auto()
    EXPM1 = enum.auto()
    LOG = enum.auto()
    LOG1P = enum.auto()
    LOG2 = enum.auto()
    SQRT = enum.auto()
    RSQRT = enum.auto()
    TANH = enum.auto()
    SIGMOID = enum.auto()
    SIN = enum.auto()
    COS = enum.auto()
    TAN = enum.auto()
    ERF = enum.auto()


LEAVES = frozenset({Op.CONST, Op.SCORE, Op.B, Op.H, Op.Q_IDX, Op.KV_IDX})
INDEX_LEAVES = (Op.B, Op.H, Op.Q_IDX, Op.KV_IDX)
BINARY = frozenset(
    {Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.FLOORDIV, Op.MOD, Op.FMOD, Op.POW, Op.MAX, Op.MIN,
     Op.AND, Op.OR, Op.XOR}
)
COMPARISONS = frozenset({Op.LT, Op.LE, Op.EQ, Op.NE})
# float -> float unary math; applying one to an INT/BOOL operand promotes it to FLOAT first
FLOAT_UNARY = frozenset(
    {Op.EXP, Op.EXP2, Op.EXPM1, Op.LOG, Op.LOG2, Op.LOG1P, Op.SQRT, Op.RSQRT, Op.TANH,
     Op.SIGMOID, Op.SIN, Op.COS, Op.TAN, Op.ERF}
)
# unary ops that keep their operand's dtype
SAME_TYPE_UNARY = frozenset({Op.NEG, Op.ABS, Op.SIGN, Op.FLOOR, Op.CEIL, Op.NOT, Op.DETACH})

# NARROW's arg -> the node's dtype; the int types' (min, max) in INT_RANGES
NARROW_TYPES = {"float16": DType.FLOAT, "bfloat16": DType.FLOAT, "int8": DType.INT,
                "uint8": DType.INT, "int16": DType.INT, "int32": DType.INT}
INT_RANGES = {"int8": (-2 ** 7, 2 ** 7 - 1), "uint8": (0, 2 ** 8 - 1),
              "int16": (-2 ** 15, 2 ** 15 - 1), "int32": (-2 ** 31, 2 ** 31 - 1)}

# MAX/MIN arg: who gets the gradient where the operands tie (the value is the same)
TIES_SPLIT = None  # half each, like torch.maximum/minimum
TIES_CLAMP = "clamp"  # the input (first operand) gets all of it, like torch.clamp
TIES_NONE = "threshold"  # nobody gets it, like relu and hardtanh; a NaN input passes it on
TIES = (TIES_SPLIT, TIES_CLAMP, TIES_NONE)


class Node:
    """One IR value. Immutable and hash-consed: build with ``Node.make``."""

    __slots__ = ("op", "dtype", "src", "arg", "key", "__weakref__")
    _table: "weakref.WeakValueDictionary[tuple, Node]" = weakref.WeakValueDictionary()
    # a miss is filled under the lock: two threads building one structure at once (the first
    # traces of two mods) must get one node, since equal structure is tested by identity
    # (``id(ir.score())`` finds the score_mod's gradient)
    _make_lock = threading.RLock()

    op: Op
    dtype: DType
    src: tuple["Node", ...]
    arg: object
    key: str

    def __init__(self, *a, **k):
        raise TypeError("build IR nodes with Node.make(op, dtype, src, arg)")

    @classmethod
    def make(cls, op: Op, dtype: DType, src: tuple["Node", ...] = (), arg: object = None) -> "Node":
        assert all(isinstance(s, Node) for s in src), f"{op}: sources must be Nodes, got {src}"
        # type(arg) keeps 1, 1.0 and True apart; ids are safe because src nodes are kept
        # alive by the table key itself
        table_key = (op, dtype, src, type(arg), _arg_key(arg))
        node = cls._table.get(table_key)
        if node is not None:
            return node
        with cls._make_lock:
            node = cls._table.get(table_key)
            if node is None:
                node = cls._table[table_key] = cls._new(op, dtype, src, arg)
        return node

    @classmethod
    def _new(cls, op: Op, dtype: DType, src: tuple["Node", ...], arg: object) -> "Node":
        node = object.__new__(cls)
        object.__setattr__(node, "op", op)
        object.__setattr__(node, "dtype", dtype)
        object.__setattr__(node, "src", src)
        object.__setattr__(node, "arg", arg)
        digest = hashlib.sha256()
        digest.update(f"{op.name}|{dtype.value}|{type(arg).__name__}|{_arg_key(arg)!r}".encode())
        for s in src:
            digest.update(s.key.encode())
        object.__setattr__(node, "key", digest.hexdigest())
        return node

    def __setattr__(self, name, value):
        raise AttributeError("IR nodes are immutable")

    # identity semantics: equal structure means the same object
    def __eq__(self, other):
        return self is other

    def __hash__(self):
        return id(self)

    def __repr__(self) -> str:
        return f"Node({self.op.name}, {self.dtype.value}, arg={self.arg!r}, key={self.key[:8]})"

    # a node is immutable and unique per structure: copies are the node itself, and a pickle
    # holds the structure, rebuilt through Node.make (one flat list, so a deep graph does not
    # recurse in pickle)
    def __copy__(self) -> "Node":
        return self

    def __deepcopy__(self, memo) -> "Node":
        return self

    def __reduce__(self):
        order = self.toposort()
        position = {id(node): i for i, node in enumerate(order)}
        structure = tuple((n.op, n.dtype, tuple(position[id(s)] for s in n.src), n.arg)
                          for n in order)
        return _rebuild, (structure,)

    def toposort(self) -> list["Node"]:
        """All nodes reachable from this one, sources before users."""
        order: list[Node] = []
        seen: set[int] = set()
        stack: list[tuple[Node, bool]] = [(self, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                order.append(node)
                continue
            if id(node) in seen:
                continue
            seen.add(id(node))
            stack.append((node, True))
            for s in reversed(node.src):
                if id(s) not in seen:
                    stack.append((s, False))
        return order


def _rebuild(structure: tuple) -> Node:
    """The last node of a pickled structure (``Node.__reduce__``): (op, dtype, source
    positions, arg) per node, sources first."""
    nodes: list[Node] = []
    for op, dtype, src, arg in structure:
        nodes.append(Node.make(op, dtype, tuple(nodes[i] for i in src), arg))
    return nodes[-1]


def _arg_key(arg):
    # floats: keep -0.0 and nan distinguishable and stable
    if isinstance(arg, float):
        return ("f", arg.hex() if not math.isnan(arg) else "nan")
    return arg


# ---- constructors -------------------------------------------------------------------------

def const(value, dtype: DType | None = None) -> Node:
    if dtype is None:
        dtype = dtype_of_python(value)
    value = {DType.BOOL: bool, DType.INT: int, DType.FLOAT: float}[dtype](value)
    return Node.make(Op.CONST, dtype, (), value)


def dtype_of_python(value) -> DType:
    if isinstance(value, bool):
        return DType.BOOL
    if isinstance(value, int):
        return DType.INT
    if isinstance(value, float):
        return DType.FLOAT
    raise TypeError(f"no IR dtype for Python value {value!r} of type {type(value).__name__}")


def score() -> Node:
    return Node.make(Op.SCORE, DType.FLOAT)


def index(op: Op) -> Node:
    assert op in INDEX_LEAVES, op
    return Node.make(op, DType.INT)


def load(slot: int, indices: tuple[Node, ...], dtype: DType) -> Node:
    assert all(i.dtype is DType.INT for i in indices), "buffer indices must be INT"
    return Node.make(Op.LOAD, dtype, tuple(indices), slot)


_RANK = {DType.BOOL: 0, DType.INT: 1, DType.FLOAT: 2}


def promote(*dtypes: DType) -> DType:
    """Result dtype of mixing operands, like torch: bool < int < float."""
    return max(dtypes, key=_RANK.__getitem__)


def cast(x: Node, dtype: DType) -> Node:
    if x.dtype is dtype:
        return x
    if x.op is Op.CONST:
        return const(x.arg, dtype)
    return Node.make(Op.CAST, dtype, (x,))


def binary(op: Op, a: Node, b: Node) -> Node:
    """Arithmetic, comparison or logic on two nodes, with torch-like promotion."""
    if op in COMPARISONS:
        common = promote(a.dtype, b.dtype)
        return Node.make(op, DType.BOOL, (cast(a, common), cast(b, common)))
    if op is Op.DIV or (op is Op.POW and promote(a.dtype, b.dtype) is DType.FLOAT):
        common = DType.FLOAT
    elif op in (Op.AND, Op.OR, Op.XOR):
        common = promote(a.dtype, b.dtype)
        assert common is not DType.FLOAT, f"{op.name} needs bool or int operands"
    else:
        common = promote(a.dtype, b.dtype)
        if common is DType.BOOL and op not in (Op.MAX, Op.MIN):
            common = DType.INT  # True + True == 2, as in torch
    return Node.make(op, common, (cast(a, common), cast(b, common)))


def extremum(op: Op, x: Node, bound: Node, ties=TIES_SPLIT) -> Node:
    """MAX or MIN of ``x`` and ``bound`` whose gradient treats ties as ``ties`` says (only
    float results carry it: ints have no gradient)."""
    assert op in (Op.MAX, Op.MIN) and ties in TIES, (op, ties)
    node = binary(op, x, bound)
    if ties is TIES_SPLIT or node.dtype is not DType.FLOAT:
        return node
    return Node.make(op, node.dtype, node.src, ties)


def narrow(x: Node, name: str) -> Node:
    """``x`` as torch stores it in the dtype ``name`` (a key of NARROW_TYPES)."""
    target = NARROW_TYPES[name]
    if x.dtype is DType.BOOL:  # 0 and 1 survive every storage type
        return cast(x, target)
    if target is DType.FLOAT:
        x = cast(x, DType.FLOAT)
    return Node.make(Op.NARROW, target, (x,), name)


def unary(op: Op, x: Node) -> Node:
    if op in FLOAT_UNARY:
        return Node.make(op, DType.FLOAT, (cast(x, DType.FLOAT),))
    assert op in SAME_TYPE_UNARY, op
    if op is Op.NEG and x.dtype is DType.BOOL:
        raise TypeError("negation of a bool value is not supported; use ~ instead")
    if op in (Op.FLOOR, Op.CEIL, Op.DETACH) and x.dtype is not DType.FLOAT:
        return x  # whole already / never has a gradient
    return Node.make(op, x.dtype, (x,))


def where(cond: Node, a: Node, b: Node) -> Node:
    common = promote(a.dtype, b.dtype)
    return Node.make(Op.WHERE, common, (cast(cond, DType.BOOL), cast(a, common), cast(b, common)))


def rewrite(root: Node, fn, done: dict[Node, Node] | None = None) -> Node:
    """Rebuild the graph sources-first: every node, rebuilt on its already rewritten sources,
    is replaced by ``fn(node)``. Returns the new root (``root`` itself if nothing changed).
    ``done``: filled with each old node's replacement (shared across calls, as a memo)."""
    done = {} if done is None else done
    for node in root.toposort():
        src = tuple(done[s] for s in node.src)
        rebuilt = node
        if any(new is not old for new, old in zip(src, node.src)):
            rebuilt = Node.make(node.op, node.dtype, src, node.arg)
        done[node] = fn(rebuilt)
    return done[root]


# ---- printing -----------------------------------------------------------------------------

def format_ir(root: Node, buffer_names: list[str] | None = None) -> str:
    """A readable SSA listing, one line per node, e.g. ``%3: float = mul(%0, 0.125)``."""
    names: dict[int, str] = {}
    lines = []
    for node in root.toposort():
        if node.op is Op.CONST:
            names[id(node)] = repr(node.arg)
            continue
        if node.op in INDEX_LEAVES or node.op is Op.SCORE:
            names[id(node)] = node.op.name.lower()
            continue
        name = f"%{len(lines)}"
        args = ", ".join(names[id(s)] for s in node.src)
        if node.op is Op.LOAD:
            buf = buffer_names[node.arg] if buffer_names else f"buf{node.arg}"
            rhs = f"{buf}[{args}]"
        elif node.arg is not None:  # NARROW's dtype, MAX/MIN's ties
            rhs = f"{node.op.name.lower()}[{node.arg}]({args})"
        else:
            rhs = f"{node.op.name.lower()}({args})"
        lines.append(f"{name}: {node.dtype.value} = {rhs}")
        names[id(node)] = name
    lines.append(f"return {names[id(root)]}")
    return "\n".join(lines)
