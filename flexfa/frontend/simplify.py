"""Simplification of the IR: constant folding and algebraic identities, as rule tables.

``simplify(root)`` rebuilds the graph sources-first. At each node the rules of ``RULES[op]``
are tried in order; the first one that returns a node replaces it, and the rules run again
on the replacement until none fires. Contract of a rule: it receives a node whose sources
are already simplified and returns ``None`` (no match) or a node of the same dtype whose
sources are already simplified (at most one new node on top), so the loop stays local.

Every rewrite is exact: the simplified graph evaluates bit for bit like the original under
``evaluate`` with float32 (the kernels' and torch's arithmetic), including nan, inf and the
sign of zero, and the identities under float64 too. That is why ``x * 0`` and
``x - x`` are INT-only (``nan * 0`` is nan), ``x + 0`` is INT-only (``-0.0 + 0.0`` is
``+0.0``; the float identity is ``x + -0.0``), comparisons of a node with itself fold only
for INT/BOOL (``nan == nan`` is False), and ``(float)(int)x`` / ``(int)(float)x`` are kept.
Constants fold with ``evaluate.apply_op`` on 0-d tensors (int64, float32: a mod's floats
are float32 tensors, so ``(x - x + 1).float() * 0.1 * 3 == 0.3`` holds as in torch; folding
in float64 made it False), so folding cannot disagree with evaluation; a fold that raises
(``1 // 0``) leaves the node as it is.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from . import ir
from .evaluate import apply_op
from .ir import DType, Node, Op

Rule = Callable[[Node], Optional[Node]]
_MAX_REWRITES = 64  # per node; rules shrink or canonicalize, so this is never reached
_TORCH = {DType.BOOL: torch.bool, DType.INT: torch.int64, DType.FLOAT: torch.float32}


def simplify(root: Node) -> Node:
    """The simplified equivalent of ``root`` (the same object when nothing applies)."""
    return ir.rewrite(root, _rewrite)


def _rewrite(node: Node) -> Node:
    for _ in range(_MAX_REWRITES):
        for rule in RULES.get(node.op, ()):
            new = rule(node)
            if new is not None and new is not node:
                assert new.dtype is node.dtype, f"rule {rule.__name__} changed {node} to {new}"
                node = new
                break
        else:
            return node
    raise AssertionError(f"simplify did not converge at {node}")


# ---- helpers ------------------------------------------------------------------------------

def _c(value, dtype: DType) -> Node:
    return ir.const(value, dtype)


def _is_const(node: Node) -> bool:
    return node.op is Op.CONST


def fold(node: Node) -> Node | None:
    """Constant folding: every source is a constant -> the constant evaluation gives."""
    if not node.src or not all(_is_const(s) for s in node.src):
        return None
    try:
        srcs = [torch.tensor(s.arg, dtype=_TORCH[s.dtype]) for s in node.src]
        value = apply_op(node.op, node.dtype, srcs, torch.float32, node.arg).item()
    except (RuntimeError, ValueError, OverflowError, ZeroDivisionError):
        return None  # e.g. integer division by zero: left for the user's run to meet
    return _c(value, node.dtype)


# ---- identities with one constant operand --------------------------------------------------
# what ``x op c`` becomes, keyed by (op, the constant node c); c is hash-consed, so 0.0 and
# -0.0 are different keys. X: the other operand; NEG / NOT: its negation; else a constant.
X, NEG, NOT = "x", "neg", "not"
_I, _F, _B = DType.INT, DType.FLOAT, DType.BOOL
_RIGHT = {
    (Op.ADD, _c(0, _I)): X, (Op.ADD, _c(-0.0, _F)): X,
    (Op.SUB, _c(0.0, _F)): X,
    (Op.MUL, _c(1, _I)): X, (Op.MUL, _c(1.0, _F)): X, (Op.MUL, _c(0, _I)): _c(0, _I),
    (Op.MUL, _c(-1, _I)): NEG, (Op.MUL, _c(-1.0, _F)): NEG,
    (Op.DIV, _c(1.0, _F)): X, (Op.DIV, _c(-1.0, _F)): NEG,
    (Op.FLOORDIV, _c(1, _I)): X,
    (Op.MOD, _c(1, _I)): _c(0, _I), (Op.MOD, _c(-1, _I)): _c(0, _I),
    (Op.POW, _c(1, _I)): X, (Op.POW, _c(1.0, _F)): X,
    (Op.POW, _c(0, _I)): _c(1, _I), (Op.POW, _c(0.0, _F)): _c(1.0, _F),
    (Op.AND, _c(True, _B)): X, (Op.AND, _c(False, _B)): _c(False, _B),
    (Op.AND, _c(-1, _I)): X, (Op.AND, _c(0, _I)): _c(0, _I),
    (Op.OR, _c(False, _B)): X, (Op.OR, _c(True, _B)): _c(True, _B),
    (Op.OR, _c(0, _I)): X, (Op.OR, _c(-1, _I)): _c(-1, _I),
    (Op.XOR, _c(False, _B)): X, (Op.XOR, _c(True, _B)): NOT,
    (Op.XOR, _c(0, _I)): X, (Op.XOR, _c(-1, _I)): NOT,
}
# what ``c op x`` becomes for the non-commutative ops (commutative ones put constants right)
_LEFT = {
    (Op.SUB, _c(0, _I)): NEG,
    (Op.POW, _c(1.0, _F)): _c(1.0, _F),  # IEEE pow(1, y) is 1 even for y = nan
}


def _apply_action(action, x: Node) -> Node:
    if action == X:
        return x
    if action == NEG:
        return Node.make(Op.NEG, x.dtype, (x,))
    if action == NOT:
        return Node.make(Op.NOT, x.dtype, (x,))
    return action


def const_operand(node: Node) -> Node | None:
    """``x op c`` and ``c op x`` identities from the tables above."""
    if len(node.src) != 2:
        return None
    a, b = node.src
    if _is_const(b) and (node.op, b) in _RIGHT:
        return _apply_action(_RIGHT[node.op, b], a)
    if _is_const(a) and (node.op, a) in _LEFT:
        return _apply_action(_LEFT[node.op, a], b)
    return None


# ---- identities with both operands the same node -------------------------------------------
# op -> {dtype of the operands: result}; a result of X means the operand itself
_SAME = {
    Op.SUB: {_I: _c(0, _I)},
    Op.XOR: {_I: _c(0, _I), _B: _c(False, _B)},
    Op.AND: {_I: X, _B: X},
    Op.OR: {_I: X, _B: X},
    Op.MAX: {_I: X, _B: X, _F: X},
    Op.MIN: {_I: X, _B: X, _F: X},
    Op.EQ: {_I: _c(True, _B), _B: _c(True, _B)},
    Op.LE: {_I: _c(True, _B), _B: _c(True, _B)},
    Op.LT: {_I: _c(False, _B), _B: _c(False, _B)},
    Op.NE: {_I: _c(False, _B), _B: _c(False, _B)},
}


def same_operands(node: Node) -> Node | None:
    a, b = node.src
    if a is not b:
        return None
    result = _SAME[node.op].get(a.dtype)
    return a if result == X else result


def complement(node: Node) -> Node | None:
    """``x & ~x`` -> all zeros, ``x | ~x`` -> all ones (bool or int)."""
    a, b = node.src
    if not (b.op is Op.NOT and b.src[0] is a or a.op is Op.NOT and a.src[0] is b):
        return None
    ones = True if node.dtype is _B else -1
    return _c(ones if node.op is Op.OR else 0, node.dtype)


# ---- canonical forms -----------------------------------------------------------------------

def constant_right(node: Node) -> Node | None:
    """Commutative ops keep a constant on the right: ``2 * x`` -> ``x * 2``. Not float
    max/min: ``max(0.0, -0.0)`` and ``max(-0.0, 0.0)`` differ in the sign of zero."""
    a, b = node.src
    if node.op in (Op.MAX, Op.MIN) and node.dtype is _F:
        return None
    if _is_const(a) and not _is_const(b):
        return Node.make(node.op, node.dtype, (b, a), node.arg)
    return None


def int_sub_const(node: Node) -> Node | None:
    """INT ``x - c`` -> ``x + (-c)``, so chains of offsets meet in one ADD."""
    a, b = node.src
    if node.dtype is not _I or not _is_const(b) or _is_const(a):
        return None
    negated = fold(Node.make(Op.NEG, _I, (b,)))
    return None if negated is None else Node.make(Op.ADD, _I, (a, negated))


def reassociate(node: Node) -> Node | None:
    """``(x op c1) op c2`` -> ``x op (c1 op c2)`` for INT add/mul (exact in wrap-around
    arithmetic) and INT/BOOL max/min (float: the sign of zero, see constant_right)."""
    a, b = node.src
    if not (_is_const(b) and a.op is node.op and _is_const(a.src[1])) or node.dtype is _F:
        return None
    combined = fold(Node.make(node.op, node.dtype, (a.src[1], b)))
    return None if combined is None else Node.make(node.op, node.dtype, (a.src[0], combined))


# ---- unary ---------------------------------------------------------------------------------

def involution(node: Node) -> Node | None:
    """``not not x`` -> x, ``--x`` -> x."""
    (x,) = node.src
    return x.src[0] if x.op is node.op else None


def idempotent(node: Node) -> Node | None:
    """``abs(abs x)``, ``floor(floor x)``, ...: applying twice is applying once; and
    ``abs(-x)`` -> ``abs(x)``."""
    (x,) = node.src
    if x.op is node.op:
        return x
    if node.op is Op.ABS and x.op is Op.NEG:
        return Node.make(Op.ABS, node.dtype, x.src)
    return None


def rounding_of_int(node: Node) -> Node | None:
    """``floor(float(i))`` -> ``float(i)``: an integer-valued float is already rounded."""
    (x,) = node.src
    if x.op is Op.CAST and x.src[0].dtype is not _F:
        return x
    return None


_NEGATED_COMPARISON = {Op.LT: (Op.LE, True), Op.LE: (Op.LT, True), Op.EQ: (Op.NE, False),
                       Op.NE: (Op.EQ, False)}


def not_comparison(node: Node) -> Node | None:
    """``~(a < b)`` -> ``b <= a`` (not for float operands: nan), ``~(a == b)`` -> ``a != b``."""
    (x,) = node.src
    if node.dtype is not _B or x.op not in _NEGATED_COMPARISON:
        return None
    op, swap = _NEGATED_COMPARISON[x.op]
    a, b = x.src
    if swap and a.dtype is _F:
        return None
    return Node.make(op, _B, (b, a) if swap else (a, b))


# ---- where and casts -----------------------------------------------------------------------

def where_rules(node: Node) -> Node | None:
    """Constant or negated conditions, equal branches, bool branches that are logic."""
    cond, a, b = node.src
    if _is_const(cond):
        return a if cond.arg else b
    if a is b:
        return a
    if cond.op is Op.NOT:
        return Node.make(Op.WHERE, node.dtype, (cond.src[0], b, a))
    if node.dtype is not _B:
        return None
    if a is _c(True, _B):  # where(c, True, y) -> c | y  (covers where(c, True, False))
        return Node.make(Op.OR, _B, (cond, b))
    if b is _c(False, _B):  # where(c, y, False) -> c & y
        return Node.make(Op.AND, _B, (cond, a))
    if a is _c(False, _B) and b is _c(True, _B):
        return Node.make(Op.NOT, _B, (cond,))
    return None


def cast_of_cast(node: Node) -> Node | None:
    """``cast(cast(x, A), B)`` -> ``cast(x, B)`` when the inner cast loses nothing that
    matters: x is bool (0/1 fit every type), or int -> float -> bool (nonzero stays nonzero).
    Not int -> float -> int: that rounds above 2**24 in float32."""
    (x,) = node.src
    if x.op is not Op.CAST:
        return None
    inner = x.src[0]
    if inner.dtype is _B or (inner.dtype is _I and node.dtype is _B):
        return ir.cast(inner, node.dtype)
    return None


def narrow_rules(node: Node) -> Node | None:
    """A value that already fits the storage type needs no narrowing: a narrow of the same
    type or of a smaller int type (int8 inside int16), a bool."""
    (x,) = node.src
    if x.op is Op.NARROW and (x.arg == node.arg or _int_fits(x.arg, node.arg)):
        return x
    if x.op is Op.CAST and x.src[0].dtype is _B:
        return x
    return None


def _int_fits(inner: str, outer: str) -> bool:
    if inner not in ir.INT_RANGES or outer not in ir.INT_RANGES:
        return False
    (lo, hi), (outer_lo, outer_hi) = ir.INT_RANGES[inner], ir.INT_RANGES[outer]
    return outer_lo <= lo and hi <= outer_hi


# ---- the table -----------------------------------------------------------------------------

_COMMUTATIVE = (Op.ADD, Op.MUL, Op.MAX, Op.MIN, Op.AND, Op.OR, Op.XOR, Op.EQ, Op.NE)
RULES: dict[Op, list[Rule]] = {op: [fold] for op in Op if op not in ir.LEAVES and op is not Op.LOAD}
for _op in _COMMUTATIVE:
    RULES[_op].append(constant_right)
for _op in ir.BINARY:
    RULES[_op].append(const_operand)
for _op in _SAME:
    RULES[_op].append(same_operands)
RULES[Op.SUB].append(int_sub_const)
for _op in (Op.ADD, Op.MUL, Op.MAX, Op.MIN):
    RULES[_op].append(reassociate)
for _op in (Op.AND, Op.OR):
    RULES[_op].append(complement)
for _op in (Op.NOT, Op.NEG):
    RULES[_op].append(involution)
for _op in (Op.ABS, Op.FLOOR, Op.CEIL, Op.SIGN, Op.DETACH):
    RULES[_op].append(idempotent)
for _op in (Op.FLOOR, Op.CEIL):
    RULES[_op].append(rounding_of_int)
RULES[Op.NOT].append(not_comparison)
RULES[Op.WHERE].append(where_rules)
RULES[Op.CAST].append(cast_of_cast)
RULES[Op.NARROW].append(narrow_rules)
