"""Edges of the derivative, simplification and activation rules (frontend/grad.py,
simplify.py, activations.py), from a mutation audit: each test fails under the mutant its
docstring names (a rule changed with every other test passing). The simplify and activation
cases compare flexfa's traced (simplified) evaluation with torch running the mod itself: the
kernels' reference goes through the same simplified IR, so only an independent oracle sees a
wrong rewrite."""

import torch

import flexfa
from flexfa.frontend import evaluate, index_grids, trace
from flexfa.frontend.grad import derive, evaluate_joint

F = torch.nn.functional
F64 = torch.float64
B, H, L, S = 1, 2, 4, 8
NAN, INF = float("nan"), float("inf")


def _grids(l=L, s=S):
    return index_grids(B, H, l, s)


def _assert_bitwise_like_torch(mod, score=None, l=L, s=S):
    """flexfa's evaluation of the traced mod == torch running it, in float32, bit for bit
    (NaN where torch has NaN, the sign of zero included)."""
    b, h, q, kv = _grids(l, s)
    if score is None:
        score = torch.randn(B, H, l, s, generator=torch.Generator().manual_seed(0))
    want = mod(score, b, h, q, kv).expand(B, H, l, s)
    got = evaluate(trace(mod), score=score, b=b, h=h, q_idx=q, kv_idx=kv,
                   float_dtype=torch.float32).expand(B, H, l, s)
    want = want.to(got.dtype) if not want.is_floating_point() else want
    if not got.is_floating_point():
        assert torch.equal(got, want.to(got.dtype)), (got, want)
        return
    want = want.to(got.dtype)
    assert torch.equal(got.isnan(), want.isnan()), (got, want)
    same = (got == want) & (got.signbit() == want.signbit()) | want.isnan()
    assert same.all(), (got[~same], want[~same])


# ---- grad.py ------------------------------------------------------------------------------

