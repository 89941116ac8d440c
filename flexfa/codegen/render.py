"""The expression renderer: IR nodes -> Triton expressions.

``render(roots, leaves, buffers)`` turns one or several IR roots into SSA assignments plus one
expression per root. Roots share common subexpressions (the backward renders the score_mod
and its gradients together); a value used once is inlined, a value used more than once gets a
name. Every op maps to a format string in a rule table; an op without a rule is an
``UnsupportedOpError`` naming it.

Kernel types: INT is int32, FLOAT is float32, BOOL is int1. The INT nodes named in ``wide``
(node keys, from ``flexfa.codegen.ranges.int64_nodes``: their values may leave int32 over the
call's indices) are computed in int64 as the eager evaluator computes every INT: their int32
operands are widened with ``.to(tl.int64)``, and Triton's promotion carries int64 to every
value computed from them. Integer constants beyond int32 are int64 scalar tensors.
An inlined expression nests at most ``MAX_INLINE_DEPTH`` ops deep: a deeper value gets a
name, so a long chain (200 ``+ bias[i]`` terms) stays within Python's limit of 200 nested
parentheses.
Where Triton differs from Python/torch, helpers from ``templates/helpers.tmpl`` restore the
Python meaning: floor division and modulo (floor, divisor's sign), integer and float powers,
``sign`` (0 for NaN), ``tanh``/``tan`` (no interpreter-safe builtin), and captured-tensor
indices (negative wraps, then clamped into range so padded rows/columns read in bounds).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Sequence

import torch

from ..errors import UnsupportedOpError
from ..frontend.evaluate import evaluate_node
from ..frontend.ir import DType, Node, Op, cast, rewrite
from .ranges import FLOAT_CAST

FLOAT, INT, BOOL = DType.FLOAT, DType.INT, DType.BOOL


@dataclasses.dataclass(frozen=True)
class Leaves:
    """Names of the mod inputs inside the kernel. ``q_idx`` is an int32 ``[BLOCK_M, 1]`` tile,
    ``kv_idx`` an int32 ``[1, BLOCK_N]`` tile (or transposed in a transposed loop), ``b`` and
    ``h`` int32 scalars (``h`` is the query head), ``score`` the float32 score tile. A leaf set
    to None may not appear in the rendered graph (a mask_mod has no score)."""

    score: str | None = "score"
    b: str = "off_b"
    h: str = "off_h"
    q_idx: str = "q_idx"
    kv_idx: str = "kv_idx"

    def name(self, op: Op) -> str:
        field = {Op.SCORE: "score", Op.B: "b", Op.H: "h", Op.Q_IDX: "q_idx", Op.KV_IDX: "kv_idx"}[op]
        value = getattr(self, field)
        if value is None:
            raise UnsupportedOpError(f"the graph reads {field}, which this kernel does not provide")
        return value


@dataclasses.dataclass(frozen=True)
class BufferArgs:
    """Kernel argument names of one captured tensor: base pointer, one stride and one size
    per dimension."""

    ptr: str
    strides: tuple[str, ...]
    sizes: tuple[str, ...]

    @property
    def params(self) -> tuple[str, ...]:
        return (self.ptr, *self.strides, *self.sizes)


def buffer_args(slot: int, rank: int, prefix: str = "buf") -> BufferArgs:
    """Standard names for buffer ``slot``: ``buf0_ptr``, ``buf0_stride0``, ``buf0_size0``, ..."""
    base = f"{prefix}{slot}"
    return BufferArgs(f"{base}_ptr", tuple(f"{base}_stride{d}" for d in range(rank)),
                      tuple(f"{base}_size{d}" for d in range(rank)))


@dataclasses.dataclass(frozen=True)
class Rendered:
    """SSA assignment lines (in order) and one expression per root."""

    lines: tuple[str, ...]
    values: tuple[str, ...]

    def code(self, indent: str = "") -> str:
        return "\n".join(indent + line for line in self.lines)


# ---- the rule tables ------------------------------------------------------------------------

# (op, node dtype) -> format string over the rendered sources; (op, None) matches any dtype
_RULES: dict[tuple[Op, DType | None], str] = {
    (Op.ADD, None): "({0} + {1})",
    (Op.SUB, None): "({0} - {1})",
    (Op.MUL, None): "({0} * {1})",
    # float % and // exact as torch's (a GPU's are not: helpers.tmpl); / is a GPU's div.full
    # (two units in the last place) where only arithmetic reads it, else _EXACT_DIV
    (Op.DIV, None): "({0} / {1})",
    (Op.FLOORDIV, INT): "flexfa_floordiv({0}, {1})",
    (Op.FLOORDIV, FLOAT): "flexfa_ffloordiv({0}, {1})",
    (Op.MOD, INT): "flexfa_mod({0}, {1})",
    (Op.MOD, FLOAT): "flexfa_fremainder({0}, {1})",
    (Op.FMOD, INT): "({0} % {1})",  # Triton's % of ints is C's srem: the dividend's sign
    (Op.FMOD, FLOAT): "flexfa_ffmod({0}, {1})",
    (Op.POW, INT): "flexfa_ipow({0}, {1}, 31)",
    (Op.POW, FLOAT): "flexfa_pow({0}, {1})",
    (Op.MAX, FLOAT): "tl.maximum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)",
    (Op.MAX, INT): "tl.maximum({0}, {1})",
    (Op.MAX, BOOL): "({0} | {1})",
    (Op.MIN, FLOAT): "tl.minimum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)",
    (Op.MIN, INT): "tl.minimum({0}, {1})",
    (Op.MIN, BOOL): "({0} & {1})",
    (Op.LT, None): "({0} < {1})",
    (Op.LE, None): "({0} <= {1})",
    (Op.EQ, None): "({0} == {1})",
    (Op.NE, None): "({0} != {1})",
    (Op.AND, None): "({0} & {1})",
    (Op.OR, None): "({0} | {1})",
    (Op.XOR, None): "({0} ^ {1})",
    (Op.NOT, BOOL): "({0} == 0)",
    (Op.NOT, INT): "(~{0})",
    # (a bool where: != 0 gives the Triton interpreter a bool array where a branch compared a
    # program's scalar as a float, and its | then failed; the compiled kernel folds it away)
    (Op.WHERE, BOOL): "(tl.where({0}, {1}, {2}) != 0)",
    (Op.WHERE, None): "tl.where({0}, {1}, {2})",
    # Triton's unary minus is 0 - x, +0.0 for x = 0.0: a product by -1 gives torch's -0.0
    (Op.NEG, FLOAT): "({0} * -1.0)",
    (Op.NEG, None): "(-{0})",
    (Op.DETACH, None): "{0}",  # a value is a value: only the derivative graph differs
    (Op.ABS, BOOL): "{0}",
    (Op.ABS, None): "tl.abs({0})",
    (Op.SIGN, BOOL): "{0}",
    (Op.SIGN, INT): "flexfa_sign({0})",
    (Op.SIGN, FLOAT): "flexfa_sign({0})",
    (Op.FLOOR, FLOAT): "tl.floor({0})",
    (Op.CEIL, FLOAT): "tl.ceil({0})",
    (Op.EXP, FLOAT): "tl.exp({0})",
    (Op.EXP2, FLOAT): "tl.exp2({0})",
    (Op.EXPM1, FLOAT): "flexfa_expm1({0})",
    (Op.LOG1P, FLOAT): "flexfa_log1p({0})",
    (Op.LOG, FLOAT): "tl.log({0})",
    (Op.LOG2, FLOAT): "tl.log2({0})",
    (Op.SQRT, FLOAT): "tl.sqrt_rn({0})",
    (Op.RSQRT, FLOAT): "tl.rsqrt({0})",
    (Op.TANH, FLOAT): "flexfa_tanh({0})",
    (Op.SIGMOID, FLOAT): "flexfa_sigmoid({0})",
    (Op.SIN, FLOAT): "tl.sin({0})",
    (Op.COS, FLOAT): "tl.cos({0})",
    (Op.TAN, FLOAT): "flexfa_tan({0})",
    (Op.ERF, FLOAT): "tl.erf({0})",
}

# fast hardware paths that replace rules above in kernels compiled for a GPU (fast_math=True);
# helpers.tmpl maps them back to the exact helpers under the interpreter
_FAST_RULES: dict[tuple[Op, DType | None], str] = {
    (Op.TANH, FLOAT): "flexfa_fast_tanh({0})",
    (Op.SIGMOID, FLOAT): "flexfa_fast_sigmoid({0})",
    (Op.EXP, FLOAT): "flexfa_fast_exp({0})",
}

# (source dtype, target dtype) -> format string; float -> int truncates toward zero (fptosi)
_CASTS: dict[tuple[DType, DType], str] = {
    (INT, FLOAT): "{0}.to(tl.float32)",
    (BOOL, FLOAT): "{0}.to(tl.float32)",
    (BOOL, INT): "{0}.to(tl.int32)",
    (FLOAT, INT): "{0}.to(tl.int32)",
    (INT, BOOL): "({0} != 0)",
    (FLOAT, BOOL): "({0} != 0)",
}

# (source dtype, NARROW's storage dtype) -> format string: the value as torch stores it in
# that dtype, read back as float32 / int32. Float -> int goes through int32 like torch on a CPU
# (flexfa_f2i32: NaN and out-of-range values give -2**31); bf16 rounds in flexfa_round_bf16
# because the interpreter's float32 -> bfloat16 conversion truncates
_NARROWS: dict[tuple[DType, str], str] = {
    (FLOAT, "float16"): "{0}.to(tl.float16).to(tl.float32)",
    (FLOAT, "bfloat16"): "flexfa_round_bf16({0})",
    (INT, "int8"): "{0}.to(tl.int8).to(tl.int32)",
    (INT, "uint8"): "{0}.to(tl.uint8).to(tl.int32)",
    (INT, "int16"): "{0}.to(tl.int16).to(tl.int32)",
    (INT, "int32"): "{0}.to(tl.int32)",
    (FLOAT, "int8"): "flexfa_f2i32({0}).to(tl.int8).to(tl.int32)",
    (FLOAT, "uint8"): "flexfa_f2i32({0}).to(tl.uint8).to(tl.int32)",
    (FLOAT, "int16"): "flexfa_f2i32({0}).to(tl.int16).to(tl.int32)",
    (FLOAT, "int32"): "flexfa_f2i32({0})",
}

# how a loaded element becomes a kernel value of the LOAD node's dtype
_LOAD_CONVERT = {FLOAT: "{0}.to(tl.float32)", INT: "{0}.to(tl.int32)", BOOL: "({0} != 0)"}

# a division whose value reaches one of these (through any float arithmetic) is correctly
# rounded, as torch's: a floor, comparison or integer cast turns an ulp into a whole unit
# ((q * 3) / 3 floored to q - 1), and POW's exponent decides its integral and odd cases
_EXACT_DIV = "flexfa_div({0}, {1})"
_DISCRETE = frozenset({Op.FLOOR, Op.CEIL, Op.SIGN, Op.FLOORDIV, Op.MOD, Op.FMOD, Op.LT, Op.LE,
                       Op.EQ, Op.NE, Op.CAST, Op.NARROW})


def _exact_divisions(roots: Sequence[Node]) -> frozenset[int]:
    """Ids of the DIV nodes whose quotient reaches a discrete use (_DISCRETE, POW's
    exponent) through float values."""
    order = _order(roots)
    reaches: set[int] = set()
    for node in reversed(order):  # every consumer before its sources
        if node.op in _DISCRETE or id(node) in reaches:
            sources = node.src
        elif node.op is Op.POW:
            sources = node.src[1:]
        else:
            continue
        reaches.update(id(s) for s in sources if s.dtype is FLOAT)
    return frozenset(id(n) for n in order if n.op is Op.DIV and id(n) in reaches)


# rules of INT nodes computed in int64 (``wide``) where the int32 rule differs
_WIDE_RULES: dict[tuple[Op, DType | None], str] = {
    (Op.POW, INT): "flexfa_ipow({0}, {1}, 63)",
}
_WIDE_CASTS: dict[tuple[DType, DType], str] = {
    (FLOAT, INT): "{0}.to(tl.int64)",
    (BOOL, INT): "{0}.to(tl.int64)",
}
_WIDE_LOAD = "{0}.to(tl.int64)"

INT32_MIN, INT32_MAX = -(2 ** 31), 2 ** 31 - 1
INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
# deepest inlined expression (in ops); each op adds at most 3 parentheses
MAX_INLINE_DEPTH = 16

# (a cast of the constant, not tl.full: the Gluon kernels render mods by these rules too)
NEGATIVE_ZERO = "tl.cast(-2147483648, tl.float32, bitcast=True)"

# small constant integer exponents render as products (exact, and what the backward expects)
_MAX_UNROLLED_POWER = 4


def literal(value) -> str:
    """A Python value as Triton source: ``True``, ``(-3)``, ``0.125``, ``float("-inf")``."""
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, int):
        return f"({value})" if value < 0 else str(value)
    value = float(value)
    if value == 0.0 and math.copysign(1.0, value) < 0:
        # Triton makes every constant equal to 0 a +0.0 (semantic.scalar_constant, compiled
        # and interpreted alike), which x / -0.0 would show: -0.0 from its bits instead
        return NEGATIVE_ZERO
    if math.isnan(value):
        return 'float("nan")'
    if math.isinf(value):
        return 'float("inf")' if value > 0 else 'float("-inf")'
    return f"({value!r})" if value < 0 or str(value).startswith("-") else repr(value)


def _rule(node: Node, fast_math: bool = False, wide: bool = False) -> str:
    if fast_math and (node.op, node.dtype) in _FAST_RULES:
        return _FAST_RULES[(node.op, node.dtype)]
    if node.op is Op.NARROW:
        return _NARROWS[(node.src[0].dtype, node.arg)]
    if node.op is Op.CAST:
        key = (node.src[0].dtype, node.dtype)
        if wide and key in _WIDE_CASTS:
            return _WIDE_CASTS[key]
        if key not in _CASTS:
            raise UnsupportedOpError(f"cannot render a cast from {key[0].value} to {key[1].value}")
        return _CASTS[key]
    rule = wide and _WIDE_RULES.get((node.op, node.dtype))
    rule = rule or _RULES.get((node.op, node.dtype)) or _RULES.get((node.op, None))
    if rule is None:
        raise UnsupportedOpError(
            f"cannot render IR op {node.op.name} on {node.dtype.value} values to Triton")
    return rule


def _int_literal(value: int) -> str:
    """An INT constant as kernel source: a literal within int32, else an int64 scalar tensor
    (Triton refuses a Python scalar outside int32 next to an int32 tensor instead of
    promoting it). It must fit int64, as in the eager evaluator."""
    if not INT64_MIN <= value <= INT64_MAX:
        raise UnsupportedOpError(
            f"integer constant {value} does not fit in int64 ({INT64_MIN}..{INT64_MAX}), "
            "the widest integer type of kernels and of torch; use a float constant")
    if not INT32_MIN <= value <= INT32_MAX:
        return f"tl.full([], {value}, tl.int64)"
    return literal(value)


def _is_int64_literal(node: Node) -> bool:
    return node.dtype is INT and node.op is Op.CONST and not INT32_MIN <= node.arg <= INT32_MAX


def _check_divisor(node: Node) -> None:
    """Integer // or % by a constant 0 raises in Python; in a kernel it would be garbage."""
    divisor = node.src[1]
    if node.dtype is INT and divisor.op is Op.CONST and divisor.arg == 0:
        symbol = "//" if node.op is Op.FLOORDIV else "%"
        raise UnsupportedOpError(f"integer division by zero: the mod computes x {symbol} 0")


