"""Derivatives of a score_mod as IR: the joint graph the backward kernels render.

Reverse mode over the DAG with one derivative rule per op (``_RULES``). The seed is 1.0, so
the results are plain partial derivatives of the mod's output:

* ``dscore``: d out / d score;
* ``dloads``: for every ``LOAD`` of a float buffer that requires grad, d out / d (the loaded
  element). The kernel scatter-adds ``dS * dload`` into that buffer's gradient at the load's
  indices; one buffer read at several index sets gives several entries.

Derivative nodes are built with the same hash-consing constructors as the forward, so
``1 - tanh(x)**2`` reuses the forward ``tanh(x)`` node: common subexpressions between the
forward and the joint graph are shared for free. Ties and kinks follow torch's autograd
(``torch.maximum`` splits the gradient in half on ties, ``clamp`` gives the input all of it,
``relu``/``hardtanh`` none: see ``_extremum``; ``abs``/``sign`` give 0 at 0; ``pow`` follows
torch's special cases at a zero exponent and a zero base).

Mask mods have no gradient; ``check_mask_mod_grad`` is the early error for a mask_mod that
reads a captured tensor requiring grad.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from ..errors import InputError, UnsupportedOpError, dims
from . import ir
from .evaluate import evaluate_node
from .ir import DType, Node, Op
from .simplify import simplify
from .trace import MASK_MOD, SCORE_MOD, TracedMod

# ---- small folding constructors -------------------------------------------------------
# Derivatives are full of 1.0 factors and 0.0 terms; folding them keeps rendered kernels
# lean. ``None`` stands for an exact zero (no contribution).

_ONE = 1.0


def _is_const(node: Node, value: float) -> bool:
    return node.op is Op.CONST and node.arg == value


def _f(value: float) -> Node:
    return ir.const(float(value), DType.FLOAT)


def _add(a: Node | None, b: Node | None) -> Node | None:
    if a is None:
        return b
    if b is None:
        return a
    return ir.binary(Op.ADD, a, b)


def _mul(a: Node | None, b: Node | None) -> Node | None:
    if a is None or b is None:
        return None
    if _is_const(a, _ONE):
        return b
    if _is_const(b, _ONE):
        return a
    if _is_const(a, -_ONE):
        return _neg(b)
    if _is_const(b, -_ONE):
        return _neg(a)
    if a.op is Op.CONST and b.op is Op.CONST:
        return _f(a.arg * b.arg)
    return ir.binary(Op.MUL, a, b)


def _div(a: Node | None, b: Node) -> Node | None:
    if a is None:
        return None
    if _is_const(b, _ONE):
        return a
    if b.op is Op.CONST and b.arg != 0 and a.op is Op.MUL:
        # (x * c1) / c2 -> x * (c1 / c2): the chain rule through ``c * f(score / c)`` (softcap)
        # gives (f' * c) / c, two multiplies per score that fold to none
        x, c = a.src
        if x.op is Op.CONST:
            x, c = c, x
        if c.op is Op.CONST:
            return _mul(x, _f(c.arg / b.arg))
    return ir.binary(Op.DIV, a, b)


def _neg(a: Node | None) -> Node | None:
    if a is None:
        return None
    if a.op is Op.CONST:
        return _f(-a.arg)
    if a.op is Op.NEG:
        return a.src[0]
    return ir.unary(Op.NEG, a)


def _where(cond: Node, a: Node | None, b: Node | None) -> Node | None:
    if a is None and b is None:
        return None
    zero = _f(0.0)
    return ir.where(cond, zero if a is None else a, zero if b is None else b)


# ---- derivative rules -----------------------------------------------------------------
# rule(node, g) -> one contribution per source (None where the source gets nothing);
# ``g`` is the adjoint of ``node`` (d out / d node).

def _no_grad(node, g):
    return (None,) * len(node.src)


def _pow(node, g):
    base, exponent = node.src
    if exponent.op is Op.CONST:
        c = exponent.arg
        if c == 0:
            return None, None
        power = base if c == 2 else (_f(1.0) if c == 1 else ir.binary(Op.POW, base, _f(c - 1)))
        return _mul(g, _mul(_f(c), power)), None
    zero = _f(0.0)
    # torch: d/dbase is 0 where the exponent is 0; d/dexponent is 0 where base == 0 and
    # exponent >= 0 (the limit of x**e * log x)
    dbase = _mul(g, _mul(exponent, ir.binary(Op.POW, base, ir.binary(Op.SUB, exponent, _f(1.0)))))
    dbase = _where(ir.binary(Op.EQ, exponent, zero), None, dbase)
    # two selects, not one on (base == 0) & (0 <= exponent): under the Triton interpreter a
    # tile's & with a comparison of a float scalar (an exponent read per head, p[h]) fails
    # (its comparison keeps the float dtype, and the broadcast makes floats of it)
    dexp = _mul(node, ir.unary(Op.LOG, base))
    dexp = _mul(g, _where(ir.binary(Op.EQ, base, zero),
                          _where(ir.binary(Op.LE, zero, exponent), None, dexp), dexp))
    return dbase, dexp


def _extremum(is_max: bool):
    """MAX or MIN (a = the input, b = the bound), by the node's ties convention:
    TIES_SPLIT (torch.maximum/minimum): a tie splits the gradient in half;
    TIES_CLAMP (torch.clamp): a gets it where it is on the kept side or ties, b where a is
    strictly beyond it; NaN gives neither any;
    TIES_NONE (relu, hardtanh): a gets it where it is strictly on the kept side or NaN."""
    def rule(node, g):
        a, b = node.src
        a_wins = ir.binary(Op.LT, b, a) if is_max else ir.binary(Op.LT, a, b)
        b_wins = ir.binary(Op.LT, a, b) if is_max else ir.binary(Op.LT, b, a)
        if node.arg == ir.TIES_CLAMP:
            a_kept = ir.binary(Op.LE, b, a) if is_max else ir.binary(Op.LE, a, b)
            return _where(a_kept, g, None), _where(b_wins, g, None)
        if node.arg == ir.TIES_NONE:
            a_lost = ir.binary(Op.LE, a, b) if is_max else ir.binary(Op.LE, b, a)
            return _where(a_lost, None, g), _where(b_wins, g, None)
        tie, half = ir.binary(Op.EQ, a, b), _mul(g, _f(0.5))
        return (_where(tie, half, _where(a_wins, g, None)),
                _where(tie, half, _where(b_wins, g, None)))
    return rule


def _mod(node, g):
    a, b = node.src  # a - b * floor(a / b)
    return g, _neg(_mul(g, ir.unary(Op.FLOOR, ir.binary(Op.DIV, a, b))))


def _fmod(node, g):
    a, b = node.src  # a - b * trunc(a / b), as torch differentiates it
    quotient = ir.binary(Op.DIV, a, b)
    trunc = ir.where(ir.binary(Op.LT, quotient, _f(0.0)), ir.unary(Op.CEIL, quotient),
                     ir.unary(Op.FLOOR, quotient))
    return g, _neg(_mul(g, trunc))


_LN2 = math.log(2.0)

_RULES = {
    Op.ADD: lambda n, g: (g, g),
    Op.SUB: lambda n, g: (g, _neg(g)),
    Op.MUL: lambda n, g: (_mul(g, n.src[1]), _mul(g, n.src[0])),
    Op.DIV: lambda n, g: (_div(g, n.src[1]), _neg(_div(_mul(g, n), n.src[1]))),
    Op.POW: _pow,
    Op.MAX: _extremum(is_max=True),
    Op.MIN: _extremum(is_max=False),
    Op.MOD: _mod,
    Op.FMOD: _fmod,
    Op.FLOORDIV: _no_grad,
    Op.WHERE: lambda n, g: (None, _where(n.src[0], g, None), _where(n.src[0], None, g)),
    Op.CAST: _no_grad,  # FLOAT -> INT/BOOL: no gradient, like torch's integer results
    # float16/bfloat16 rounding passes the gradient on unchanged, as torch's .half() does
    # (torch then rounds the gradient itself to float16; the kernels keep it in float32)
    Op.NARROW: lambda n, g: (g,),
    Op.NEG: lambda n, g: (_neg(g),),
    Op.ABS: lambda n, g: (_mul(g, ir.unary(Op.SIGN, n.src[0])),),
    Op.SIGN: _no_grad,
    Op.DETACH: _no_grad,
    Op.FLOOR: _no_grad,
    Op.CEIL: _no_grad,
    Op.EXP: lambda n, g: (_mul(g, n),),
    Op.EXP2: lambda n, g: (_mul(g, _mul(n, _f(_LN2))),),
    Op.EXPM1: lambda n, g: (_mul(g, ir.binary(Op.ADD, n, _f(1.0))),),
    Op.LOG1P: lambda n, g: (_div(g, ir.binary(Op.ADD, n.src[0], _f(1.0))),),
    Op.LOG: lambda n, g: (_div(g, n.src[0]),),
    Op.LOG2: lambda n, g: (_div(g, _mul(n.src[0], _f(_LN2))),),
    Op.SQRT: lambda n, g: (_div(g, _mul(_f(2.0), n)),),
    Op.RSQRT: lambda n, g: (_mul(g, _mul(_f(-0.5), _mul(n, _mul(n, n)))),),
    Op.TANH: lambda n, g: (_mul(g, ir.binary(Op.SUB, _f(1.0), _mul(n, n))),),
    Op.SIGMOID: lambda n, g: (_mul(g, _mul(n, ir.binary(Op.SUB, _f(1.0), n))),),
    Op.SIN: lambda n, g: (_mul(g, ir.unary(Op.COS, n.src[0])),),
    Op.COS: lambda n, g: (_neg(_mul(g, ir.unary(Op.SIN, n.src[0]))),),
    Op.TAN: lambda n, g: (_mul(g, ir.binary(Op.ADD, _f(1.0), _mul(n, n))),),
    Op.ERF: lambda n, g: (_mul(g, _mul(_f(2.0 / math.sqrt(math.pi)),
                                       ir.unary(Op.EXP, _neg(_mul(n.src[0], n.src[0]))))),),
}


# ---- reverse mode ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class JointGraph:
    """A score_mod's forward root with its derivatives (all nodes share one hash-consed DAG)."""

    forward: Node
    dscore: Node  # d out / d score (a FLOAT constant 0.0 when out does not depend on score)
    dloads: tuple[tuple[Node, Node], ...]  # (LOAD node, d out / d loaded element)

    @property
    def grad_slots(self) -> tuple[int, ...]:
        """Buffer slots that receive a gradient, in order of first appearance."""
        return tuple(dict.fromkeys(load.arg for load, _ in self.dloads))

    def format(self) -> str:
        parts = [f"d out / d score:\n{ir.format_ir(self.dscore)}"]
        for load, grad in self.dloads:
            parts.append(f"d out / d load of buf{load.arg} at\n{ir.format_ir(load)}\n"
                         f"is:\n{ir.format_ir(grad)}")
        return "\n".join(parts)


