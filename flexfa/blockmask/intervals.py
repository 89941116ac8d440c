"""Interval arithmetic over the mask IR: one rule per op, vectorized over tiles.

Every value is an ``Interval(lo, hi)`` of float64 tensors that broadcast to the tile grid
``[B?, H?, Q_TILES, KV_TILES]``: every element of the tile lies in ``[lo, hi]``. BOOL values
use 0/1 (``lo == 1``: surely True on the whole tile; ``hi == 0``: surely False). Rules are
conservative: when an op cannot be bounded the result is "unknown" (``[-inf, inf]``, or
``[0, 1]`` for BOOL), never a wrong bound.

Soundness conventions (so that a decided tile is always right):
- INT bounds beyond ``INT_CAP`` (or NaN, from ``0 * inf``) become infinite: float64 computes
  every int below 2**53 exactly, and a value near int64 overflow is not worth bounding. Ints
  are never NaN themselves, so each side can be widened alone, unless a bound passes int64's
  range: the value wraps there (as in torch), so both sides become infinite.
- FLOAT bounds are widened after every op by a relative and an absolute slack, because the
  exact evaluation runs in float32 while these bounds are float64.
- A FLOAT value may be NaN only where its interval has an infinite end, so FLOAT comparisons
  decide only where both intervals are finite (``NaN < x`` is False, ``NaN != x`` True), and
  a FLOAT op with such a source is unknown there (``clamp(NaN, 0, 1)`` is NaN, not in [0, 1]).
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

from ..frontend.evaluate import narrow
from ..frontend.ir import INT_RANGES, DType, Node, Op

INT_CAP = 2.0 ** 50
INT64_END = 2.0 ** 63  # int64 holds [-INT64_END, INT64_END)
FLOAT_CAP = 1e38  # below float32's max, so a bounded float32 value did not overflow
FLOAT_REL_SLACK = 1e-6
FLOAT_ABS_SLACK = 1e-30
INF = math.inf


class Interval(NamedTuple):
    lo: torch.Tensor
    hi: torch.Tensor


def exact(value: torch.Tensor) -> Interval:
    value = value.to(torch.float64)
    return Interval(value, value)


def unknown(dtype: DType, device) -> Interval:
    """No information: any value (for BOOL, maybe True and maybe False)."""
    lo, hi = (0.0, 1.0) if dtype is DType.BOOL else (-INF, INF)
    return Interval(torch.tensor(lo, dtype=torch.float64, device=device),
                    torch.tensor(hi, dtype=torch.float64, device=device))


def finish(dtype: DType, lo: torch.Tensor, hi: torch.Tensor) -> Interval:
    """Make raw float64 bounds sound for ``dtype`` (see the module docstring)."""
    if dtype is DType.BOOL:
        return Interval(lo, hi)
    if dtype is DType.INT:  # a NaN bound fails both tests, so it becomes infinite too
        # past int64 the value wraps (torch's and the kernels' arithmetic; a float past it
        # casts to -2**63): it may be anything, so both ends go
        wraps = ~((lo >= -INT64_END) & (hi < INT64_END))
        lo = torch.where((lo >= -INT_CAP) & (lo <= INT_CAP) & ~wraps, lo, -INF)
        hi = torch.where((hi >= -INT_CAP) & (hi <= INT_CAP) & ~wraps, hi, INF)
        return Interval(lo, hi)
    bad = torch.isnan(lo) | torch.isnan(hi)  # a float value may be NaN: know nothing
    lo = torch.where(bad, -INF, lo)
    hi = torch.where(bad, INF, hi)
    lo = torch.where(torch.isfinite(lo), lo - lo.abs() * FLOAT_REL_SLACK - FLOAT_ABS_SLACK, lo)
    hi = torch.where(torch.isfinite(hi), hi + hi.abs() * FLOAT_REL_SLACK + FLOAT_ABS_SLACK, hi)
    lo = torch.where(lo < -FLOAT_CAP, -INF, lo)
    hi = torch.where(hi > FLOAT_CAP, INF, hi)
    return Interval(lo, hi)


def _is_exact(x: Interval) -> torch.Tensor:
    return x.lo == x.hi


def _corners(op: Callable, a: Interval, b: Interval) -> tuple[torch.Tensor, torch.Tensor]:
    values = [op(p, q) for p in (a.lo, a.hi) for q in (b.lo, b.hi)]
    values = torch.broadcast_tensors(*values)
    stacked = torch.stack(values)
    # a NaN corner (0 * inf, inf - inf, ...) makes the whole result unknown in finish()
    any_nan = torch.isnan(stacked).any(0)
    lo = torch.where(any_nan, torch.nan, stacked.amin(0))
    return lo, stacked.amax(0)


def _unknown_where(cond: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor):
    return torch.where(cond, -INF, lo), torch.where(cond, INF, hi)


# ---- arithmetic ----------------------------------------------------------------------------

def _add(node, a, b):
    return a.lo + b.lo, a.hi + b.hi


def _sub(node, a, b):
    return a.lo - b.hi, a.hi - b.lo


def _mul(node, a, b):
    return _corners(torch.mul, a, b)


def _spans_zero(b: Interval) -> torch.Tensor:
    return (b.lo <= 0) & (b.hi >= 0)


def _div(node, a, b):
    lo, hi = _corners(torch.div, a, b)
    return _unknown_where(_spans_zero(b), lo, hi)


def _floordiv(node, a, b):
    lo, hi = _corners(torch.div, a, b)  # floor is monotone, so floor the extreme quotients
    return _unknown_where(_spans_zero(b), torch.floor(lo), torch.floor(hi))


def _mod(node, a, b):
    """Python modulo: the result has the divisor's sign and magnitude below it."""
    is_int = node.dtype is DType.INT
    one = 1.0 if is_int else 0.0
    positive, negative = b.lo > 0, b.hi < 0
    # a whole tile inside one period of a fixed divisor keeps its order: exact bounds
    period = torch.floor(a.lo / b.lo)
    same_period = positive & _is_exact(b) & (period == torch.floor(a.hi / b.lo)) \
        & torch.isfinite(a.lo) & torch.isfinite(a.hi)
    lo = torch.where(positive, 0.0, torch.where(negative, b.lo + one, -INF))
    hi = torch.where(positive, b.hi - one, torch.where(negative, 0.0, INF))
    shift = period * b.lo
    lo = torch.where(same_period, a.lo - shift, lo)
    hi = torch.where(same_period, a.hi - shift, hi)
    # 0 <= a < b: a % b == a, whatever b is on the tile
    inside = positive & (a.lo >= 0) & (a.hi < b.lo)
    lo, hi = torch.where(inside, a.lo, lo), torch.where(inside, a.hi, hi)
    if not is_int:  # float % of an infinite dividend is NaN
        lo, hi = _unknown_where(~(torch.isfinite(a.lo) & torch.isfinite(a.hi)), lo, hi)
    return lo, hi