def test_derivative_of_a_chain_of_constant_divisions():
    """Guards G04 (grad._div folding (x / c1) / c2 like (x * c1) / c2): tanh(tanh(s) / 2 / 3)
    differentiates to 1/6 of the inner derivative, not 3/2."""
    t = torch.randn(S, dtype=F64, requires_grad=True)

    def mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(torch.tanh(score) / 2.0 / 3.0) * 4.0 + score * t[kv_idx] / 4.0 / 0.5

    traced = trace(mod)
    b, h, q, kv = _grids()
    score = torch.randn(B, H, L, S, dtype=F64, requires_grad=True)
    upstream = torch.randn(B, H, L, S, dtype=F64)
    expected = torch.autograd.grad(mod(score, b, h, q, kv), [score, t], upstream)
    got_score, got = evaluate_joint(derive(traced), traced, upstream, score=score.detach(), b=b,
                                    h=h, q_idx=q, kv_idx=kv,
                                    buffers=[x.detach() for x in traced.buffers])
    torch.testing.assert_close(got_score.expand_as(score), expected[0], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(got[0], expected[1], rtol=1e-9, atol=1e-12)


# ---- simplify.py: integer identities ----------------------------------------------------

def test_int_xor_with_minus_one_is_bitwise_not():
    """Guards S10 (x ^ -1 -> -x instead of ~x); the -1 appears only once simplified."""
    _assert_bitwise_like_torch(lambda s, b, h, q, kv: kv ^ (q - q - 1))
    _assert_bitwise_like_torch(lambda s, b, h, q, kv: s + (kv ^ (q - q - 1)))


def test_int_xor_with_itself_is_zero():
    """Guards S17 (x ^ x -> x)."""
    _assert_bitwise_like_torch(lambda s, b, h, q, kv: (kv * 3 + q) ^ (kv * 3 + q))


def test_not_and_neg_do_not_cancel_each_other():
    """Guards S37 (the involution rule firing across ops: ~(-x) -> x, -(~x) -> x)."""
    _assert_bitwise_like_torch(lambda s, b, h, q, kv: ~(-kv))
    _assert_bitwise_like_torch(lambda s, b, h, q, kv: -(~kv))


def test_sign_of_a_negation():
    """Guards S22 (sign(-x) -> sign(x), the abs(-x) rule wrongly extended to sign)."""
    _assert_bitwise_like_torch(lambda s, b, h, q, kv: torch.sign(-(q - kv)))
    _assert_bitwise_like_torch(lambda s, b, h, q, kv: torch.sign(-s))


def test_int_to_float_to_int_rounds_above_2_to_24():
    """Guards S29 (int -> float -> int casts collapsed: float32 rounds ints above 2**24)."""
    # an int op after the round trip: a final cast to float would round again and hide it
    _assert_bitwise_like_torch(
        lambda s, b, h, q, kv: (q * 10000019 + kv).float().long() - (q * 10000019 + kv))


def test_int16_then_int8_wraps_to_int8():
    """Guards S31 (narrow_rules' fits check reversed: the int8 narrowing of an int16 value
    dropped)."""
    _assert_bitwise_like_torch(lambda s, b, h, q, kv: (q * 37 + kv * 1011).short().char())


# ---- simplify.py: float identities (NaN, sign of zero) ---------------------------------

def test_float_self_comparisons_see_nan():
    """Guards S15 (float x <= x -> True) and S16 (float x != x -> False): the NaN test
    idiom (torch.isnan is not supported in mods) on a captured tensor with NaN entries."""
    t = torch.tensor([0.5, NAN, -1.0, NAN, 2.0, 0.0, NAN, 3.0])
    for mod in (lambda s, b, h, q, kv: torch.where(t[kv] != t[kv], 0.0, t[kv]),
                lambda s, b, h, q, kv: torch.where(t[kv] >= t[kv], t[kv], 0.0),
                lambda s, b, h, q, kv: torch.where(t[kv] <= t[kv], t[kv], 0.0),
                lambda s, b, h, q, kv: (s != s) | (t[kv] == t[kv])):
        _assert_bitwise_like_torch(mod)


def test_zero_minus_x_keeps_the_sign_of_zero():
    """Guards S11 (float 0.0 - x -> -x: 0.0 - 0.0 is +0.0, -(0.0) is -0.0)."""
    z = torch.tensor([0.0, -0.0, 1.0, -2.0] * 2)
    _assert_bitwise_like_torch(lambda s, b, h, q, kv: 1.0 / (0.0 - z[kv]))


# ---- activations.py --------------------------------------------------------------------

def test_hardsigmoid_of_nan_is_nan():
    """Guards A06 (hardsigmoid(nan) = 0)."""
    score = torch.full((B, H, L, S), NAN)
    score[..., 0] = 1.0
    _assert_bitwise_like_torch(lambda s, b, h, q, kv: F.hardsigmoid(s), score)


def test_round_keeps_the_sign_of_zero():
    """Guards A25 (round(-0.3) gives +0.0; torch gives -0.0)."""
    score = torch.tensor([-0.3, -0.0, 0.3, -0.5, 0.5, -1.5, 2.5, -0.49]).expand(B, H, L, S)
    _assert_bitwise_like_torch(lambda s, b, h, q, kv: torch.round(s), score.contiguous())
    _assert_bitwise_like_torch(lambda s, b, h, q, kv: 1.0 / torch.round(s), score.contiguous())


def test_logaddexp_with_one_infinite_operand():
    """Guards A19 (logaddexp(a, b) returning a wherever a is infinite:
    logaddexp(-inf, b) is b)."""
    t = torch.tensor([0.5, -1.0, 2.0, -INF, INF, 0.0, -3.0, 1.0])
    score = torch.tensor([-INF, -INF, INF, -INF, INF, -INF, 1.0, -INF]).expand(B, H, L, S)
    _assert_bitwise_like_torch(lambda s, b, h, q, kv: torch.logaddexp(s, t[kv]),
                               score.contiguous())


def test_softplus_gradient_of_large_inputs_is_finite_in_float32():
    """Guards A15 (softplus's exp branch fed the raw input where it is not taken: in float32
    exp overflows above ~88.7 and the zero gradient of that branch times inf is NaN)."""
    mod = lambda score, b, h, q_idx, kv_idx: F.softplus(score * 50.0) * 0.02  # noqa: E731
    traced = trace(mod)
    b, h, q, kv = _grids()
    score = torch.linspace(-5.0, 5.0, B * H * L * S).view(B, H, L, S)
    grad, _ = evaluate_joint(derive(traced), traced, torch.ones(B, H, L, S), score=score, b=b,
                             h=h, q_idx=q, kv_idx=kv, float_dtype=torch.float32)
    want = torch.sigmoid(score.double() * 50.0)
    torch.testing.assert_close(grad.double(), want, rtol=1e-5, atol=1e-6)
    # and end to end: scores up to ~100 (softplus linear there), gradients finite and right
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 16, 16, generator=gen, requires_grad=True) for _ in range(3))
    out = flexfa.flex_attention(q, k, v, score_mod=mod)
    dq, dk = torch.autograd.grad(out.sum(), (q, k))
    q64, k64, v64 = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    scores = q64 @ k64.transpose(-1, -2) / 4.0
    grids = [torch.arange(n).view(*[-1 if i == d else 1 for i in range(4)])
             for d, n in enumerate(scores.shape)]
    ref = torch.softmax(mod(scores, *grids), -1) @ v64
    rq, rk = torch.autograd.grad(ref.sum(), (q64, k64))
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all()
    torch.testing.assert_close(dq.double(), rq, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(dk.double(), rk, rtol=1e-3, atol=1e-3)