def _folded(node: Node):
    """The value of a node whose sources are all constants (evaluated like the kernel)."""
    python = evaluate_node(node, float_dtype=torch.float32, device="cpu").item()
    return {FLOAT: float, INT: int, BOOL: bool}[node.dtype](python)


def _folds(node: Node, constant: Collection[int]) -> bool:
    """Whether a node is computed from constants alone (``constant``: ids of such nodes)."""
    return node.op is not Op.LOAD and bool(node.src) and all(
        s.op is Op.CONST or id(s) in constant for s in node.src)


def _power(node: Node, base: str) -> str | None:
    exponent = node.src[1]
    if (exponent.op is not Op.CONST or not math.isfinite(exponent.arg)
            or float(exponent.arg) != int(exponent.arg)):
        return None
    n = int(exponent.arg)
    if not 1 <= n <= _MAX_UNROLLED_POWER:
        return None
    return "(" + " * ".join([base] * n) + ")"


def _power_of_two_divisor(node: Node, dividend: str) -> str | None:
    """x / c for a constant c = +-2**k as x * (1 / c): the same correctly rounded value of the
    same real number, one multiply instead of a correctly rounded division."""
    divisor = node.src[1]
    if divisor.op is not Op.CONST or isinstance(divisor.arg, bool):
        return None
    c = float(divisor.arg)
    if not math.isfinite(c) or c == 0.0:
        return None
    mantissa, exponent = math.frexp(abs(c))
    if mantissa != 0.5 or not -100 <= exponent <= 100:
        return None
    return f"({dividend} * {literal(1.0 / c)})"


