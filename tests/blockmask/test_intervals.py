"""Soundness of the interval rules: every value an op can produce from inputs inside the
source intervals lies inside the rule's result (and a finite FLOAT interval holds no NaN).
Each op (cast, dtype) is a test case of its own, drawing the profile's examples for itself:
drawn from one list, an op got one or two of CI's 15 draws, and a mutation audit found eleven
unsound rules the tests let pass (test_interval_edges.py holds a case of each)."""
import math

import pytest
import torch
from hypothesis import given, strategies as st

from flexfa.blockmask.intervals import RULES, Interval, apply_rule
from flexfa.frontend import ir
from flexfa.frontend.evaluate import evaluate_node
from flexfa.frontend.ir import DType, Op

INT_BINARY = [Op.ADD, Op.SUB, Op.MUL, Op.FLOORDIV, Op.MOD, Op.FMOD, Op.POW, Op.MAX, Op.MIN,
              Op.LT, Op.LE, Op.EQ, Op.NE, Op.AND, Op.OR, Op.XOR]
FLOAT_BINARY = [Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.FLOORDIV, Op.MOD, Op.FMOD, Op.POW, Op.MAX,
                Op.MIN, Op.LT, Op.LE, Op.EQ, Op.NE]
BOOL_BINARY = [Op.AND, Op.OR, Op.XOR, Op.EQ, Op.NE, Op.LT, Op.LE, Op.MAX, Op.MIN]
INT_UNARY = [Op.NEG, Op.ABS, Op.SIGN, Op.NOT]
FLOAT_UNARY = [Op.NEG, Op.ABS, Op.SIGN, Op.FLOOR, Op.CEIL, Op.EXP, Op.EXP2, Op.EXPM1, Op.LOG,
               Op.LOG2, Op.LOG1P, Op.SQRT, Op.RSQRT, Op.TANH, Op.SIGMOID, Op.SIN, Op.COS, Op.TAN,
               Op.ERF, Op.DETACH]
_TORCH = {DType.INT: torch.int64, DType.FLOAT: torch.float32, DType.BOOL: torch.bool}


@st.composite
def interval_samples(draw, dtype: DType, low=None, high=None, nonzero=False):
    """(Interval, sample tensor): an interval and sample points in it, both ends included."""
    if dtype is DType.BOOL:
        lo, hi = sorted(draw(st.lists(st.booleans(), min_size=2, max_size=2)))
        values = [lo, hi] + [draw(st.booleans()) for _ in range(4)]
        values = [v for v in values if lo <= v <= hi]
        return _interval(float(lo), float(hi)), torch.tensor(values)
    if high is None:
        high = 3.0 if dtype is DType.FLOAT and draw(st.booleans()) else 40
    low = -high if low is None else low
    number = (st.integers(int(low), int(high)) if dtype is DType.INT
              else st.floats(low, high, allow_nan=False, width=32))
    points = draw(st.lists(number, min_size=1, max_size=8))
    lo, hi = min(points), max(points)  # the samples include both ends of the interval
    if nonzero:  # int division by zero raises in torch: keep 0 out of the samples only
        points = [p for p in points if p != 0] or [1]
        lo, hi = min(lo, *points), max(hi, *points)
    return _interval(float(lo), float(hi)), torch.tensor(points, dtype=_TORCH[dtype])


def _interval(lo: float, hi: float) -> Interval:
    return Interval(torch.tensor(lo, dtype=torch.float64), torch.tensor(hi, dtype=torch.float64))


def assert_inside(result: Interval, values: torch.Tensor, dtype: DType):
    values = values.to(torch.float64)
    lo, hi = result.lo.item(), result.hi.item()
    if dtype is not DType.BOOL and math.isfinite(lo) and math.isfinite(hi):
        assert not torch.isnan(values).any(), f"NaN inside the finite interval [{lo}, {hi}]"
    finite = values[~torch.isnan(values)]
    assert (finite >= lo).all() and (finite <= hi).all(), \
        f"values {finite.tolist()} outside [{lo}, {hi}]"


def _leaf(slot: int, dtype: DType, axis: Op):
    return ir.load(slot, (ir.index(axis),), dtype)


def check_binary(op: Op, dtype: DType, a, b):
    (ia, xs), (ib, ys) = a, b
    node = ir.binary(op, _leaf(0, dtype, Op.Q_IDX), _leaf(1, dtype, Op.KV_IDX))
    if node.src[0].op is not Op.LOAD:  # promotion inserted a cast: not the op under test
        pytest.skip("promotion")
    q, kv = torch.arange(len(xs)).view(-1, 1), torch.arange(len(ys)).view(1, -1)
    values = evaluate_node(node, q_idx=q, kv_idx=kv, buffers=(xs, ys))
    assert_inside(apply_rule(node, [ia, ib]), values, node.dtype)


