"""Derivatives as IR (flexfa.frontend.grad) against torch.autograd in float64."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexfa.errors import InputError, UnsupportedOpError
from flexfa.frontend import Op, evaluate, index_grids, trace
from flexfa.frontend import grad as grad_module
from flexfa.frontend.grad import check_mask_mod_grad, derive, evaluate_joint

B, H, L, S = 2, 3, 5, 7
F64 = torch.float64


def _grids():
    return index_grids(B, H, L, S)


def _check_against_autograd(traced, scores=None, seed=0):
    """Derived gradients (score and every grad buffer) == torch.autograd of the evaluation."""
    gen = torch.Generator().manual_seed(seed)
    b, h, q, kv = _grids()
    score = scores if scores is not None else torch.randn(B, H, L, S, generator=gen, dtype=F64) * 2
    score = score.clone().requires_grad_(True)
    leaves = [t.detach().to(F64).requires_grad_(t.requires_grad) for t in traced.buffers]
    out = evaluate(traced, score=score, b=b, h=h, q_idx=q, kv_idx=kv, buffers=leaves,
                   float_dtype=F64).expand(B, H, L, S)
    upstream = torch.randn(B, H, L, S, generator=gen, dtype=F64)
    wrt = [score] + [t for t in leaves if t.requires_grad]
    if out.requires_grad:
        expected = torch.autograd.grad(out, wrt, upstream, allow_unused=True)
    else:  # the mod depends on neither the score nor a grad buffer
        expected = [None] * len(wrt)
    joint = derive(traced)
    got_score, got_bufs = evaluate_joint(joint, traced, upstream, score=score.detach(), b=b, h=h,
                                         q_idx=q, kv_idx=kv, buffers=[t.detach() for t in leaves])
    _close(got_score.expand(B, H, L, S), expected[0], "score")
    grad_slots = [i for i, t in enumerate(leaves) if t.requires_grad]
    for slot, want in zip(grad_slots, expected[1:]):
        got = got_bufs.get(slot, torch.zeros_like(leaves[slot]))
        _close(got, want, f"buffer {slot}")
    return joint


def _close(got, want, what):
    if want is None:
        want = torch.zeros_like(got)
    torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9, equal_nan=True,
                               msg=lambda m: f"gradient wrt {what}: {m}")


# ---- one rule at a time -------------------------------------------------------------------

UNARY_MODS = {
    "neg": lambda s: -s, "abs": torch.abs, "sign": torch.sign, "floor": torch.floor,
    "ceil": torch.ceil, "exp": torch.exp, "exp2": torch.exp2,
    "log": lambda s: torch.log(torch.abs(s)),
    "log2": lambda s: torch.log2(torch.abs(s)), "sqrt": lambda s: torch.sqrt(torch.abs(s)),
    "rsqrt": lambda s: torch.rsqrt(torch.abs(s)), "tanh": torch.tanh, "sigmoid": torch.sigmoid,
    "sin": torch.sin, "cos": torch.cos, "tan": torch.tan, "erf": torch.erf,
    "cast_int": lambda s: (s * 3).int() * 1.0 + s, "relu": torch.relu,
    "clamp": lambda s: torch.clamp(s, -0.5, 0.7),
}


@pytest.mark.parametrize("name", sorted(UNARY_MODS))
def test_unary_rule(name):
    fn = UNARY_MODS[name]
    traced = trace(lambda score, b, h, q_idx, kv_idx: fn(score))
    _check_against_autograd(traced)


BINARY_MODS = {
    "add": lambda s, t: s + t, "sub": lambda s, t: s - t, "mul": lambda s, t: s * t,
    "div": lambda s, t: s / t, "mod": lambda s, t: s % t,
    "pow": lambda s, t: torch.abs(s) ** t, "max": torch.maximum, "min": torch.minimum,
    "where": lambda s, t: torch.where(s > t, s * t, s - t),
}


@pytest.mark.parametrize("name", sorted(BINARY_MODS))
def test_binary_rule_score_and_buffer(name):
    """Both operands active: the score and a learnable bias[h, q_idx, kv_idx]."""
    fn = BINARY_MODS[name]
    bias = (torch.randn(H, L, S, dtype=F64) + 0.3).requires_grad_(True)
    traced = trace(lambda score, b, h, q_idx, kv_idx: fn(score, bias[h, q_idx, kv_idx]))
    _check_against_autograd(traced)


def test_float_floordiv_and_rounding_have_zero_gradient():
    """Piecewise constant: no score gradient and no buffer gradient (torch has no derivative
    for floor_divide at all, so this is checked directly)."""
    bias = torch.randn(H, L, S, dtype=F64, requires_grad=True)
    rounding = lambda s, t: torch.floor(s * t) + torch.ceil(s) + torch.sign(t)  # noqa: E731
    for fn in (lambda s, t: s // t, rounding):
        traced = trace(lambda score, b, h, q_idx, kv_idx: fn(score, bias[h, q_idx, kv_idx]))
        joint = derive(traced)
        assert joint.dscore.op is Op.CONST and joint.dscore.arg == 0.0
        assert joint.dloads == ()


def test_max_min_ties_split_the_gradient_like_torch():
    bias = torch.zeros(H, requires_grad=True, dtype=F64)
    ties = torch.zeros(B, H, L, S, dtype=F64)
    ties[..., ::2] = 1.0  # half the entries tie with the bias exactly
    for op in (torch.maximum, torch.minimum):
        traced = trace(lambda score, b, h, q_idx, kv_idx: op(score, bias[h] + 1.0))
        _check_against_autograd(traced, scores=ties)


def test_clamp_relu_and_narrow_ties_agree_with_the_eager_reference():
    """torch.autograd on the eager evaluation (the kernels' reference) follows the same tie
    conventions as the derived graph: clamp gives the input the gradient at its bounds and a
    tensor bound none, relu/hardtanh none; float16 rounding passes the gradient unchanged."""
    bias = torch.zeros(H, requires_grad=True, dtype=F64)
    ties = torch.zeros(B, H, L, S, dtype=F64)
    ties[..., ::2] = 1.0
    ties[..., 1] = -1.0
    mods = [lambda s, t: torch.clamp(s, t + 1.0), lambda s, t: torch.clamp(s, max=t + 1.0),
            lambda s, t: torch.clamp(s, t - 1.0, t + 1.0), lambda s, t: torch.relu(s - 1.0) * t,
            lambda s, t: torch.nn.functional.hardtanh(s) + t,
            lambda s, t: (s * 3.1 + t).half() * 1.5]
    for fn in mods:
        traced = trace(lambda score, b, h, q_idx, kv_idx: fn(score, bias[h]))
        _check_against_autograd(traced, scores=ties)


@pytest.mark.parametrize("exponent", [0.0, 1.0, 2.0, 0.5, -1.5, 3.0])
def test_pow_constant_exponents_including_zero_base(exponent):
    scores = torch.randn(B, H, L, S, dtype=F64)
    scores[..., 0] = 0.0
    traced = trace(lambda score, b, h, q_idx, kv_idx: score ** exponent)
    _check_against_autograd(traced, scores=scores)


def test_pow_non_constant_exponent_special_cases():
    """torch: no base gradient at exponent 0; no exponent gradient at base 0, exponent >= 0."""
    expo = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5], dtype=F64).requires_grad_(True)
    scores = torch.randn(B, H, L, S, dtype=F64).abs()
    scores[..., :3] = 0.0
    traced = trace(lambda score, b, h, q_idx, kv_idx: score ** expo[(q_idx + kv_idx) % 5])
    _check_against_autograd(traced, scores=scores)


def test_every_float_op_has_a_rule():
    no_float_result = {Op.CONST, Op.SCORE, Op.B, Op.H, Op.Q_IDX, Op.KV_IDX, Op.LOAD, Op.LT,
                       Op.LE, Op.EQ, Op.NE, Op.AND, Op.OR, Op.XOR, Op.NOT}
    missing = set(Op) - no_float_result - set(grad_module._RULES)
    assert not missing, f"ops without a derivative rule: {missing}"


# ---- structure of the joint graph ---------------------------------------------------------

def test_tanh_derivative_reuses_the_forward_node():
    traced = trace(lambda score, b, h, q_idx, kv_idx: 30.0 * torch.tanh(score / 30.0))
    joint = derive(traced)
    forward_nodes = {id(n) for n in traced.root.toposort()}
    tanh = next(n for n in traced.root.toposort() if n.op is Op.TANH)
    assert id(tanh) in {id(n) for n in joint.dscore.toposort()}
    assert id(tanh) in forward_nodes
    assert [n.op for n in joint.dscore.toposort()].count(Op.TANH) == 1


def test_softcap_derivative_folds_the_cap_constants():
    # d/ds 30 tanh(s / 30) = (1 - t^2) * 30 / 30: the two constants fold, leaving 1 - t*t
    def derivative_ops(traced):
        joint = _check_against_autograd(traced)
        forward = {id(n) for n in traced.root.toposort()}
        return [n for n in joint.dscore.toposort() if id(n) not in forward]

    nodes = derivative_ops(trace(
        lambda score, b, h, q_idx, kv_idx: 30.0 * torch.tanh(score / 30.0)))
    assert sorted(n.op.name for n in nodes if n.op is not Op.CONST) == ["MUL", "SUB"]  # 1 - t*t
    # a scale that does not cancel stays one multiply by c1 / c2
    nodes = derivative_ops(trace(lambda score, b, h, q_idx, kv_idx: 8.0 * torch.tanh(score / 2.0)))
    assert Op.DIV not in [n.op for n in nodes]
    assert any(n.op is Op.CONST and n.arg == 4.0 for n in nodes)
    # an integer-valued factor divided by a constant (true division, as torch's)
    _check_against_autograd(trace(lambda score, b, h, q_idx, kv_idx: (score / 2) * (kv_idx * 3)))


def test_identity_and_constant_mods():
    joint = derive(trace(lambda score, b, h, q_idx, kv_idx: score))
    assert joint.dscore.op is Op.CONST and joint.dscore.arg == 1.0 and joint.dloads == ()
    joint = derive(trace(lambda score, b, h, q_idx, kv_idx: (q_idx - kv_idx).float()))
    assert joint.dscore.op is Op.CONST and joint.dscore.arg == 0.0


def test_loads_of_one_buffer_at_two_index_sets_are_separate_entries():
    bias = torch.randn(L + S, requires_grad=True, dtype=F64)
    traced = trace(lambda score, b, h, q_idx, kv_idx: score * bias[q_idx] + bias[kv_idx + L])
    joint = _check_against_autograd(traced)
    assert len(joint.dloads) == 2 and joint.grad_slots == (0,)
    assert "d out / d load of buf0" in joint.format()


def test_buffers_without_requires_grad_get_no_entry():
    table = torch.randn(L, S, dtype=F64)
    doc = torch.arange(L + S) // 3
    traced = trace(lambda score, b, h, q_idx, kv_idx:
                   torch.where(doc[q_idx] == doc[kv_idx], score + table[q_idx, kv_idx], score))
    joint = _check_against_autograd(traced)
    assert joint.dloads == ()


def test_learnable_bias_named_variants():
    """The issue's examples, checked against autograd of the Python function itself."""
    rel = torch.randn(L + S - 1, requires_grad=True, dtype=F64)
    table = torch.randn(H, L, S, requires_grad=True, dtype=F64)
    scale = torch.randn(H, requires_grad=True, dtype=F64)
    gate = torch.randn(H, requires_grad=True, dtype=F64)
    scalar = torch.tensor(0.7, requires_grad=True, dtype=F64)

    def mod(score, b, h, q_idx, kv_idx):
        return (scale[h] * score + rel[q_idx - kv_idx + S - 1] + table[h, q_idx, kv_idx]
                + torch.sigmoid(gate[h]) * torch.tanh(score * scalar))

    traced = trace(mod)
    b, h, q, kv = _grids()
    score = torch.randn(B, H, L, S, dtype=F64, requires_grad=True)
    upstream = torch.randn(B, H, L, S, dtype=F64)
    out = mod(score, b, h, q, kv)
    expected = torch.autograd.grad(out, [score, rel, table, scale, gate, scalar], upstream)
    got_score, got = evaluate_joint(derive(traced), traced, upstream, score=score.detach(), b=b,
                                    h=h, q_idx=q, kv_idx=kv,
                                    buffers=[t.detach() for t in traced.buffers])
    _close(got_score, expected[0], "score")
    slots = [next(i for i, t in enumerate(traced.buffers) if t is x)
             for x in (rel, table, scale, gate, scalar)]
    for slot, want in zip(slots, expected[1:]):
        _close(got[slot], want, f"buffer {slot}")


# ---- errors -------------------------------------------------------------------------------

def test_missing_rule_names_the_op(monkeypatch):
    monkeypatch.delitem(grad_module._RULES, Op.ERF)
    traced = trace(lambda score, b, h, q_idx, kv_idx: torch.erf(score) * 2.0)
    with pytest.raises(UnsupportedOpError, match="ERF") as info:
        derive(traced)
    assert isinstance(info.value, NotImplementedError)


def test_inactive_ops_need_no_rule(monkeypatch):
    monkeypatch.delitem(grad_module._RULES, Op.ERF)
    table = torch.randn(L, dtype=F64)  # no grad: erf of it is a constant for the derivative
    traced = trace(lambda score, b, h, q_idx, kv_idx: score * torch.erf(table[q_idx]))
    derive(traced)


def test_mask_mod_with_grad_capture_is_an_error():
    doc = torch.randn(L, requires_grad=True)
    traced = trace(lambda b, h, q_idx, kv_idx: doc[q_idx] > 0.0)
    with pytest.raises(InputError, match="mask_mod .* require grad.*slot 0 of shape \\(5,\\)"):
        check_mask_mod_grad(traced)
    check_mask_mod_grad(trace(lambda b, h, q_idx, kv_idx: doc.detach()[q_idx] > 0.0))
    with pytest.raises(InputError, match="mask mods have no gradient"):
        derive(traced)


def test_integer_buffer_cannot_be_a_grad_slot():
    doc = torch.arange(L)
    traced = trace(lambda score, b, h, q_idx, kv_idx: score + doc[q_idx])
    with pytest.raises(InputError, match="only float tensors get gradients"):
        derive(traced, grad_slots=[0])


# ---- hypothesis: random score_mods --------------------------------------------------------
# A local generator of smooth-ish random mods (no poles: log/sqrt/div see |x| + 0.5).

_SAFE_UNARY = [
    torch.tanh, torch.sigmoid, torch.sin, torch.cos, torch.erf, torch.abs, torch.floor,
    lambda x: torch.exp(torch.tanh(x)), lambda x: torch.log(torch.abs(x) + 0.5),
    lambda x: torch.sqrt(torch.abs(x) + 0.5), lambda x: torch.rsqrt(torch.abs(x) + 0.5),
    lambda x: torch.log2(torch.abs(x) + 0.5), lambda x: torch.exp2(torch.sin(x)), lambda x: -x,
    lambda x: torch.clamp(x, -1.0, 1.5), torch.sign,
]
_SAFE_BINARY = [
    lambda x, y: x + y, lambda x, y: x - y, lambda x, y: x * y,
    lambda x, y: x / (torch.abs(y) + 0.5), torch.maximum, torch.minimum,
    lambda x, y: (torch.abs(x) + 0.5) ** torch.tanh(y), lambda x, y: x % (torch.abs(y) + 0.5),
]


def _make_buffers(seed):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(L + S, generator=gen, dtype=F64).requires_grad_(True),
        torch.randn(H, L, S, generator=gen, dtype=F64).requires_grad_(True),
        torch.randn(H, generator=gen, dtype=F64).requires_grad_(True),
        torch.randn(7, generator=gen, dtype=F64),  # no grad
        torch.tensor(0.3, dtype=F64).requires_grad_(True),
    ]