def _fmod(node, a, b):
    """C modulo: the dividend's sign, magnitude below the divisor's and at most the
    dividend's; unknown where the divisor may be 0 (or, for floats, the dividend infinite)."""
    largest = torch.maximum(b.lo.abs(), b.hi.abs())
    if node.dtype is DType.INT:
        largest = largest - 1.0
    lo = torch.maximum(torch.minimum(a.lo, torch.zeros_like(a.lo)), -largest)
    hi = torch.minimum(torch.maximum(a.hi, torch.zeros_like(a.hi)), largest)
    unknown_where = _spans_zero(b)
    if node.dtype is not DType.INT:
        unknown_where = unknown_where | ~(torch.isfinite(a.lo) & torch.isfinite(a.hi))
    return _unknown_where(unknown_where, lo, hi)


def _pow(node, a, b):
    both_exact = _is_exact(a) & _is_exact(b)
    value = torch.pow(a.lo, b.lo)
    # a non-negative base to a fixed non-negative power is monotone in the base
    monotone = (a.lo >= 0) & _is_exact(b) & (b.lo >= 0)
    lo = torch.where(both_exact, value, torch.where(monotone, torch.pow(a.lo, b.lo), -INF))
    hi = torch.where(both_exact, value, torch.where(monotone, torch.pow(a.hi, b.lo), INF))
    # a base >= 1 to a power >= 0 grows with both (2 ** (kv_idx % 8))
    growing = ~both_exact & (a.lo >= 1) & (b.lo >= 0)
    lo = torch.where(growing, torch.pow(a.lo, b.lo), lo)
    hi = torch.where(growing, torch.pow(a.hi, b.hi), hi)
    return lo, hi


def _maximum(node, a, b):
    return torch.maximum(a.lo, b.lo), torch.maximum(a.hi, b.hi)


def _minimum(node, a, b):
    return torch.minimum(a.lo, b.lo), torch.minimum(a.hi, b.hi)


# ---- comparisons -> BOOL -------------------------------------------------------------------

def _decidable(node: Node, a: Interval, b: Interval) -> torch.Tensor | bool:
    if node.src[0].dtype is not DType.FLOAT:
        return True
    return (torch.isfinite(a.lo) & torch.isfinite(a.hi) & torch.isfinite(b.lo)
            & torch.isfinite(b.hi))


def _as_bool(node, a, b, surely_true, maybe_true):
    decidable = _decidable(node, a, b)
    lo = (surely_true & decidable).to(torch.float64)
    # (a bool decidable stays a bool: as a tensor it went to torch's default device)
    hi = (maybe_true if decidable is True else maybe_true | ~decidable).to(torch.float64)
    return lo, hi