def _constant_power(node: Node, base: str, exponent_text: str) -> str | None:
    """A float power by a finite constant exponent (not unrolled): ``flexfa_pow_const``, its
    cases chosen here."""
    exponent = node.src[1]
    if node.dtype is not FLOAT or exponent.op is not Op.CONST:
        return None
    b = float(exponent.arg)
    if not math.isfinite(b):
        return None
    if abs(b) == 0.5:  # torch computes these as sqrt and rsqrt: (-inf) ** 0.5 is NaN there
        return f"tl.sqrt_rn({base})" if b > 0 else f"(1.0 / tl.sqrt_rn({base}))"
    integral = b == int(b)
    odd = integral and int(b) % 2 == 1
    return f"flexfa_pow_const({base}, {exponent_text}, {b == 0}, {integral}, {odd})"


_LOGICAL = frozenset({Op.AND, Op.OR, Op.XOR, Op.MAX, Op.MIN})  # bool operands: &, |, ^
_COMPARISONS = frozenset({Op.LT, Op.LE, Op.EQ, Op.NE})


def _float_comparison(node: Node) -> bool:
    return node.op in _COMPARISONS and any(s.dtype is FLOAT for s in node.src)


class _Renderer:
    def __init__(self, leaves: Leaves, buffers: Sequence[BufferArgs], prefix: str,
                 fast_math: bool = False, wide: Collection[str] = ()):
        self.leaves, self.buffers, self.prefix = leaves, buffers, prefix
        self.fast_math = fast_math
        self.wide = frozenset(wide)
        self.lines: list[str] = []
        self.exprs: dict[int, str] = {}
        self.int64: set[int] = set()  # ids of nodes whose kernel value is int64
        self.constant: set[int] = set()  # ids of folded nodes (computed from constants)
        self.exact: frozenset[int] = frozenset()  # ids of correctly rounded divisions

    def name(self) -> str:
        return f"{self.prefix}{len(self.lines)}"

    def expr(self, node: Node, operands: list[str]) -> str:
        op = node.op
        if op is Op.CONST:
            if _is_int64_literal(node):
                self.int64.add(id(node))
            return _int_literal(node.arg) if node.dtype is INT else literal(node.arg)
        if op in (Op.SCORE, Op.B, Op.H, Op.Q_IDX, Op.KV_IDX):
            return self.leaves.name(op)
        if op in (Op.FLOORDIV, Op.MOD, Op.FMOD):
            _check_divisor(node)
        if _folds(node, self.constant):
            self.constant.add(id(node))
            value = _folded(node)
            if node.dtype is not INT:
                return literal(value)
            if not INT32_MIN <= value <= INT32_MAX:
                self.int64.add(id(node))
            return _int_literal(value)
        wide = node.dtype is INT and node.key in self.wide
        if wide or (node.dtype is INT and op not in (Op.CAST, Op.LOAD, Op.NARROW)
                    and any(id(s) in self.int64 for s in node.src)):
            self.int64.add(id(node))  # Triton promotes an op with an int64 operand to int64
        if op is Op.LOAD:
            return self.load(node, operands, wide)
        if wide:
            operands = [self.widen(s, text) for s, text in zip(node.src, operands)]
        if op is Op.DIV:
            scaled = _power_of_two_divisor(node, operands[0])
            if scaled is not None:
                return scaled
            if id(node) in self.exact:
                return _EXACT_DIV.format(*operands)
        if op is Op.POW:
            unrolled = _power(node, operands[0])
            if unrolled is not None:
                return unrolled
            constant = _constant_power(node, *operands)
            if constant is not None:
                return constant
        if node.dtype is BOOL and op in _LOGICAL:
            # the Triton interpreter holds a comparison of float scalars (w[h] > 0) in a float
            # array, which &, | and ^ refuse; != 0 makes it a bool there (compiled: nothing)
            operands = [f"({text} != 0)" if _float_comparison(s) else text
                        for s, text in zip(node.src, operands)]
        return _rule(node, self.fast_math, id(node) in self.int64).format(*operands)

    def widen(self, source: Node, text: str) -> str:
        """An operand of an int64 node: int32 values are cast (int64 ones and constants,
        which Triton types by value, stay as they are)."""
        if (source.dtype is not INT or id(source) in self.int64 or source.op is Op.CONST
                or id(source) in self.constant):
            return text
        return f"{text}.to(tl.int64)"

    def load(self, node: Node, indices: list[str], wide: bool = False) -> str:
        slot = node.arg
        if slot >= len(self.buffers):
            raise UnsupportedOpError(f"the graph reads captured buffer {slot} but only "
                                     f"{len(self.buffers)} buffer argument sets were given")
        args = self.buffers[slot]
        assert len(args.strides) == len(indices), (
            f"buffer {slot} has {len(args.strides)} dims but is indexed with {len(indices)}")
        offset = " + ".join(f"flexfa_index({i}, {size}) * {stride}"
                            for i, size, stride in zip(indices, args.sizes, args.strides))
        pointer = f"{args.ptr} + {offset}" if offset else args.ptr
        return (_WIDE_LOAD if wide else _LOAD_CONVERT[node.dtype]).format(f"tl.load({pointer})")