@st.composite
def int_exprs(draw, depth=2):
    if depth == 0 or draw(st.booleans()):
        name = draw(st.sampled_from(["b", "h", "q", "kv", "const"]))
        if name == "const":
            value = draw(st.integers(-3, 5))
            return lambda env: value
        return lambda env: env[name]
    a, b = draw(int_exprs(depth - 1)), draw(int_exprs(depth - 1))
    op = draw(st.sampled_from(["+", "-", "*", "//"]))
    if op == "+":
        return lambda env: a(env) + b(env)
    if op == "-":
        return lambda env: a(env) - b(env)
    if op == "*":
        return lambda env: a(env) * b(env)
    divisor = draw(st.sampled_from([2, 3, -2]))
    return lambda env: a(env) // divisor


@st.composite
def float_exprs(draw, depth=3):
    if depth == 0 or draw(st.integers(0, 3)) == 0:
        kind = draw(st.sampled_from(["score", "score", "const", "index", "load"]))
        if kind == "score":
            return lambda env: env["score"]
        if kind == "const":
            value = draw(st.floats(-2, 2, allow_nan=False, width=32))
            return lambda env: value
        if kind == "index":
            ix = draw(int_exprs())
            return lambda env: (ix(env) * 0.25 if isinstance(ix(env), int)
                                else ix(env).float() * 0.25)
        slot = draw(st.integers(0, 4))
        ix = [draw(int_exprs()) for _ in range(3)]
        sizes = {0: (L + S,), 1: (H, L, S), 2: (H,), 3: (7,)}

        def load(env, slot=slot, ix=ix):
            bufs = env["buffers"]
            if slot == 4:
                return bufs[4]
            return bufs[slot][tuple(f(env) % n for f, n in zip(ix, sizes[slot]))]
        return load
    shape = draw(st.sampled_from(["unary", "binary", "binary", "where"]))
    if shape == "unary":
        fn, x = draw(st.sampled_from(_SAFE_UNARY)), draw(float_exprs(depth - 1))
        return lambda env: fn(_as_tensor(x(env), env))
    x, y = draw(float_exprs(depth - 1)), draw(float_exprs(depth - 1))
    if shape == "binary":
        fn = draw(st.sampled_from(_SAFE_BINARY))
        return lambda env: fn(_as_tensor(x(env), env), _as_tensor(y(env), env))
    c, d = draw(float_exprs(depth - 1)), draw(float_exprs(depth - 1))
    return lambda env: torch.where(_as_tensor(c(env), env) < _as_tensor(d(env), env),
                                   _as_tensor(x(env), env), _as_tensor(y(env), env))