def _lt(node, a, b):
    return _as_bool(node, a, b, a.hi < b.lo, a.lo < b.hi)


def _le(node, a, b):
    return _as_bool(node, a, b, a.hi <= b.lo, a.lo <= b.hi)


def _equal_parts(a, b):
    surely = _is_exact(a) & _is_exact(b) & (a.lo == b.lo)
    maybe = (a.lo <= b.hi) & (b.lo <= a.hi)
    return surely, maybe


def _eq(node, a, b):
    surely, maybe = _equal_parts(a, b)
    return _as_bool(node, a, b, surely, maybe)


def _ne(node, a, b):
    surely_equal, maybe_equal = _equal_parts(a, b)
    return _as_bool(node, a, b, ~maybe_equal, ~surely_equal)


# ---- logic (logical on BOOL, bitwise on INT) -----------------------------------------------

def _both_nonnegative(a, b):
    return (a.lo >= 0) & (b.lo >= 0) & torch.isfinite(a.hi) & torch.isfinite(b.hi)


def _bit_ceiling(x: torch.Tensor) -> torch.Tensor:
    """Smallest 2**k - 1 >= x for x >= 0 (bound of a | b and a ^ b for a, b <= x). By the
    exponent of x + 1 (exact below 2**53), not a float log2, which rounds log2(2**49 + 1)
    to 49 and gave 2**49 - 1 for x = 2**49."""
    mantissa, exponent = torch.frexp(x + 1)  # x + 1 = mantissa * 2**exponent, [0.5, 1)
    bits = torch.where(mantissa == 0.5, exponent - 1, exponent).to(torch.float64)
    return torch.where(torch.isinf(x), x, torch.exp2(bits) - 1)


def _bitwise(op, bound):
    def rule(node, a, b):
        both_exact = _is_exact(a) & _is_exact(b)
        if node.dtype is DType.BOOL:
            if op is None:  # xor of bools: known only when both are
                value = (a.lo != b.lo).to(torch.float64)
                return torch.where(both_exact, value, 0.0), torch.where(both_exact, value, 1.0)
            return op(a.lo, b.lo), op(a.hi, b.hi)
        value = _int_bitwise(node.op, a.lo, b.lo, both_exact)
        small = _both_nonnegative(a, b)
        lo = torch.where(both_exact, value, torch.where(small, 0.0, -INF))
        hi = torch.where(both_exact, value, torch.where(small, bound(a.hi, b.hi), INF))
        return lo, hi
    return rule