def derive(traced: TracedMod, grad_slots=None) -> JointGraph:
    """The joint graph of a score_mod: d out / d score and d out / d each grad-buffer load.

    ``grad_slots`` are the buffer slots to differentiate (default: the float captured tensors
    that require grad). Raises ``UnsupportedOpError`` naming the op when a node on a path from
    score or a grad buffer to the output has no derivative rule.
    """
    if traced.kind != SCORE_MOD:
        raise InputError(f"derive needs a score_mod, got the {traced.kind} {traced.name!r}; "
                         "mask mods have no gradient")
    slots = frozenset(traced.grad_buffers if grad_slots is None else grad_slots)
    for slot in slots:
        if not traced.buffers[slot].dtype.is_floating_point:
            raise InputError(f"in mod {traced.name!r}: captured tensor {slot} has dtype "
                             f"{traced.buffers[slot].dtype}; only float tensors get gradients")
    return joint_of(traced.root, slots, traced.name)


def joint_of(root: Node, grad_slots=frozenset(), name: str = "mod") -> JointGraph:
    """The joint graph of the score_mod graph ``root`` for the buffer slots ``grad_slots``
    (``derive`` without its checks of a TracedMod)."""
    adjoints = derive_node(root, grad_slots, name)
    dscore = simplify(adjoints.get(id(ir.score())) or _f(0.0))
    dloads = tuple((node, simplify(adjoints[id(node)])) for node in root.toposort()
                   if node.op is Op.LOAD and node.arg in grad_slots and id(node) in adjoints)
    return JointGraph(root, dscore, dloads)


