"""Torch functions in mods against torch itself: values of the eager reference and gradients
of the derived joint graph (flexfa.frontend.grad) against torch.autograd on the same mod run
eagerly by torch, in float64, at exact ties and kinks (relu at 0, clamp at its bounds,
hardsigmoid at +-3, softplus at its threshold, round at .5) and at random points."""
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flexfa.errors import TraceError, UnsupportedOpError
from flexfa.frontend import evaluate, index_grids, trace
from flexfa.frontend.grad import derive, evaluate_joint

F = torch.nn.functional
F64 = torch.float64
N = 12  # values per case, along kv_idx

# a captured tensor a mod compares or combines with the score (bounds, second operands)
BIAS = torch.tensor([0.0, 1.0, -1.0, 0.5, 3.0, -3.0, 6.0, 1.3, 2.0, -0.5, 0.25, 20.0], dtype=F64)
LOW = torch.tensor([0.0, -1.0, 1.0, 0.0, -2.0, 2.0, 0.5, -0.5, 0.0, 1.0, -3.0, 0.0], dtype=F64)

UNARY = {
    "torch.relu": torch.relu, "F.relu": F.relu, "relu_method": lambda s: s.relu(),
    "F.relu6": F.relu6, "F.hardtanh": F.hardtanh,
    "F.hardtanh(-2,0.5)": lambda s: F.hardtanh(s, -2.0, 0.5),
    "clamp(min=0)": lambda s: torch.clamp(s, min=0), "clamp(-1,1)": lambda s: s.clamp(-1, 1),
    "clamp(1,-1)": lambda s: torch.clamp(s, 1.0, -1.0), "clip(0,6)": lambda s: s.clip(0, 6),
    "clamp_min": lambda s: torch.clamp_min(s, 0.5), "clamp_max": lambda s: s.clamp_max(0.5),
    "maximum": lambda s: torch.maximum(s, torch.tensor(0.5, dtype=F64)),
    "minimum": lambda s: torch.min(s, torch.tensor(-0.5, dtype=F64)),
    "abs": torch.abs, "sign": torch.sign, "F.leaky_relu": F.leaky_relu,
    "F.leaky_relu(0.2)": lambda s: F.leaky_relu(s, 0.2), "F.elu": F.elu,
    "F.elu(0.5)": lambda s: F.elu(s, alpha=0.5), "F.selu": F.selu, "torch.selu": torch.selu,
    "F.celu(2)": lambda s: F.celu(s, 2.0), "F.celu(0.1)": lambda s: F.celu(s, 0.1), "F.silu": F.silu, "F.gelu": F.gelu,
    "F.gelu(tanh)": lambda s: F.gelu(s, approximate="tanh"), "F.softplus": F.softplus,
    "F.softplus(2,10)": lambda s: F.softplus(s, 2.0, 10.0), "F.logsigmoid": F.logsigmoid,
    "F.mish": F.mish, "F.hardsigmoid": F.hardsigmoid, "F.hardswish": F.hardswish,
    "F.softsign": F.softsign, "F.tanhshrink": F.tanhshrink,
    "F.threshold": lambda s: F.threshold(s, 1.0, 5.0), "square": torch.square,
    "reciprocal": torch.reciprocal, "exp2": torch.exp2, "expm1": torch.expm1,
    "log1p": lambda s: torch.log1p(s.abs()), "special.expm1": torch.special.expm1,
    "rsqrt": lambda s: s.abs().rsqrt(), "sigmoid": torch.sigmoid, "trunc": torch.trunc,
    "fix": lambda s: s.fix(), "frac": torch.frac, "round": torch.round,
    "round(decimals=1)": lambda s: torch.round(s, decimals=1),
    "round(decimals=-1)": lambda s: (s * 10).round(decimals=-1),
    "fmod": lambda s: torch.fmod(s, 1.3), "fmod(-0.7)": lambda s: s.fmod(-0.7),
    "remainder": lambda s: torch.remainder(s, -1.3), "where": lambda s: torch.where(s > 0, s, 0.0),
    "div(trunc)": lambda s: torch.div(s, 0.3, rounding_mode="trunc") + s,
    "div(floor)": lambda s: torch.div(s, 0.3, rounding_mode="floor") + s,
    "add(alpha)": lambda s: torch.add(s, s * s, alpha=0.5),
    "sub(alpha)": lambda s: s.sub(1.5, alpha=2),
}

