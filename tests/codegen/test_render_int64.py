"""Integer math where int32 would wrap: the nodes ``codegen.ranges`` marks are rendered in int64,
and the kernel's value equals the int64 eager evaluation (interpreter probe kernels)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexfa.codegen.ranges import FLOAT_CAST, Domain, mods_int64_nodes
from flexfa.codegen.render import render
from flexfa.errors import UnsupportedOpError
from flexfa.frontend import evaluate_node, trace
from flexfa.frontend.ir import DType, Node, Op, binary, cast, const, index, unary, where

from render_probe import run_probe

LEAVES = {op: index(op) for op in (Op.B, Op.H, Op.Q_IDX, Op.KV_IDX)}


def _int_root(fn) -> Node:
    """The INT graph of ``fn(b, h, q_idx, kv_idx)``, traced through a comparison with 0."""
    compared = trace(lambda b, h, q_idx, kv_idx: fn(b, h, q_idx, kv_idx) >= 0).root
    return next(s for s in compared.src if s.op is not Op.CONST)


def _grid(length: int) -> torch.Tensor:
    """16 indices in [0, length), both ends among them (repeated when length < 16)."""
    return torch.linspace(0, length - 1, 16).round().long()


def _run(root: Node, tmp_path, domain: Domain, buffers=(), wide=None):
    """(kernel value, int64 eager value) of ``root`` on index grids spanning ``domain``."""
    q, kv = _grid(domain.q_len), _grid(domain.kv_len)
    b, h = domain.batch - 1, domain.heads - 1
    if wide is None:
        dtypes = tuple(t.dtype for t in buffers)
        from flexfa.codegen.ranges import int64_nodes
        wide = int64_nodes([root], dtypes, domain)
    got = run_probe(root, tmp_path, score=torch.zeros(len(q), len(kv)), b=b, h=h, q_idx=q,
                    kv_idx=kv, buffers=buffers, wide=wide)
    want = evaluate_node(root, b=torch.tensor(b), h=torch.tensor(h), q_idx=q.view(-1, 1),
                         kv_idx=kv.view(1, -1), buffers=buffers)
    return got, want.expand(len(q), len(kv)).to(got.dtype)


# (mod, lengths): 16 indices spread over 64 give kv - q in 32..63, where 2 ** (kv - q) wraps
HASHES = {
    "hash_product": (lambda b, h, q, kv: (q * 3000017 * kv + h * 7919) % 1000003, 3000),
    "pow_of_difference": (lambda b, h, q, kv: (2 ** (kv - q)) % 1000, 64),
    "big_constant": (lambda b, h, q, kv: (q + 5_000_000_000) // 3 - kv * 4_000_000_000, 3000),
    "xor_hash": (lambda b, h, q, kv: ((q * 2654435761) ^ (kv * 40503)) % 65536, 3000),
    "nested_floordiv": (lambda b, h, q, kv: ((q * kv * 99991) // 7 - kv) % 13, 3000),
}


@pytest.mark.parametrize("name", sorted(HASHES))
def test_wrapping_int_math_matches_int64_eager(name, tmp_path):
    mod, length = HASHES[name]
    got, want = _run(_int_root(mod), tmp_path, Domain(2, 3, length, length))
    assert torch.equal(got, want), (got - want).abs().max()


def test_negative_integer_exponents_follow_torch(tmp_path):
    """torch.pow of ints: 1 ** -n == 1, (-1) ** -n == +-1, other bases give 0."""
    root = _int_root(lambda b, h, q, kv: (q % 4 - 1) ** (kv % 5 - 3) * 10 + q)
    got, want = _run(root, tmp_path, Domain(1, 1, 16, 16))
    assert torch.equal(got, want), (got, want)


def test_int32_rendering_would_wrap(tmp_path):
    """The regression: without the int64 nodes the same graph wraps at 2**31."""
    root = _int_root(lambda b, h, q_idx, kv_idx: q_idx * 3000017 * kv_idx)
    got, want = _run(root, tmp_path, Domain(1, 1, 3000, 3000), wide=())
    assert not torch.equal(got, want)


def test_int64_captured_values_and_casts(tmp_path):
    table = torch.tensor([3 * 10 ** 9, -(2 ** 40), 7, 2 ** 62 + 3], dtype=torch.int64)

    def reads(score, b, h, q_idx, kv_idx):
        value = table[kv_idx % 4] + q_idx
        return value.float() * 1e-9 + (value % 1000).float()

    traced = trace(reads)
    got, want = _run(traced.root, tmp_path, Domain(1, 1, 64, 64), traced.buffers)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_common_case_renders_as_before():
    traced = trace(lambda s, b, h, q, kv: s + (q - kv) * 0.5 + (q * kv) % 7)
    wide = mods_int64_nodes([traced], Domain(4, 16, 4096, 4096))
    # one mark only: (q - kv) cast to float, computed in float32 (ranges.float_casts)
    assert len(wide) == 1 and wide[0].startswith(FLOAT_CAST)
    lines = "\n".join(render([traced.root], wide=wide).lines)
    assert "int64" not in lines and "(q_idx.to(tl.float32) - kv_idx.to(tl.float32))" in lines


def test_constants_beyond_int64_are_refused():
    root = Node.make(Op.ADD, DType.INT, (index(Op.Q_IDX), const(2 ** 64)))
    with pytest.raises(UnsupportedOpError, match="does not fit in int64"):
        render([root])


# ---- random integer expressions --------------------------------------------------------------

_BINARY = [Op.ADD, Op.SUB, Op.MUL, Op.MAX, Op.MIN, Op.AND, Op.OR, Op.XOR]
_CONSTANTS = st.one_of(st.integers(-50, 50), st.integers(-2 ** 40, 2 ** 40))
_DIVISORS = st.one_of(st.integers(2, 1000), st.integers(-1000, -2), st.just(1),
                      st.integers(2 ** 31, 2 ** 33))


def _extend(children):
    binary_ops = st.builds(lambda op, a, b: binary(op, a, b), st.sampled_from(_BINARY),
                           children, children)
    divisions = st.builds(lambda op, a, d: binary(op, a, const(d)),
                          st.sampled_from([Op.FLOORDIV, Op.MOD]), children, _DIVISORS)
    powers = st.builds(lambda a, e, shift: binary(Op.POW, a, binary(
        Op.SUB, binary(Op.MOD, e, const(70)), const(shift))), children, children,
        st.integers(0, 3))
    unaries = st.builds(lambda op, a: unary(op, a),
                        st.sampled_from([Op.NEG, Op.ABS, Op.SIGN, Op.NOT]), children)
    choices = st.builds(lambda a, b, c, d: where(binary(Op.LT, a, b), c, d),
                        children, children, children, children)
    return st.one_of(binary_ops, divisions, powers, unaries, choices)


# leaves, constants and scaled leaves (q_idx * 3000017: hashes), so that int32 often wraps
_LEAF_EXPRS = st.sampled_from(list(LEAVES.values()))
_INT_EXPRS = st.recursive(
    st.one_of(_LEAF_EXPRS, _CONSTANTS.map(const),
              st.builds(lambda leaf, c: binary(Op.MUL, leaf, const(c)), _LEAF_EXPRS,
                        st.integers(2, 2 ** 24))),
    _extend, max_leaves=7).filter(lambda n: n.op is not Op.CONST)


@given(_INT_EXPRS, st.integers(1, 8), st.integers(1, 16), st.integers(1, 1 << 22),
       st.integers(1, 1 << 22), st.booleans())
def test_random_int_expressions_match_int64_eager(tmp_path_factory, root, batch, heads, q_len,
                                                   kv_len, as_float):
    """Kernel == int64 eager evaluation over random expressions and lengths, as INT values
    and through an INT -> FLOAT cast."""
    if as_float:
        root = cast(root, DType.FLOAT)
    got, want = _run(root, tmp_path_factory.mktemp("probe"), Domain(batch, heads, q_len, kv_len))
    assert torch.equal(got, want), (got, want)


# the random trees above draw their binary op from one list: CI's 15 examples reached 4 of
# _BINARY's 8, so each op is also drawn at the root of its own expressions
@pytest.mark.parametrize("op", _BINARY, ids=lambda op: op.name)
@settings(max_examples=3)
@given(a=_INT_EXPRS, b=_INT_EXPRS, q_len=st.integers(1, 1 << 22), kv_len=st.integers(1, 1 << 22))
def test_each_binary_op_matches_int64_eager(tmp_path_factory, op, a, b, q_len, kv_len):
    got, want = _run(binary(op, a, b), tmp_path_factory.mktemp("probe"),
                     Domain(2, 3, q_len, kv_len))
    assert torch.equal(got, want), (op, got, want)
