"""simplify: every rewrite is exact (random IR trees against evaluate in float32, bit for bit,
nan and the sign of zero included), and the rules do what their table says."""
import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from flexfa.frontend import evaluate_node, index_grids, ir, simplify, trace
from flexfa.frontend.ir import DType, Op
from flexfa.frontend.simplify import RULES

B, H, L, S = 2, 2, 3, 4
NAN, INF = float("nan"), float("inf")
_SPECIAL = {DType.BOOL: [True, False], DType.INT: [0, 1, -1, 2, 3, -7],
            DType.FLOAT: [0.0, -0.0, 1.0, -1.0, 0.5, NAN, INF, -INF, 2.5]}
_FLOAT_BUF = torch.tensor([0.0, -0.0, NAN, INF, -1.5, 2.0, 0.25], dtype=torch.float64)
_INT_BUF = torch.tensor([0, -3, 5, 1, -1, 2, 7])
_BUFFERS = (_FLOAT_BUF, _INT_BUF)


def _leaf(draw):
    kind = draw(st.sampled_from(["const", "const", "index", "score", "load"]))
    if kind == "const":
        dtype = draw(st.sampled_from(list(DType)))
        return ir.const(draw(st.sampled_from(_SPECIAL[dtype])), dtype)
    if kind == "index":
        return ir.index(draw(st.sampled_from(ir.INDEX_LEAVES)))
    if kind == "score":
        return ir.score()
    slot = draw(st.integers(0, 1))
    idx = ir.binary(Op.MOD, ir.index(draw(st.sampled_from([Op.Q_IDX, Op.KV_IDX]))), ir.const(7))
    return ir.load(slot, (idx,), DType.FLOAT if slot == 0 else DType.INT)


def _as_bool(node):
    if node.dtype is DType.FLOAT:  # float -> int casts of nan are undefined: compare instead
        return ir.binary(Op.LT, node, ir.const(0.5))
    return ir.cast(node, DType.BOOL)


@st.composite
def ir_trees(draw, depth=4):
    """Random IR graphs rich in constants and repeated subtrees, so that rules fire."""
    if depth == 0 or draw(st.integers(0, 4)) == 0:
        return _leaf(draw)
    a = draw(ir_trees(depth - 1))
    b = a if draw(st.integers(0, 3)) == 0 else draw(ir_trees(depth - 1))  # x op x
    kind = draw(st.sampled_from(["binary", "binary", "unary", "where", "cast"]))
    if kind == "binary":
        op = draw(st.sampled_from(sorted(ir.BINARY | ir.COMPARISONS, key=lambda o: o.value)))
        # float max/min: torch picks the sign of max(0.0, -0.0) differently on broadcast and
        # full tensors, so those stay out of bit-exact comparisons (tested by hand below)
        if op in (Op.AND, Op.OR, Op.XOR, Op.MAX, Op.MIN):
            a, b = (_as_bool(a), _as_bool(b)) if DType.FLOAT in (a.dtype, b.dtype) else (a, b)
        if op is Op.POW and ir.promote(a.dtype, b.dtype) is not DType.FLOAT:
            b = ir.const(draw(st.integers(0, 3)))  # no negative integer powers
        return ir.binary(op, a, b)
    if kind == "unary":
        op = draw(st.sampled_from(sorted(ir.FLOAT_UNARY | ir.SAME_TYPE_UNARY,
                                         key=lambda o: o.value)))
        if op is Op.NOT and a.dtype is DType.FLOAT or op is Op.NEG and a.dtype is DType.BOOL:
            a = _as_bool(a) if op is Op.NOT else ir.cast(a, DType.INT)
        return ir.unary(op, a)
    if kind == "where":
        return ir.where(_as_bool(draw(ir_trees(depth - 1))), a, b)
    target = draw(st.sampled_from(list(DType)))
    if a.dtype is DType.FLOAT and target is DType.INT:
        target = DType.BOOL
    return ir.cast(a, target)


def _evaluate(root, float_dtype=torch.float32):
    """``root`` on every index and special scores, with floats in ``float_dtype`` (float32:
    the kernels' and torch's arithmetic, which folding follows since the forty-fourth
    session; it folded in float64, so (x - x + 1).float() * 0.1 * 3 == 0.3 was False)."""
    b, h, q, kv = index_grids(B, H, L, S)
    gen = torch.Generator().manual_seed(0)
    specials = torch.tensor(_SPECIAL[DType.FLOAT], dtype=float_dtype)
    score = specials[torch.randint(0, len(specials), (B, H, L, S), generator=gen)]
    value = evaluate_node(root, score=score, b=b, h=h, q_idx=q, kv_idx=kv, buffers=_BUFFERS,
                          float_dtype=float_dtype)
    return value.expand(B, H, L, S)


