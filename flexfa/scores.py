"""The range of scores the kernels resolve, checked before launch where a call's scale alone
can leave it.

The kernels keep scores in log2 units in float32 and subtract each row's running max, itself
rounded, inside the exponent; GPU compilers fuse the scaling and that subtraction into one FMA,
so the row max's own term is exp2(its rounding error) instead of exp2(0) = 1. The error is up
to half an ulp: harmless (it cancels in out and lse) while exp2 of it stays in range, but past
2**27 in log2 units it overflows float16's P (past 2**31 float32's), and the row comes out NaN
(lse NaN or +inf), where torch's eager path, which works in natural units without an FMA,
still returns the one-hot softmax. The interpreter has no FMA and resolves scores up to
float32's max / log2(e) (``flexfa.api.MAX_SCALE``).

Scores that large come from an enormous ``scale`` (or enormous inputs or score_mods, which
cannot be seen before launch: documented in docs/training.md). ``check_score_range`` bounds
them for a call whose ``|scale|`` exceeds ``CHECKED_SCALE`` (never met with the usual
``1/sqrt(E)``), from the largest row norms of query and key (Cauchy-Schwarz), and raises
InputError where the bound is past ``MAX_SCORE``: one pass over q and k and a device sync, for
those calls only.
"""
from __future__ import annotations

import math

import torch

from .errors import InputError

MAX_SCORE = 2.0 ** 27 / math.log2(math.e)  # about 9.3e7: float16's P stays finite below it
CHECKED_SCALE = 2.0 ** 16  # calls with |scale| at most this are not checked


def check_score_range(query: torch.Tensor, key: torch.Tensor, scale: float) -> None:
    """Raise InputError if ``|scale| * max ||q_i|| * max ||k_j||`` (a bound of every
    ``|q.k| * scale``) exceeds MAX_SCORE; only for ``|scale| > CHECKED_SCALE``."""
    if abs(scale) <= CHECKED_SCALE or query.numel() == 0 or key.numel() == 0:
        return
    norms = [float(torch.linalg.vector_norm(t, dim=-1, dtype=torch.float32).max())
             for t in (query, key)]
    bound = abs(scale) * norms[0] * norms[1]
    if not bound <= MAX_SCORE:  # also NaN / inf norms
        raise InputError(
            f"scale={scale:g} with these inputs allows scores q.k * scale up to {bound:.3g} "
            f"(|scale| x the largest row norms of query and key, {norms[0]:.3g} and "
            f"{norms[1]:.3g}); flexfa's kernels resolve scores up to {MAX_SCORE:.3g} (beyond "
            "that, rows come out NaN on a GPU, where torch's eager path returns a one-hot "
            "softmax): use a smaller scale, or scale query or key instead")
