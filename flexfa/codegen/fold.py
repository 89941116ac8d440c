"""Constant factors of a score_mod that the forward kernels fold into scales they apply anyway.

A forward kernel multiplies q.k by the softmax scale before the score_mod, and the score_mod's
result by log2(e) in exp2's FMA. A score_mod of the form ``c_out * g(score * c_in)`` (a
softcap: ``cap * tanh(score / cap)``; ``score * 0.5``) pays two multiplies per score for its
constants, which cost issue slots in the tile loop (the Gluon forward's softcap tile: 192 FMUL a
thread, 64 after the fold). ``fold_scales`` splits them off:

- an output factor ``c_out > 0`` (the root is ``MUL(x, c)``, ``MUL(c, x)`` or ``DIV(x, c)``):
  the kernel renders ``x`` and multiplies log2(e) by ``c_out``. Only positive factors move:
  the softmax subtracts the row max of ``score * log2_scale``, which is the scaled row max only
  for a positive scale; -inf (masked), +inf and NaN stay what they were;
- an input factor ``c_in > 0``, where every use of the score is the same node ``score * c``
  or ``score / c``: the kernel renders the mod on the score itself and multiplies the softmax
  scale by ``c_in`` (once per program, a scalar).

The backward folds the same factors out of the score_mod's joint graph (``fold_joint``): it
renders the folded mod and its derivative, reads the score as q.k * scale * c_in, multiplies
log2(e) by c_out and the derivative by c_in * c_out (nothing where that is 1, as for a
softcap, whose 30 and 1/30 cancel). A joint graph with captured-tensor gradients is not
folded (their derivatives would need c_out too).

Each fold changes a result by the rounding of one fp32 product (the factor applied to a scale
instead of to the score), never more. Factors outside FOLD_RANGE stay in the mod, so a folded
scale is never near fp32's overflow or underflow. The fold is a pure function of the IR, so
the cache keys that hash the mod's IR (and the sources of this module, ``versions.py``) cover
it.
"""
from __future__ import annotations

import dataclasses
import math

from ..frontend.grad import JointGraph, joint_of
from ..frontend.ir import DType, Node, Op, rewrite, score

FOLD_RANGE = (2.0 ** -64, 2.0 ** 64)  # factors folded: positive, finite, within this range


@dataclasses.dataclass(frozen=True)
class Folded:
    root: Node  # what the kernel renders (the mod without the folded factors)
    in_scale: float = 1.0  # the kernel's score is q.k * scale * in_scale
    out_scale: float = 1.0  # the score_mod's result is root * out_scale


def _factor(node: Node, operand: Node | None = None) -> tuple[Node, float] | None:
    """(x, c) where ``node`` is ``x * c``, ``c * x`` or ``x / c`` (c: the factor) for a float
    ``x`` (``operand``, if given) and a constant c within FOLD_RANGE; else None."""
    if node.dtype is not DType.FLOAT or node.op not in (Op.MUL, Op.DIV):
        return None
    a, b = node.src
    candidates = [(a, b)] if node.op is Op.DIV else [(a, b), (b, a)]
    for x, c in candidates:
        if c.op is not Op.CONST or isinstance(c.arg, bool) or x.dtype is not DType.FLOAT:
            continue
        if operand is not None and x is not operand:
            continue
        value = float(c.arg)
        if not (math.isfinite(value) and value > 0.0):
            continue
        factor = 1.0 / value if node.op is Op.DIV else value
        if FOLD_RANGE[0] <= factor <= FOLD_RANGE[1]:
            return x, factor
    return None


def _fold_in(root: Node) -> tuple[Node, float]:
    """(root with the score's one scaled use replaced by the score, the factor), or (root,
    1.0) where the score is used otherwise too."""
    leaf = score()
    users = {node for node in root.toposort() if any(s is leaf for s in node.src)}
    if len(users) != 1 or root is leaf:
        return root, 1.0
    (user,) = users
    found = _factor(user, leaf)
    if found is None or sum(s is leaf for s in user.src) != 1:
        return root, 1.0
    return rewrite(root, lambda node: leaf if node is user else node), found[1]


def fold_scales(root: Node) -> Folded:
    """The score_mod ``root`` without its foldable output and input factors (module
    docstring); ``Folded(root)`` where there are none."""
    out_scale = 1.0
    while (found := _factor(root)) is not None and FOLD_RANGE[0] <= out_scale * found[1] \
            <= FOLD_RANGE[1]:
        root, factor = found
        out_scale *= factor
    root, in_scale = _fold_in(root)
    return Folded(root, in_scale, out_scale)


def rendered_roots(root: Node) -> list[Node]:
    """The graphs a kernel may render for the mod ``root``: itself and, where a factor folds,
    the folded root. Their nodes have other keys wherever the score's scaled use was (an
    int64 mark is a node key: ``ranges.mods_int64_nodes`` marks both)."""
    folded = fold_scales(root).root
    return [root] if folded is root else [root, folded]


@dataclasses.dataclass(frozen=True)
class FoldedJoint:
    joint: JointGraph  # the folded mod and its derivative (no captured-tensor gradients)
    in_scale: float
    out_scale: float

    @property
    def dscore_scale(self) -> float:
        """The derivative's factor: d mod / d score = in_scale * out_scale * d root / d s."""
        return self.in_scale * self.out_scale


def fold_joint(joint: JointGraph | None) -> FoldedJoint | None:
    """The joint graph of the score_mod without its foldable factors, or None where nothing
    folds or the joint graph has captured-tensor gradients (module docstring)."""
    if joint is None or joint.dloads:
        return None
    folded = fold_scales(joint.forward)
    if folded.root is joint.forward:
        return None
    return FoldedJoint(joint_of(folded.root), folded.in_scale, folded.out_scale)