def _use_counts(roots: Sequence[Node]) -> dict[int, int]:
    counts: dict[int, int] = {}
    seen: set[int] = set()
    for root in roots:
        for node in root.toposort():
            if id(node) in seen:
                continue
            seen.add(id(node))
            for s in node.src:
                counts[id(s)] = counts.get(id(s), 0) + 1
    return counts


def _order(roots: Sequence[Node]) -> list[Node]:
    order, seen = [], set()
    for root in roots:
        for node in root.toposort():
            if id(node) not in seen:
                seen.add(id(node))
                order.append(node)
    return order


def lift_float_casts(roots: Sequence[Node], wide: Collection[str]
                     ) -> tuple[list[Node], frozenset[str]]:
    """(``roots`` with each cast that ``wide`` marks (``ranges.FLOAT_CAST`` + its key: integer
    index math exact in float32) computed in float: its graph rebuilt on FLOAT values, each
    index and constant cast alone (a row's q_idx, a column's kv_idx: once per row or column,
    not per score), ``wide`` with the keys of the rebuilt INT nodes it marked). Exact: every
    value is an integer float32 holds (ranges.float_casts). The nodes above a lifted cast are
    new nodes, of new keys: an int64 mark carries to its node's rebuild (without, a
    ``.long()`` over index math lifted to float rendered in int32 and wrapped)."""
    wide = frozenset(wide)
    marked = {key[len(FLOAT_CAST):] for key in wide if key.startswith(FLOAT_CAST)}
    if not marked:
        return list(roots), wide

    def in_float(node: Node) -> Node:
        if node.op in (Op.CONST, Op.B, Op.H, Op.Q_IDX, Op.KV_IDX):
            return cast(node, FLOAT)
        return Node.make(node.op, FLOAT, tuple(in_float(s) for s in node.src), node.arg)

    def lift(node: Node) -> Node:
        return in_float(node.src[0]) if node.op is Op.CAST and node.key in marked else node
    done: dict[Node, Node] = {}
    lifted = [rewrite(root, lift, done) for root in roots]
    carried = {new.key for old, new in done.items()
               if old.key in wide and new.dtype is INT and new.key != old.key}
    return lifted, wide | carried