def _int_bitwise(op: Op, a: torch.Tensor, b: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    fn = {Op.AND: torch.bitwise_and, Op.OR: torch.bitwise_or, Op.XOR: torch.bitwise_xor}[op]
    ok = valid & torch.isfinite(a) & torch.isfinite(b)
    a_int = torch.where(ok, a, 0.0).to(torch.int64)
    b_int = torch.where(ok, b, 0.0).to(torch.int64)
    return fn(a_int, b_int).to(torch.float64)


def _not(node, a):
    if node.dtype is DType.BOOL:
        return 1.0 - a.hi, 1.0 - a.lo
    return -a.hi - 1.0, -a.lo - 1.0  # ~x == -x - 1 on two's complement ints


def _where(node, cond, a, b):
    surely, never = cond.lo == 1, cond.hi == 0
    lo = torch.where(surely, a.lo, torch.where(never, b.lo, torch.minimum(a.lo, b.lo)))
    hi = torch.where(surely, a.hi, torch.where(never, b.hi, torch.maximum(a.hi, b.hi)))
    return lo, hi


def _cast(node, a):
    source = node.src[0].dtype
    if node.dtype is DType.BOOL:  # x != 0
        surely = (a.lo > 0) | (a.hi < 0)
        maybe = ~((a.lo == 0) & (a.hi == 0))
        return surely.to(torch.float64), maybe.to(torch.float64)
    if node.dtype is DType.INT and source is DType.FLOAT:
        # truncation toward zero is monotone; NaN/inf would give garbage ints
        finite = torch.isfinite(a.lo) & torch.isfinite(a.hi)
        return _unknown_where(~finite, torch.trunc(a.lo), torch.trunc(a.hi))
    return a.lo, a.hi


def _narrow(node, a):
    """Rounding to float16/bfloat16 is monotone (NaN stays NaN, overflow goes to inf). An int
    type keeps a range that fits it; anything else may wrap anywhere in the type."""
    if node.dtype is DType.FLOAT:
        return narrow(a.lo, node.arg), narrow(a.hi, node.arg)
    lo, hi = a.lo, a.hi
    if node.src[0].dtype is DType.FLOAT:  # truncation toward zero is monotone
        lo, hi = torch.trunc(lo), torch.trunc(hi)
    type_lo, type_hi = INT_RANGES[node.arg]
    fits = (lo >= type_lo) & (hi <= type_hi)  # False for NaN
    return torch.where(fits, lo, float(type_lo)), torch.where(fits, hi, float(type_hi))


# ---- unary ---------------------------------------------------------------------------------

def _increasing(fn, domain_lo: float | None = None):
    def rule(node, a):
        lo, hi = fn(a.lo), fn(a.hi)
        if domain_lo is None:
            return lo, hi
        return _unknown_where(a.lo < domain_lo, lo, hi)
    return rule


def _rsqrt(node, a):
    return _unknown_where(a.lo <= 0, torch.rsqrt(a.hi), torch.rsqrt(a.lo))


def _neg(node, a):
    return -a.hi, -a.lo


def _abs(node, a):
    straddles = (a.lo < 0) & (a.hi > 0)
    lo = torch.where(straddles, 0.0, torch.minimum(a.lo.abs(), a.hi.abs()))
    return lo, torch.maximum(a.lo.abs(), a.hi.abs())


def _periodic(node, a):
    finite = torch.isfinite(a.lo) & torch.isfinite(a.hi)
    return _unknown_where(~finite, torch.full_like(a.lo, -1.0), torch.full_like(a.hi, 1.0))


def _tan(node, a):
    value = torch.tan(a.lo)
    return _unknown_where(~_is_exact(a), value, value)


RULES: dict[Op, Callable] = {
    Op.ADD: _add, Op.SUB: _sub, Op.MUL: _mul, Op.DIV: _div, Op.FLOORDIV: _floordiv,
    Op.MOD: _mod, Op.POW: _pow, Op.MAX: _maximum, Op.MIN: _minimum,
    Op.LT: _lt, Op.LE: _le, Op.EQ: _eq, Op.NE: _ne,
    Op.AND: _bitwise(torch.minimum, torch.minimum),
    Op.OR: _bitwise(torch.maximum, lambda x, y: _bit_ceiling(torch.maximum(x, y))),
    Op.XOR: _bitwise(None, lambda x, y: _bit_ceiling(torch.maximum(x, y))),
    Op.NOT: _not, Op.WHERE: _where, Op.CAST: _cast, Op.NARROW: _narrow,
    Op.DETACH: lambda node, a: (a.lo, a.hi),
    Op.NEG: _neg, Op.ABS: _abs, Op.SIGN: _increasing(torch.sign),
    Op.FLOOR: _increasing(torch.floor), Op.CEIL: _increasing(torch.ceil),
    Op.EXP: _increasing(torch.exp), Op.EXP2: _increasing(torch.exp2),
    Op.EXPM1: _increasing(torch.expm1), Op.LOG1P: _increasing(torch.log1p, -1.0),
    Op.FMOD: _fmod,
    Op.TANH: _increasing(torch.tanh), Op.SIGMOID: _increasing(torch.sigmoid),
    Op.ERF: _increasing(torch.erf),
    Op.LOG: _increasing(torch.log, 0.0), Op.LOG2: _increasing(torch.log2, 0.0),
    Op.SQRT: _increasing(torch.sqrt, 0.0), Op.RSQRT: _rsqrt,
    Op.SIN: _periodic, Op.COS: _periodic, Op.TAN: _tan,
}


def apply_rule(node: Node, sources: list[Interval], nan_unknown: bool = True) -> Interval:
    """The interval of ``node`` from its sources' intervals; unknown for ops with no rule.
    ``nan_unknown``: a FLOAT op with a source that may be NaN is unknown there (the block-mask
    analysis, whose decided comparisons must hold for NaN too); without it the interval bounds
    the op's values other than NaN (``codegen.ranges``: a NaN score is NaN in the kernel
    whatever bound it takes)."""
    rule = RULES.get(node.op)
    if rule is None:
        return unknown(node.dtype, sources[0].lo.device if sources else "cpu")
    lo, hi = rule(node, *sources)
    lo, hi = torch.as_tensor(lo, dtype=torch.float64), torch.as_tensor(hi, dtype=torch.float64)
    if nan_unknown and node.dtype is DType.FLOAT:
        # a float source with an infinite end may be NaN, which rules can map to finite bounds
        # (min/max with a constant, tanh, exp of -inf, x / inf) while the value stays NaN
        for src, interval in zip(node.src, sources):
            if src.dtype is DType.FLOAT:
                lo, hi = _unknown_where(~(torch.isfinite(interval.lo)
                                          & torch.isfinite(interval.hi)), lo, hi)
    return finish(node.dtype, lo, hi)