def _assert_identical(got, expected):
    assert got.dtype == expected.dtype
    if not expected.dtype.is_floating_point:
        assert torch.equal(got, expected)
        return
    assert torch.equal(got.isnan(), expected.isnan())
    same = (got == expected) & (got.signbit() == expected.signbit())
    assert (same | expected.isnan()).all()


def _operations(root):
    return sum(node.op is not Op.CONST for node in root.toposort())


@given(ir_trees())
@settings(max_examples=100)
def test_simplify_is_exact_on_random_trees(root):
    try:
        expected = _evaluate(root)
    except RuntimeError:  # an integer division by zero somewhere: nothing to compare
        assume(False)
    simple = simplify(root)
    assert simple.dtype is root.dtype
    assert _operations(simple) <= _operations(root)
    assert simplify(simple) is simple  # a fixed point
    _assert_identical(_evaluate(simple), expected)


def test_every_non_leaf_op_folds_like_evaluation():
    q = ir.index(Op.Q_IDX)
    for op in sorted(ir.BINARY | ir.COMPARISONS, key=lambda o: o.value):
        for a, b in [(7, -2), (-7.5, 2.0), (False, True), (5, 3)]:
            if op in (Op.AND, Op.OR, Op.XOR) and isinstance(a, float):
                continue
            node = ir.binary(op, ir.const(a), ir.const(b))
            folded = simplify(node)
            assert folded.op is Op.CONST, op
            _assert_identical(_evaluate(folded), _evaluate(node))
    for op in sorted(ir.FLOAT_UNARY | ir.SAME_TYPE_UNARY, key=lambda o: o.value):
        for value in (0.7, -2.5, 3) if op is not Op.NOT else (True, 6):
            node = ir.unary(op, ir.const(value))
            assert simplify(node).op is Op.CONST, op
            _assert_identical(_evaluate(simplify(node)), _evaluate(node))
    assert simplify(ir.binary(Op.FLOORDIV, ir.const(7), ir.const(-2))) is ir.const(-4)
    assert simplify(ir.binary(Op.MOD, ir.const(-7), ir.const(3))) is ir.const(2)
    assert simplify(ir.cast(ir.binary(Op.ADD, q, ir.const(-2.7)), DType.INT)).op is Op.CAST
    assert simplify(ir.Node.make(Op.CAST, DType.INT, (ir.const(-2.7),))) is ir.const(-2)
    exp2 = simplify(ir.unary(Op.EXP, ir.const(2.0)))
    assert exp2.arg == torch.exp(torch.tensor(2.0, dtype=torch.float32)).item()


def test_folding_leaves_division_by_zero_alone():
    node = ir.binary(Op.FLOORDIV, ir.const(1), ir.const(0))
    assert simplify(node) is node


def _body(fn):
    """The traced (and simplified) IR of ``fn`` without the header line."""
    return trace(fn).format().split("\n", 1)[1]


_RULE_CASES = [  # (what, mod, expected listing)
    ("offsets meet in one add", lambda b, h, q, kv: q - kv + 100 - 1 >= 99,
     "%0: int = sub(q_idx, kv_idx)\n%1: int = add(%0, 99)\n%2: bool = le(99, %1)\nreturn %2"),
    ("where on a constant", lambda b, h, q, kv: torch.where(h <= h, q >= kv, q < kv),
     "%0: bool = le(kv_idx, q_idx)\nreturn %0"),
    ("double not", lambda b, h, q, kv: ~~(q >= kv), "%0: bool = le(kv_idx, q_idx)\nreturn %0"),
    ("not of an int comparison", lambda b, h, q, kv: ~(q < kv),
     "%0: bool = le(kv_idx, q_idx)\nreturn %0"),
    ("and/or with constants", lambda b, h, q, kv: ((q >= kv) & True) | False,
     "%0: bool = le(kv_idx, q_idx)\nreturn %0"),
    ("comparisons of identical ints", lambda b, h, q, kv: (q == q) & (kv <= kv) & ~(h < h),
     "return True"),
    ("x - x for ints", lambda b, h, q, kv: (q - q) == 0, "return True"),
    ("x * 0 for ints", lambda b, h, q, kv: q * 0 + kv > 3, "%0: bool = lt(3, kv_idx)\nreturn %0"),
    ("equal where branches", lambda b, h, q, kv: torch.where(h > 0, q >= kv, q >= kv),
     "%0: bool = le(kv_idx, q_idx)\nreturn %0"),
    ("bool where is logic", lambda b, h, q, kv: torch.where(h > 0, q >= kv, False),
     "%0: bool = lt(0, h)\n%1: bool = le(kv_idx, q_idx)\n%2: bool = and(%0, %1)\nreturn %2"),
    ("x * 1, x / 1, x - 0.0 for floats", lambda s, b, h, q, kv: (s * 1.0) / 1 - 0.0,
     "return score"),
    ("x + 0.0 kept: -0.0 + 0.0 is +0.0", lambda s, b, h, q, kv: s + 0.0,
     "%0: float = add(score, 0.0)\nreturn %0"),
    ("x * 0.0 kept: nan * 0 is nan", lambda s, b, h, q, kv: s * 0.0,
     "%0: float = mul(score, 0.0)\nreturn %0"),
    ("x - x kept for floats", lambda s, b, h, q, kv: s - s,
     "%0: float = sub(score, score)\nreturn %0"),
    ("bool -> int -> float is one cast", lambda s, b, h, q, kv: s + (q >= kv).int().float(),
     "%0: bool = le(kv_idx, q_idx)\n%1: float = cast(%0)\n%2: float = add(score, %1)\n"
     "return %2"),
    ("constants go right", lambda s, b, h, q, kv: 2.0 * s, "%0: float = mul(score, 2.0)\n"
     "return %0"),
    ("constant folding in the graph", lambda b, h, q, kv: q >= torch.full_like(q, 7) // -2,
     "%0: bool = le(-4, q_idx)\nreturn %0"),
]