def render(roots: Sequence[Node], leaves: Leaves = Leaves(),
           buffers: Sequence[BufferArgs] = (), prefix: str = "t",
           fast_math: bool = False, wide: Collection[str] = ()) -> Rendered:
    """Render ``roots`` into SSA lines named ``{prefix}0, {prefix}1, ...`` plus one expression
    per root. Leaves and constants stay inline; every other node used more than once, every
    root that is not a leaf or constant, and every value nested deeper than
    ``MAX_INLINE_DEPTH`` gets a name. ``fast_math`` (kernels compiled for a GPU) renders
    tanh, sigmoid and exp to the hardware approximations of helpers.tmpl; a derivative that
    reads ``tanh(x)`` (1 - tanh(x)**2) reuses the forward value's name. ``wide``: keys of
    the INT nodes computed in int64 (see the module docstring) and the marks of the casts
    computed in float32 (``lift_float_casts``)."""
    roots, wide = lift_float_casts(roots, wide)
    renderer = _Renderer(leaves, buffers, prefix, fast_math, wide)
    renderer.exact = _exact_divisions(roots)
    counts = _use_counts(roots)
    root_ids = {id(r) for r in roots}
    depth: dict[int, int] = {}  # ops nested in a node's inlined text (0: a name or a leaf)
    for node in _order(roots):
        text = renderer.expr(node, [renderer.exprs[id(s)] for s in node.src])
        simple = (node.op in (Op.CONST, Op.SCORE, Op.B, Op.H, Op.Q_IDX, Op.KV_IDX)
                  or id(node) in renderer.constant)
        depth[id(node)] = 0 if simple else 1 + max((depth[id(s)] for s in node.src), default=0)
        if not simple and (counts.get(id(node), 0) > 1 or id(node) in root_ids
                           or depth[id(node)] >= MAX_INLINE_DEPTH):
            name = renderer.name()
            renderer.lines.append(f"{name} = {text}")
            text, depth[id(node)] = name, 0
        renderer.exprs[id(node)] = text
    return Rendered(tuple(renderer.lines), tuple(renderer.exprs[id(r)] for r in roots))


def render_mod(mod, roots: Sequence[Node], leaves: Leaves = Leaves(),
               buffers: Sequence[BufferArgs] = (), **options) -> Rendered:
    """``render(roots, leaves, buffers, **options)`` for graphs of the TracedMod ``mod``: an
    error names the mod (its kind and name), as tracing errors do."""
    try:
        return render(roots, leaves, buffers, **options)
    except UnsupportedOpError as exc:
        raise UnsupportedOpError(f"in {mod.kind} {mod.name!r}: {exc}") from exc


def leaf_ops(root: Node) -> frozenset[Op]:
    """Which of SCORE, B, H, Q_IDX, KV_IDX the graph reads (decides a result's tile shape)."""
    return frozenset(n.op for n in root.toposort()
                     if n.op in (Op.SCORE, Op.B, Op.H, Op.Q_IDX, Op.KV_IDX))


def needs_tile_broadcast(root: Node) -> bool:
    """True when the value is not already a full [rows, cols] tile: it reads neither the
    score nor both q_idx and kv_idx (a constant, ``h``, ``bias[q_idx]`` ...)."""
    used = leaf_ops(root)
    return Op.SCORE not in used and not {Op.Q_IDX, Op.KV_IDX} <= used
