"""Activation, rounding and other torch functions written as compositions of IR ops.

Each builder takes the input as an IR node (plus the function's Python-number parameters)
and returns the node of torch's value, in the formula torch's CPU kernel uses, so the eager
reference matches torch to the last bits where it can. Kinks follow torch's autograd: the
branch a ``where`` takes at a tie is the one whose derivative torch uses there (``elu`` at 0
uses the negative branch, ``hardsigmoid`` has gradient 0 at +-3, ``hardswish`` 0 at -3 and
1 at 3), and a branch that is not taken never sees an argument whose derivative overflows
(``softplus`` above its threshold). tests/frontend/test_activations.py checks values and
gradients against torch, ties included.

``HANDLERS`` maps torch names (as torch_functions.add takes them) to handlers over proxies.
"""
from __future__ import annotations

import math
import numbers

from . import ir
from .ir import DType, Node, Op
from .proxy import Proxy, find_tracer, lift, result

_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946
_GELU_TANH_BETA = math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5  # torch's kBeta
_GELU_TANH_KAPPA = 0.044715


def _f(value: float) -> Node:
    return ir.const(float(value))


def _float(x: Node) -> Node:
    return ir.cast(x, DType.FLOAT)


def _b(op: Op, a: Node, b: Node) -> Node:
    return ir.binary(op, a, b)


def _u(op: Op, x: Node) -> Node:
    return ir.unary(op, x)


def _where(cond: Node, a: Node, b: Node) -> Node:
    return ir.where(cond, a, b)


# ---- kinks ---------------------------------------------------------------------------------

def relu(x: Node) -> Node:
    """Gradient 0 at 0 (torch differentiates relu through its result: ``result > 0``)."""
    zero = _f(0.0) if x.dtype is DType.FLOAT else ir.const(0)
    return ir.extremum(Op.MAX, x, zero, ir.TIES_NONE)


def hardtanh(x: Node, min_val: float = -1.0, max_val: float = 1.0) -> Node:
    """Gradient 1 strictly inside (min_val, max_val) and for NaN, 0 at and beyond the bounds."""
    if min_val > max_val:
        raise ValueError(f"hardtanh: min_val ({min_val}) cannot be greater than max_val "
                         f"({max_val}), as in torch")
    low = ir.extremum(Op.MAX, x, _f(min_val), ir.TIES_NONE)
    return ir.extremum(Op.MIN, low, _f(max_val), ir.TIES_NONE)


def relu6(x: Node) -> Node:
    return hardtanh(x, 0.0, 6.0)


def leaky_relu(x: Node, negative_slope: float = 0.01) -> Node:
    x = _float(x)
    return _where(_b(Op.LT, _f(0.0), x), x, _b(Op.MUL, x, _f(negative_slope)))


def threshold(x: Node, threshold: float, value: float) -> Node:
    return _where(_b(Op.LE, x, _f(threshold)), _f(value), _float(x))


def hardsigmoid(x: Node) -> Node:
    """relu6(x + 3) / 6; the gradient is 1/6 strictly inside (-3, 3) and 0 elsewhere (NaN too)."""
    x = _float(x)
    inside = _b(Op.AND, _b(Op.LT, _f(-3.0), x), _b(Op.LT, x, _f(3.0)))
    outside = _where(_b(Op.LE, x, _f(-3.0)), _f(0.0),
                     _where(_b(Op.LE, _f(3.0), x), _f(1.0), _b(Op.MUL, x, _f(0.0))))
    return _where(inside, _b(Op.DIV, _b(Op.ADD, x, _f(3.0)), _f(6.0)), outside)


def hardswish(x: Node) -> Node:
    """x * relu6(x + 3) / 6: gradient 0 up to -3 (included), (2x + 3) / 6 below 3, 1 from 3
    and for NaN."""
    x = _float(x)
    middle = _b(Op.DIV, _b(Op.MUL, x, _b(Op.ADD, x, _f(3.0))), _f(6.0))
    top = _b(Op.DIV, _b(Op.MUL, x, _f(6.0)), _f(6.0))
    return _where(_b(Op.LE, x, _f(-3.0)), _b(Op.MUL, x, _f(0.0)),
                  _where(_b(Op.LT, x, _f(3.0)), middle, top))