@pytest.mark.parametrize("op", INT_BINARY)
@given(st.data())
def test_int_binary(op, data):
    if op is Op.POW:  # int64 powers: small bases, exponents 0..5 (negative ones raise)
        a = data.draw(interval_samples(DType.INT, high=12))
        b = data.draw(interval_samples(DType.INT, low=0, high=5))
    else:
        a = data.draw(interval_samples(DType.INT))
        b = data.draw(interval_samples(DType.INT, nonzero=op in (Op.FLOORDIV, Op.MOD, Op.FMOD)))
    check_binary(op, DType.INT, a, b)


@pytest.mark.parametrize("op", FLOAT_BINARY)
@given(st.data())
def test_float_binary(op, data):
    a = data.draw(interval_samples(DType.FLOAT))
    b = data.draw(interval_samples(DType.FLOAT))
    check_binary(op, DType.FLOAT, a, b)


@pytest.mark.parametrize("op", BOOL_BINARY)
@given(st.data())
def test_bool_binary(op, data):
    a = data.draw(interval_samples(DType.BOOL))
    b = data.draw(interval_samples(DType.BOOL))
    check_binary(op, DType.BOOL, a, b)


@pytest.mark.parametrize("case", [(DType.INT, o) for o in INT_UNARY]
                         + [(DType.FLOAT, o) for o in FLOAT_UNARY] + [(DType.BOOL, Op.NOT)])
@given(st.data())
def test_unary(case, data):
    dtype, op = case
    ia, xs = data.draw(interval_samples(dtype))
    node = ir.unary(op, _leaf(0, dtype, Op.Q_IDX))
    values = evaluate_node(node, q_idx=torch.arange(len(xs)), buffers=(xs,))
    assert_inside(apply_rule(node, [ia]), values, node.dtype)


@pytest.mark.parametrize("case", [(s, t) for s in DType for t in DType if s is not t])
@given(st.data())
def test_cast(case, data):
    source, target = case
    ia, xs = data.draw(interval_samples(source))
    node = ir.cast(_leaf(0, source, Op.Q_IDX), target)
    values = evaluate_node(node, q_idx=torch.arange(len(xs)), buffers=(xs,))
    assert_inside(apply_rule(node, [ia]), values, target)


@pytest.mark.parametrize("case", [(s, t) for s in (DType.INT, DType.FLOAT)
                                  for t in ir.NARROW_TYPES
                                  if s is DType.FLOAT or ir.NARROW_TYPES[t] is DType.INT])
@given(st.sampled_from([1.0, 300.0, 7e4, 3e9]), st.data())
def test_narrow(case, scale, data):
    """float16/bfloat16 rounding (overflow to inf included) and int wrapping (from ints and
    from floats, out-of-range conversions included) stay inside the rule's result."""
    source, name = case
    ia, xs = data.draw(interval_samples(source))
    xs = xs * (scale if source is DType.FLOAT else int(scale))
    ia = _interval(xs.min().item(), xs.max().item())  # the scaled samples, ends included
    node = ir.narrow(_leaf(0, source, Op.Q_IDX), name)
    values = evaluate_node(node, q_idx=torch.arange(len(xs)), buffers=(xs,))
    assert_inside(apply_rule(node, [ia]), values, node.dtype)


@pytest.mark.parametrize("dtype", list(DType))
@given(st.data())
def test_where(dtype, data):
    ic, cs = data.draw(interval_samples(DType.BOOL))
    ia, xs = data.draw(interval_samples(dtype))
    ib, ys = data.draw(interval_samples(dtype))
    n = min(len(cs), len(xs))
    node = ir.where(_leaf(2, DType.BOOL, Op.Q_IDX), _leaf(0, dtype, Op.Q_IDX),
                    _leaf(1, dtype, Op.KV_IDX))
    q, kv = torch.arange(n).view(-1, 1), torch.arange(len(ys)).view(1, -1)
    values = evaluate_node(node, q_idx=q, kv_idx=kv, buffers=(xs[:n], ys, cs[:n]))
    assert_inside(apply_rule(node, [ic, ia, ib]), values, dtype)


MAYBE_NAN = [(_interval(5.0, math.inf), [5.0, 7.0, math.inf, math.nan]),
             (_interval(-math.inf, -5.0), [-math.inf, -6.0, -5.0, math.nan])]


@pytest.mark.parametrize("op", FLOAT_BINARY)
@pytest.mark.parametrize("maybe_nan", range(len(MAYBE_NAN)))
@pytest.mark.parametrize("nan_first", [True, False])
def test_float_binary_of_a_value_that_may_be_nan(op, maybe_nan, nan_first):
    """An interval with an infinite end may hold NaN; no rule may give NaN finite bounds
    (``clamp(x, 0, 10)``, ``1 / x`` with x in [5, inf] are NaN where x is)."""
    interval, points = MAYBE_NAN[maybe_nan]
    nan_side = (interval, torch.tensor(points))
    other = (_interval(2.0, 3.0), torch.tensor([2.0, 3.0]))
    check_binary(op, DType.FLOAT, *((nan_side, other) if nan_first else (other, nan_side)))