BINARY = {  # (score, captured value t, captured value u) -> value
    "clamp(t,_)": lambda s, t, u: torch.clamp(s, t),
    "clamp(u,t)": lambda s, t, u: torch.clamp(s, u, t),
    "clamp_min(t)": lambda s, t, u: torch.clamp_min(s, t),
    "clamp_max(t)": lambda s, t, u: torch.clamp_max(s, t),
    "clamp(max=t)": lambda s, t, u: s.clamp(max=t),
    "maximum": lambda s, t, u: torch.maximum(s, t), "minimum": lambda s, t, u: torch.minimum(s, t),
    "max2": lambda s, t, u: torch.max(s, t), "logaddexp": lambda s, t, u: torch.logaddexp(s, t),
    "fmod": lambda s, t, u: torch.fmod(s, t + 4.0),
    "where": lambda s, t, u: torch.where(s >= t, s, t),
}

# values on every kink, bound, threshold and rounding tie of the functions above
SPECIAL = [0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 1.5, 2.5, -2.5, 3.0, -3.0, 6.0, 0.25, 1.3, 2.6,
           -0.7, 20.0, 5.0, 10.0, 30.0, -30.0, 100.0, -100.0, 1e-9, -1e-9, 0.15, -0.15]
VALUES = st.lists(st.one_of(st.sampled_from(SPECIAL), st.floats(-8.0, 8.0, allow_nan=False)),
                  min_size=N, max_size=N)

# for BINARY: learnable captured tensors, indexed by kv_idx inside the mod
BIAS_GRAD = BIAS.clone().requires_grad_(True)
LOW_GRAD = LOW.clone().requires_grad_(True)


def _score(values):
    return torch.tensor(values, dtype=F64).view(1, 1, 1, N)


def _check(mod, score, buffers=()):
    """flexfa's value and gradients == torch's, for ``mod`` run eagerly on ``score``."""
    b, h, q, kv = index_grids(1, 1, 1, N)
    traced = trace(mod)
    score = score.clone().requires_grad_(True)
    want = mod(score, b, h, q, kv)
    got = evaluate(traced, score=score.detach(), b=b, h=h, q_idx=q, kv_idx=kv,
                   float_dtype=F64).expand(want.shape)
    torch.testing.assert_close(got, want.detach().to(F64), rtol=1e-12, atol=1e-14,
                               equal_nan=True, msg=lambda m: f"value: {m}")
    leaves = [t for t in traced.buffers if t.requires_grad]
    upstream = torch.ones_like(want)
    expected = torch.autograd.grad(want, [score, *leaves], upstream, allow_unused=True)
    joint = derive(traced)
    got_score, got_bufs = evaluate_joint(joint, traced, upstream.to(F64), score=score.detach(),
                                         b=b, h=h, q_idx=q, kv_idx=kv,
                                         buffers=[t.detach() for t in traced.buffers])
    slots = [i for i, t in enumerate(traced.buffers) if t.requires_grad]
    for what, got_grad, want_grad in [("score", got_score.expand(want.shape), expected[0])] + [
            (f"buffer {s}", got_bufs.get(s), w) for s, w in zip(slots, expected[1:])]:
        want_grad = torch.zeros_like(got_grad) if want_grad is None else want_grad
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-7, atol=1e-9, equal_nan=True,
                                   msg=lambda m: f"gradient wrt {what}: {m}")


def _unary_mod(fn):
    return lambda score, b, h, q_idx, kv_idx: fn(score)


def _binary_mod(fn):
    return lambda score, b, h, q_idx, kv_idx: fn(score, BIAS_GRAD[kv_idx], LOW_GRAD[kv_idx])


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_at_every_special_point(name):
    mod = _unary_mod(UNARY[name])
    for start in range(0, len(SPECIAL), N):
        chunk = (SPECIAL[start:] + SPECIAL)[:N]
        _check(mod, _score(chunk))