def elu(x: Node, alpha: float = 1.0, scale: float = 1.0, input_scale: float = 1.0) -> Node:
    """torch's elu family: x * scale above 0, expm1(x * input_scale) * alpha * scale at and
    below 0 (so the gradient at 0 is the negative branch's). The expm1 branch sees 0 where it
    is not taken: above about 88 / input_scale its derivative would overflow, and the zero
    gradient of the branch not taken times inf is a NaN where torch's gradient is scale."""
    x = _float(x)
    at_or_below = _b(Op.LE, x, _f(0.0))
    safe = _where(at_or_below, x, _f(0.0))
    negative = _b(Op.MUL, _u(Op.EXPM1, _b(Op.MUL, safe, _f(input_scale))), _f(alpha * scale))
    return _where(at_or_below, negative, _b(Op.MUL, x, _f(scale)))


def selu(x: Node) -> Node:
    return elu(x, _SELU_ALPHA, _SELU_SCALE)


def celu(x: Node, alpha: float = 1.0) -> Node:
    if alpha == 0:
        raise ValueError("celu: alpha cannot be 0")
    return elu(x, alpha, 1.0, 1.0 / alpha)


# ---- smooth functions ----------------------------------------------------------------------

def silu(x: Node) -> Node:
    x = _float(x)
    return _b(Op.MUL, x, _u(Op.SIGMOID, x))


def gelu(x: Node, approximate: str = "none") -> Node:
    x = _float(x)
    half_x = _b(Op.MUL, x, _f(0.5))
    if approximate == "none":
        erf = _u(Op.ERF, _b(Op.MUL, x, _f(math.sqrt(0.5))))
        return _b(Op.MUL, half_x, _b(Op.ADD, _f(1.0), erf))
    if approximate != "tanh":
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    cube = _b(Op.MUL, _b(Op.MUL, x, x), x)
    inner = _b(Op.MUL, _f(_GELU_TANH_BETA), _b(Op.ADD, x, _b(Op.MUL, _f(_GELU_TANH_KAPPA), cube)))
    return _b(Op.MUL, half_x, _b(Op.ADD, _f(1.0), _u(Op.TANH, inner)))


def softplus(x: Node, beta: float = 1.0, threshold: float = 20.0) -> Node:
    """x where x * beta > threshold, else log1p(exp(x * beta)) / beta; the exp branch sees 0
    where it is not taken, so its derivative cannot overflow into a NaN gradient."""
    x = _float(x)
    scaled = _b(Op.MUL, x, _f(beta))
    linear = _b(Op.LT, _f(threshold), scaled)
    safe = _where(linear, _f(0.0), scaled)
    return _where(linear, x, _b(Op.DIV, _u(Op.LOG1P, _u(Op.EXP, safe)), _f(beta)))


def logsigmoid(x: Node) -> Node:
    """min(x, 0) - log1p(exp(-|x|)); at 0 torch.minimum's half split gives torch's 1/2."""
    x = _float(x)
    return _b(Op.SUB, _b(Op.MIN, x, _f(0.0)),
              _u(Op.LOG1P, _u(Op.EXP, _u(Op.NEG, _u(Op.ABS, x)))))


def mish(x: Node) -> Node:
    """x * tanh(softplus(x)); above softplus's threshold tanh is exactly 1 either way."""
    x = _float(x)
    return _b(Op.MUL, x, _u(Op.TANH, softplus(x)))


def softsign(x: Node) -> Node:
    x = _float(x)
    return _b(Op.DIV, x, _b(Op.ADD, _u(Op.ABS, x), _f(1.0)))


def tanhshrink(x: Node) -> Node:
    x = _float(x)
    return _b(Op.SUB, x, _u(Op.TANH, x))


def logaddexp(a: Node, b: Node) -> Node:
    """max(a, b) + log1p(exp(-|a - b|)), and a where both are the same infinity."""
    a, b = _float(a), _float(b)
    core = _b(Op.ADD, _b(Op.MAX, a, b),
              _u(Op.LOG1P, _u(Op.EXP, _u(Op.NEG, _u(Op.ABS, _b(Op.SUB, a, b))))))
    same_infinity = _b(Op.AND, _b(Op.EQ, _u(Op.ABS, a), _f(math.inf)), _b(Op.EQ, a, b))
    return _where(same_infinity, a, core)