@pytest.mark.parametrize("op", FLOAT_UNARY)
@pytest.mark.parametrize("maybe_nan", range(len(MAYBE_NAN)))
def test_float_unary_of_a_value_that_may_be_nan(op, maybe_nan):
    interval, points = MAYBE_NAN[maybe_nan]
    node = ir.unary(op, _leaf(0, DType.FLOAT, Op.Q_IDX))
    xs = torch.tensor(points)
    values = evaluate_node(node, q_idx=torch.arange(len(xs)), buffers=(xs,))
    assert_inside(apply_rule(node, [interval]), values, node.dtype)


def test_decisions_are_tight_on_simple_cases():
    """Soundness alone would pass with 'unknown' everywhere: check the useful answers."""
    q = _leaf(0, DType.INT, Op.Q_IDX)
    kv = _leaf(1, DType.INT, Op.KV_IDX)
    low, high = _interval(0, 9), _interval(10, 19)

    def bounds(op, a, b):
        result = apply_rule(ir.binary(op, q, kv), [a, b])
        return result.lo.item(), result.hi.item()
    assert bounds(Op.LE, low, high) == (1, 1)
    assert bounds(Op.LT, high, low) == (0, 0)
    assert bounds(Op.EQ, _interval(3, 3), _interval(3, 3)) == (1, 1)
    assert bounds(Op.EQ, low, high) == (0, 0)
    assert bounds(Op.MOD, _interval(13, 15), _interval(8, 8)) == (5, 7)
    assert bounds(Op.MOD, _interval(13, 17), _interval(8, 8)) == (0, 7)
    assert bounds(Op.MOD, _interval(13, 17), _interval(20, 30)) == (13, 17)
    assert bounds(Op.FLOORDIV, _interval(-7, 9), _interval(4, 4)) == (-2, 2)
    assert bounds(Op.SUB, low, high) == (-19, -1)


def test_every_op_with_a_rule_is_covered():
    covered = set(INT_BINARY + FLOAT_BINARY + BOOL_BINARY + INT_UNARY + FLOAT_UNARY
                  + [Op.CAST, Op.WHERE, Op.NARROW])
    assert set(RULES) <= covered


def _tables_match_dense(mask_mod, length: int, block: int = 16):
    """flexfa's full and partial tile counts equal those of the dense mask."""
    import flexfa
    dense = flexfa.create_mask(mask_mod, 1, 1, length, length, device="cpu")[0, 0]
    tiles = dense.reshape(length // block, block, length // block, block)
    kept = tiles.sum((1, 3))
    full = (kept == block * block).sum(-1)
    partial = ((kept > 0) & (kept < block * block)).sum(-1)
    mask = flexfa.create_block_mask(mask_mod, None, None, length, length, device="cpu",
                                    BLOCK_SIZE=block)
    assert torch.equal(mask.full_kv_num_blocks[0, 0].long(), full)
    assert torch.equal(mask.kv_num_blocks[0, 0].long(), partial)


def test_int64_overflow_makes_a_value_unknown():
    """Past int64 the value wraps (torch's arithmetic, a float cast past it gives -2**63):
    the rules widened only the end that passed the cap, so ``y * 2**22 > 0`` of a y near
    2**41 stayed 'always true' and a tile keeping half its pairs was marked full (1.83 off
    against the float64 reference in an audit's probe)."""
    def product(b, h, q_idx, kv_idx):
        return ((q_idx + kv_idx) * 2**40 + 1) * 4096 * 1024 > 0

    def cast(b, h, q_idx, kv_idx):
        return ((q_idx + kv_idx).float() * 1e18 + 2).long() > 0

    _tables_match_dense(product, 16)
    _tables_match_dense(cast, 16)


def test_or_bound_near_two_to_the_49():
    """The bound of a | b was 2**ceil(log2(x + 1)) - 1 in float64, which is 2**49 - 1 for
    x = 2**49: ``(q + 2**49 - 127) | kv < 2**49`` had its last query tile marked full though
    its last row keeps nothing (0.29 off)."""
    def near(b, h, q_idx, kv_idx):
        return ((q_idx + (2**49 - 127)) | kv_idx) < 2**49

    _tables_match_dense(near, 128)
    from flexfa.blockmask.intervals import _bit_ceiling
    x = torch.tensor([0.0, 1.0, 2.0, 7.0, 8.0, 2.0**49, 2.0**50 - 1, math.inf],
                     dtype=torch.float64)
    assert _bit_ceiling(x).tolist() == [0.0, 1.0, 3.0, 7.0, 15.0, 2.0**50 - 1, 2.0**50 - 1,
                                        math.inf]