def derive_node(root: Node, grad_slots=frozenset(), name: str = "mod") -> dict[int, Node]:
    """Adjoints (by node id) of every active node under ``root``, seeded with 1.0 at root.

    A node is active when it is FLOAT and depends on SCORE or on a LOAD of a slot in
    ``grad_slots``; only active nodes are differentiated, so inactive parts need no rule.
    """
    order = root.toposort()
    active: set[int] = set()
    for node in order:
        if node.dtype is not DType.FLOAT:
            continue
        if (node.op is Op.SCORE or (node.op is Op.LOAD and node.arg in grad_slots)
                or any(id(s) in active for s in node.src)):
            active.add(id(node))
    adjoints: dict[int, Node] = {}
    if id(root) in active:
        adjoints[id(root)] = _f(1.0)
    for node in reversed(order):
        g = adjoints.get(id(node))
        if g is None or node.op in (Op.SCORE, Op.LOAD):
            continue
        rule = _RULES.get(node.op)
        if rule is None:
            raise UnsupportedOpError(
                f"in mod {name!r}: cannot differentiate IR op {node.op.name} "
                f"({ir.format_ir(node).splitlines()[-2] if node.src else node.op.name}); "
                f"ops with derivative rules: {', '.join(sorted(o.name for o in _RULES))}")
        for src, contribution in zip(node.src, rule(node, g)):
            if contribution is not None and id(src) in active:
                adjoints[id(src)] = _add(adjoints.get(id(src)), contribution)
    return adjoints