def reciprocal(x: Node) -> Node:
    return _b(Op.DIV, _f(1.0), x)


# ---- rounding ------------------------------------------------------------------------------

def truncate(x: Node) -> Node:
    """Round toward zero (ceil below 0 keeps trunc(-0.5) == -0.0); ints are already whole."""
    if x.dtype is not DType.FLOAT:
        return x
    return _where(_b(Op.LT, x, _f(0.0)), _u(Op.CEIL, x), _u(Op.FLOOR, x))


def frac(x: Node) -> Node:
    return _b(Op.SUB, x, truncate(x))


def round_half_even(x: Node, decimals: int = 0) -> Node:
    """torch.round: to the nearest integer, ties to even, the sign of zero kept; with
    ``decimals`` it rounds x * 10**decimals (x / 10**-decimals) as torch does."""
    if x.dtype is not DType.FLOAT:
        return x
    if decimals:
        scale = _f(10.0 ** abs(decimals))
        inner, outer = (Op.MUL, Op.DIV) if decimals > 0 else (Op.DIV, Op.MUL)
        return _b(outer, round_half_even(_b(inner, x, scale)), scale)
    floor = _u(Op.FLOOR, x)
    rest = _b(Op.SUB, x, floor)  # exact, in [0, 1)
    odd = _b(Op.NE, _b(Op.MOD, floor, _f(2.0)), _f(0.0))
    up = _b(Op.OR, _b(Op.LT, _f(0.5), rest),
            _b(Op.AND, _b(Op.EQ, rest, _f(0.5)), odd))
    rounded = _where(up, _b(Op.ADD, floor, _f(1.0)), floor)
    return _where(_b(Op.EQ, rounded, _f(0.0)), _b(Op.MUL, x, _f(0.0)), rounded)


# ---- handlers ------------------------------------------------------------------------------

def _handler(build, name: str):
    """A handler for ``name(input, *params, inplace=False)``: ``build`` on the input's node;
    the result is typed as torch types it (a float16 input is rounded once, at the end)."""
    def apply(input, *params, inplace=False, **options):
        tracer = find_tracer(input)
        if inplace:
            raise tracer.error(f"{name}(..., inplace=True) modifies its input; mods must be "
                               "pure: use inplace=False")
        for key, value in [*enumerate(params), *options.items()]:
            if isinstance(value, (Proxy, bool)) or not isinstance(value, (numbers.Real, str)):
                raise tracer.error(f"{name}: parameter {key} must be a Python number (or the "
                                   f"documented string), got {type(value).__name__} "
                                   f"{value!r:.40}")
        try:
            node = build(lift(input, tracer), *params, **options)
        except ValueError as exc:
            raise tracer.error(str(exc)) from None
        return result(tracer, node, (input,))
    return apply


def _binary_handler(build):
    def apply(input, other):
        tracer = find_tracer(input, other)
        return result(tracer, build(lift(input, tracer), lift(other, tracer)), (input, other))
    return apply


_UNARY = {
    "relu": relu, "nn.functional.relu": relu, "nn.functional.relu6": relu6,
    "nn.functional.hardtanh": hardtanh, "nn.functional.leaky_relu": leaky_relu,
    "nn.functional.threshold": threshold, "threshold": threshold,
    "nn.functional.hardsigmoid": hardsigmoid, "nn.functional.hardswish": hardswish,
    "nn.functional.elu": elu, "nn.functional.selu": selu, "selu": selu,
    "nn.functional.celu": celu, "celu": celu, "nn.functional.silu": silu,
    "nn.functional.gelu": gelu, "nn.functional.softplus": softplus,
    "nn.functional.logsigmoid": logsigmoid, "nn.functional.mish": mish,
    "nn.functional.softsign": softsign, "nn.functional.tanhshrink": tanhshrink,
    "reciprocal": reciprocal, "trunc": truncate, "fix": truncate, "frac": frac,
    "round": round_half_even,
}
HANDLERS = {name: _handler(build, name.rsplit(".", 1)[-1]) for name, build in _UNARY.items()}
HANDLERS["logaddexp"] = _binary_handler(logaddexp)