def _as_tensor(value, env):
    """Python floats into the operand's world (a proxy while tracing, a tensor in eager)."""
    if isinstance(value, (int, float)):
        return env["score"] * 0.0 + value
    return value


@given(expr=float_exprs(), seed=st.integers(0, 2**16))
@settings(max_examples=40)
def test_random_mods_match_autograd(expr, seed):
    buffers = _make_buffers(seed)

    def mod(score, b, h, q_idx, kv_idx):
        env = dict(score=score, b=b, h=h, q=q_idx, kv=kv_idx, buffers=buffers)
        return _as_tensor(expr(env), env)

    _check_against_autograd(trace(mod), seed=seed)


# ---- hypothesis: the shared random-mod strategy (smooth ops, learnable captures) ----------

@given(data=st.data())
@settings(max_examples=25)
def test_shared_random_smooth_mods_match_autograd_of_the_python_function(data):
    """derive + evaluate_joint == torch.autograd of calling the drawn mod directly."""
    from strategies import score_mods

    mod = data.draw(score_mods(B, H, L, S, smooth=True, grad_buffers=True))
    traced = trace(mod)
    b, h, q, kv = _grids()
    score = (torch.randn(B, H, L, S, dtype=F64, generator=torch.Generator().manual_seed(0))
             * 3).requires_grad_(True)
    upstream = torch.randn(B, H, L, S, dtype=F64)
    # the drawn mod's leaf parameters; a captured tensor computed from one while tracing
    # (``torch.tanh(t0)``) is a buffer whose gradient flows on to t0 through torch's graph
    params = [t for t in mod.captured.values() if t.requires_grad]
    out = mod(score, b, h, q, kv).expand(B, H, L, S)
    expected = torch.autograd.grad(out, [score, *params], upstream, allow_unused=True)
    got_score, got = evaluate_joint(derive(traced), traced, upstream, score=score.detach(), b=b,
                                    h=h, q_idx=q, kv_idx=kv,
                                    buffers=[t.detach() for t in traced.buffers])
    # the direct call rounds float32-only subexpressions (e.g. sigmoid(t0[h])) in float32
    tol = dict(rtol=2e-5, atol=1e-5)
    want = expected[0] if expected[0] is not None else torch.zeros_like(score)
    torch.testing.assert_close(got_score.expand(B, H, L, S), want, **tol)
    slots = list(got)
    if not params:
        return
    chained = torch.autograd.grad([traced.buffers[s] for s in slots],
                                  params, [got[s].to(traced.buffers[s].dtype) for s in slots],
                                  allow_unused=True) \
        if slots else [None] * len(params)
    for value, want in zip(chained, expected[1:]):
        value = torch.zeros(()) if value is None else value
        want = torch.zeros_like(value) if want is None else want
        torch.testing.assert_close(value.double().expand_as(want), want.double(), **tol)