@pytest.mark.parametrize("name", sorted(UNARY))
@given(values=VALUES)
def test_unary_random(name, values):
    _check(_unary_mod(UNARY[name]), _score(values))


@pytest.mark.parametrize("name", sorted(BINARY))
def test_captured_second_operand_on_ties(name):
    """The score equal to the captured bound in some columns: clamp gives the input the
    gradient at a tie and the bound none; maximum/minimum split it."""
    mod = _binary_mod(BINARY[name])
    _check(mod, _score(BIAS.tolist()))  # every column ties
    _check(mod, _score([v + d for v, d in zip(BIAS.tolist(), [0.0, 0.5, -0.5] * 4)]))


@pytest.mark.parametrize("name", sorted(BINARY))
@given(values=VALUES)
def test_captured_second_operand_random(name, values):
    _check(_binary_mod(BINARY[name]), _score(values))


def test_clamp_and_relu_ties_follow_torch_not_maximum():
    """Regression: clamp(min=0) and relu were max(x, 0), whose tie rule gives 0.5 at 0."""
    b, h, q, kv = index_grids(1, 1, 1, 2)
    score = torch.tensor([0.0, 0.0], dtype=F64).view(1, 1, 1, 2)
    for fn, want in ((lambda s: s.clamp(min=0), 1.0), (torch.relu, 0.0), (F.relu6, 0.0),
                     (lambda s: torch.maximum(s, torch.zeros((), dtype=F64)), 0.5)):
        traced = trace(_unary_mod(fn))
        grad, _ = evaluate_joint(derive(traced), traced, torch.ones(1, 1, 1, 2, dtype=F64),
                                 score=score, b=b, h=h, q_idx=q, kv_idx=kv)
        assert grad.flatten().tolist() == [want, want]


def test_new_functions_are_listed_as_supported():
    from flexfa.frontend.trace import supported_functions
    listed = set(supported_functions())
    for name in ("torch.nn.functional.silu", "torch.nn.functional.gelu", "torch.log1p",
                 "torch.expm1", "torch.nn.functional.softplus", "torch.fmod", "torch.round",
                 "torch.Tensor.half", "torch.Tensor.byte", "torch.logaddexp"):
        assert name in listed, name


@pytest.mark.parametrize("call,message", [
    (lambda s: F.gelu(s, approximate="fast"), r"approximate must be 'none' or 'tanh'"),
    (lambda s: F.celu(s, 0.0), r"celu: alpha cannot be 0"),
    (lambda s: F.hardtanh(s, 2.0, 1.0), r"hardtanh: min_val \(2.0\) cannot be greater than "
                                        r"max_val \(1.0\)"),
    (lambda s: F.relu(s, inplace=True), r"relu\(\.\.\., inplace=True\) modifies its input"),
    (lambda s: F.softplus(s, s), r"softplus: parameter 0 must be a Python number"),
    (lambda s: torch.div(s, 2.0, rounding_mode="up"), r"rounding_mode must be None, 'floor'"),
    (lambda s: torch.clamp(s), r"torch.clamp needs min or max"),
    (lambda s: torch.add(s, 1.0, out=None), r"torch.add was called with arguments flexfa does "
                                            r"not support \(got an unexpected keyword argument "
                                            r"'out'\)"),
])
def test_bad_arguments_name_the_function(call, message):
    with pytest.raises(TraceError, match=message):
        trace(_unary_mod(call))


def test_unsupported_function_is_still_an_unsupported_op_error():
    with pytest.raises(UnsupportedOpError, match=r"torch function torch\.atan2 is not supported"):
        trace(_unary_mod(lambda s: torch.atan2(s, s)))


def test_log1p_and_expm1_keep_tiny_arguments_exact():
    tiny = _score([1e-20, -1e-20, 1e-12, 3e-9] + [0.0] * (N - 4))
    _check(_unary_mod(torch.log1p), tiny)
    _check(_unary_mod(torch.expm1), tiny)
    assert math.isfinite(evaluate(trace(_unary_mod(F.softplus)), score=_score([1e4] * N),
                                  float_dtype=F64).max().item())
