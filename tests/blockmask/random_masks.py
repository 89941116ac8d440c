"""A hypothesis strategy of random mask_mods: expression trees over b, h, q_idx, kv_idx,
constants and captured tensors, built from int, float and bool operations.

A drawn mod is a plain Python function, so it runs both traced (flexfa) and on real torch
index tensors (the dense reference). Every intermediate value is a tensor (or a proxy while
tracing), never a Python number. Divisors are nonzero constants and captured-tensor indices
are clamped into range, so every mod is defined everywhere.
"""
import torch
from hypothesis import strategies as st

VECTOR_LENGTH = 97
_generator = torch.Generator().manual_seed(7)
INT_VECTOR = torch.randint(-5, 6, (VECTOR_LENGTH,), generator=_generator).cumsum(0) // 7
BOOL_VECTOR = torch.rand(VECTOR_LENGTH, generator=_generator) < 0.3
FLOAT_VECTOR = torch.randn(VECTOR_LENGTH, generator=_generator)

_LEAVES = [lambda b, h, q, kv: b, lambda b, h, q, kv: h,
           lambda b, h, q, kv: q, lambda b, h, q, kv: kv]
_ARITHMETIC = [lambda x, y: x + y, lambda x, y: x - y, lambda x, y: x * y,
               torch.maximum, torch.minimum]
_COMPARE = [lambda x, y: x < y, lambda x, y: x <= y, lambda x, y: x == y,
            lambda x, y: x != y, lambda x, y: x >= y, lambda x, y: x > y]
_LOGIC = [lambda x, y: x & y, lambda x, y: x | y, lambda x, y: x ^ y]


def _constant(value):
    return lambda b, h, q, kv: torch.full_like(q, value)


def _read(vector):
    return lambda index: vector[torch.clamp(index, 0, VECTOR_LENGTH - 1)]


def _apply2(t):
    op, f, g = t
    return lambda *a: op(f(*a), g(*a))


def int_exprs(depth: int):
    """Strategies of functions (b, h, q, kv) -> int tensor."""
    leaves = st.one_of(st.sampled_from(_LEAVES), st.integers(-40, 300).map(_constant))
    if depth == 0:
        return leaves
    sub = int_exprs(depth - 1)
    divisor = st.integers(-40, 80).filter(lambda c: c != 0)
    return st.one_of(
        leaves,
        st.tuples(st.sampled_from(_ARITHMETIC), sub, sub).map(_apply2),
        st.tuples(sub, divisor, st.booleans()).map(
            lambda t: (lambda *a: t[0](*a) // t[1]) if t[2] else (lambda *a: t[0](*a) % t[1])),
        sub.map(lambda f: lambda *a: abs(f(*a))),
        sub.map(lambda f: lambda *a: _read(INT_VECTOR)(f(*a))),
        st.tuples(bool_exprs(depth - 1), sub, sub).map(
            lambda t: lambda *a: torch.where(t[0](*a), t[1](*a), t[2](*a))),
        float_exprs(depth - 1).map(lambda f: lambda *a: f(*a).int()),
    )


def float_exprs(depth: int):
    """Strategies of functions (b, h, q, kv) -> float tensor (ints scaled, mixed, squashed)."""
    scale = st.sampled_from([0.5, 0.75, -1.25, 3.0, 0.1])
    from_int = st.tuples(int_exprs(max(depth - 1, 0)), scale).map(
        lambda t: lambda *a: t[0](*a).float() * t[1])
    if depth == 0:
        return from_int
    sub = float_exprs(depth - 1)
    return st.one_of(
        from_int,
        st.tuples(st.sampled_from(_ARITHMETIC), sub, sub).map(_apply2),
        sub.map(lambda f: lambda *a: torch.tanh(f(*a)) * 4.0),
        int_exprs(depth - 1).map(lambda f: lambda *a: _read(FLOAT_VECTOR)(f(*a))),
    )


def bool_exprs(depth: int):
    """Strategies of functions (b, h, q, kv) -> bool tensor."""
    ints = int_exprs(depth)
    comparisons = st.one_of(
        st.tuples(st.sampled_from(_COMPARE), ints, ints).map(_apply2),
        st.tuples(st.sampled_from(_COMPARE), float_exprs(depth), ints).map(_apply2),
        ints.map(lambda f: lambda *a: _read(BOOL_VECTOR)(f(*a))),
    )
    if depth == 0:
        return comparisons
    sub = bool_exprs(depth - 1)
    return st.one_of(
        comparisons,
        st.tuples(st.sampled_from(_LOGIC), sub, sub).map(_apply2),
        sub.map(lambda f: lambda *a: ~f(*a)),
    )


@st.composite
def mask_mods(draw, depth: int = 2):
    body = draw(bool_exprs(depth))

    def random_mask(b, h, q_idx, kv_idx):
        return body(b, h, q_idx, kv_idx)
    return random_mask