@pytest.mark.parametrize("what,fn,expected", _RULE_CASES, ids=[c[0] for c in _RULE_CASES])
def test_rule_examples(what, fn, expected):
    assert _body(fn) == expected


def test_reads_removed_by_simplification_drop_their_buffers():
    ibias = torch.arange(10)
    fbias = torch.randn(10)

    def mod(score, b, h, q_idx, kv_idx):
        return score + 0 * ibias[q_idx] + fbias[kv_idx]

    traced = trace(mod)
    assert traced.buffers == (fbias,)
    assert "buf0[kv_idx]" in traced.format()


def test_every_rule_keeps_the_dtype_and_the_table_covers_all_non_leaf_ops():
    non_leaf = {op for op in Op if op not in ir.LEAVES and op is not Op.LOAD}
    assert set(RULES) == non_leaf
    assert all(RULES[op][0].__name__ == "fold" for op in non_leaf)


def test_float_max_min_rules():
    score, zero = ir.score(), ir.const(0.0)
    assert simplify(ir.binary(Op.MAX, score, score)) is score
    kept = ir.binary(Op.MAX, zero, score)  # not commuted: the sign of max(0.0, -0.0)
    assert simplify(kept) is kept
    nested = ir.binary(Op.MIN, ir.binary(Op.MIN, score, ir.const(1.0)), ir.const(2.0))
    assert simplify(nested) is nested
    q = ir.index(Op.Q_IDX)
    int_nested = ir.binary(Op.MIN, ir.binary(Op.MIN, q, ir.const(1)), ir.const(2))
    assert simplify(int_nested) is ir.binary(Op.MIN, q, ir.const(1))


def test_nan_constants_are_not_compared_equal_to_themselves():
    nan = ir.const(NAN)
    assert simplify(ir.binary(Op.EQ, ir.score(), ir.score())).op is Op.EQ
    assert simplify(ir.binary(Op.EQ, nan, nan)) is ir.const(False)
    assert math.isnan(simplify(ir.binary(Op.MUL, nan, ir.const(0.0))).arg)


def test_constants_fold_in_float32_as_torch_computes():
    """A subtree simplification turns into constants folds in float32, as torch and the
    kernels compute it: (x - x + 1).float() * 0.1 * 3 == 0.3 and (x - x + 16777217).float()
    == 16777216.0 are True in torch and were False folded in float64."""
    q = ir.index(Op.Q_IDX)

    def constant(value: int):  # q - q + value: a constant only once simplified
        return ir.binary(Op.ADD, ir.binary(Op.SUB, q, q), ir.const(value))

    tenth = ir.binary(Op.MUL, ir.binary(Op.MUL, ir.cast(constant(1), DType.FLOAT),
                                        ir.const(0.1)), ir.const(3))
    for root in (ir.binary(Op.EQ, tenth, ir.const(0.3)),
                 ir.binary(Op.EQ, ir.cast(constant(16777217), DType.FLOAT),
                           ir.const(16777216.0))):
        folded = simplify(root)
        assert folded is ir.const(True)
        assert bool(_evaluate(root).all())