def evaluate_joint(joint: JointGraph, traced: TracedMod, upstream: torch.Tensor, *, score,
                   b, h, q_idx, kv_idx, buffers=None, float_dtype=torch.float64):
    """Eagerly apply the joint graph to an upstream gradient on broadcast index grids.

    Returns ``(grad_score, {slot: grad_buffer})``: ``upstream * dscore`` and, per grad
    buffer, ``upstream * dload`` scatter-added at each load's indices, which is exactly what
    the backward kernels compute. Used as a check of ``derive`` against torch.autograd.
    """
    buffers = traced.buffers if buffers is None else buffers
    env = dict(score=score, b=b, h=h, q_idx=q_idx, kv_idx=kv_idx, buffers=buffers,
               float_dtype=float_dtype)
    shape = upstream.shape
    grad_score = upstream * evaluate_node(joint.dscore, **env)
    grads = {slot: torch.zeros(buffers[slot].shape, dtype=float_dtype, device=upstream.device)
             for slot in joint.grad_slots}
    for load, dload in joint.dloads:
        contribution = (upstream * evaluate_node(dload, **env)).expand(shape)
        if not load.src:  # a 0-d tensor read as a value
            grads[load.arg] += contribution.sum().reshape(grads[load.arg].shape)
            continue
        index = tuple(evaluate_node(i, **env).expand(shape) for i in load.src)
        grads[load.arg].index_put_(index, contribution, accumulate=True)
    return grad_score, grads


def check_mask_mod_grad(traced: TracedMod) -> None:
    """Raise when a mask_mod reads a captured tensor that requires grad (masks have none).

    Called by the autograd path when flex_attention runs with grad enabled.
    """
    if traced.kind != MASK_MOD:
        return
    if traced.grad_buffers:
        raise mask_mod_grad_error(traced.name, traced.buffers)


def mask_mod_grad_error(name: str, buffers) -> InputError:
    """The error of a mask_mod ``name`` whose captured tensors ``buffers`` (by slot) include
    some that require grad (also raised inside torch.compile: ``flexfa.compiled``)."""
    shapes = ", ".join(f"slot {s} of shape {dims(t)}" for s, t in enumerate(buffers)
                       if t.requires_grad)
    return InputError(f"mask_mod {name!r} reads captured tensors that require grad ({shapes}); "
                      "a mask has no gradient: pass tensor.detach() to the mask_mod, or move "
                      "the learnable part into a score_mod")
