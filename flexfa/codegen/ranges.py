"""Value ranges of a mod's integer math over one call's indices, and where it needs 64 bits.

The eager evaluator (``flexfa.frontend.evaluate``) and torch compute INT values in int64; a
kernel computes them in int32, which wraps at 2**31 (``q_idx * 3000017 * kv_idx``, hashes,
``2 ** (kv_idx - q_idx)``, int64 captured values). ``value_ranges`` bounds every node over the
call's domain ``b < B, h < H, q_idx < L, kv_idx < S`` with the interval rules of
``flexfa.blockmask.intervals``; ``int64_nodes`` names the INT nodes whose range does not fit
in int32, which the renderer computes in int64. A captured tensor's values are bounded by its
dtype only (int64 tensors: unknown, so 64 bits), never by reading them: the decision must not
change while the kernel that made it is reused.

Lengths change the decision, so it is part of every kernel spec (``wide_ints``). It is taken
on the domain rounded up to powers of two: intervals only grow with the domain, so the answer
holds for every length of the bucket, and nearby lengths share one kernel.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from ..blockmask.intervals import Interval, apply_rule, exact, unknown
from ..frontend.ir import DType, Node, Op
from .fold import rendered_roots

INT32_MIN, INT32_MAX = -(2 ** 31), 2 ** 31 - 1
_MAX_MEMO = 1024  # analyses kept (each a dict over one graph's nodes)


@dataclasses.dataclass(frozen=True)
class Domain:
    """The index values a call evaluates its mods on: ``b < batch``, ``h < heads`` (query
    heads), ``q_idx < q_len``, ``kv_idx < kv_len``."""

    batch: int
    heads: int
    q_len: int
    kv_len: int

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        return self.batch, self.heads, self.q_len, self.kv_len

    def rounded(self) -> "Domain":
        """Each size rounded up to a power of two (a superset of this domain)."""
        return Domain(*(1 << max(n - 1, 0).bit_length() for n in self.sizes))

    @property
    def empty(self) -> bool:
        return min(self.sizes) <= 0

    def leaf(self, op: Op) -> Interval:
        size = {Op.B: self.batch, Op.H: self.heads, Op.Q_IDX: self.q_len,
                Op.KV_IDX: self.kv_len}[op]
        return Interval(_scalar(0.0), _scalar(float(max(size, 1) - 1)))


def _scalar(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float64)


def _loaded(node: Node, dtype: torch.dtype) -> Interval:
    """What a captured tensor of ``dtype`` can hold: its dtype's range (int64: unknown)."""
    if node.dtype is DType.BOOL or dtype is torch.bool:
        return Interval(_scalar(0.0), _scalar(1.0))
    small_int = not dtype.is_floating_point and (dtype.is_signed and dtype.itemsize < 8
                                                 or dtype is torch.uint8)
    if node.dtype is DType.INT and small_int:
        info = torch.iinfo(dtype)
        return Interval(_scalar(float(info.min)), _scalar(float(info.max)))
    return unknown(node.dtype, "cpu")


_MEMO: dict[tuple, dict[Node, tuple[float, float]]] = {}


def value_ranges(roots: Sequence[Node], buffer_dtypes: Sequence[torch.dtype], domain: Domain
                 ) -> dict[Node, tuple[float, float]]:
    """(lo, hi) of every node under ``roots`` over ``domain`` (floats; +-inf: unbounded; BOOL
    values as 0/1). ``buffer_dtypes[slot]`` is the dtype of the captured tensor LOAD nodes
    of that slot read. Memoized by the graph's structure, the dtypes and the domain."""
    memo_key = (tuple(root.key for root in roots), tuple(buffer_dtypes), domain)
    ranges = _MEMO.get(memo_key)
    if ranges is not None:
        return ranges
    intervals: dict[Node, Interval] = {}
    with torch.device("cpu"):  # host scalars, whatever torch's default device (a meta one
        # failed at float() below)
        for root in roots:
            for node in root.toposort():
                if node not in intervals:
                    intervals[node] = _interval(node, intervals, buffer_dtypes, domain)
    ranges = {node: (float(i.lo), float(i.hi)) for node, i in intervals.items()}
    if len(_MEMO) >= _MAX_MEMO:
        _MEMO.clear()
    _MEMO[memo_key] = ranges
    return ranges


def _interval(node: Node, known: dict, buffer_dtypes, domain: Domain) -> Interval:
    if node.op is Op.CONST:
        return exact(_scalar(float(node.arg)))
    if node.op is Op.SCORE:
        return unknown(DType.FLOAT, "cpu")
    if node.op in (Op.B, Op.H, Op.Q_IDX, Op.KV_IDX):
        return domain.leaf(node.op)
    if node.op is Op.LOAD:
        return _loaded(node, buffer_dtypes[node.arg])
    # NaN aside: the static max bounds the scores that are not NaN (a NaN one stays NaN), and
    # a cast of NaN to an int has no value to fit
    return apply_rule(node, [known[s] for s in node.src], nan_unknown=False)


def fits_int32(lo: float, hi: float) -> bool:
    return INT32_MIN <= lo and hi <= INT32_MAX


_WIDE: dict[tuple, tuple[str, ...]] = {}


def int64_nodes(roots: Sequence[Node], buffer_dtypes: Sequence[torch.dtype], domain: Domain
                ) -> tuple[str, ...]:
    """Sorted keys of the INT nodes under ``roots`` whose values may leave int32 anywhere in
    ``domain`` rounded up to powers of two (empty in the common case), and a ``FLOAT_CAST``
    mark for each cast of index math that a kernel computes in float32 (``float_casts``).
    Memoized."""
    domain = domain.rounded()
    memo_key = (tuple(root.key for root in roots), tuple(buffer_dtypes), domain)
    keys = _WIDE.get(memo_key)
    if keys is None:
        ranges = value_ranges(roots, buffer_dtypes, domain)
        keys = tuple(sorted([node.key for node, (lo, hi) in ranges.items()
                             if node.dtype is DType.INT and not fits_int32(lo, hi)]
                            + [FLOAT_CAST + key for key in float_casts(ranges)]))
        if len(_WIDE) >= _MAX_MEMO:
            _WIDE.clear()
        _WIDE[memo_key] = keys
    return keys


# a cast to float of integer index math (``q_idx - kv_idx``, its abs, sums and extremes of
# indices and constants) whose every value, operands included, is an integer below 2**24 in
# magnitude: float32 holds each exactly, so the kernel computes it in float32 from the
# indices converted one by one (a row's q_idx once a row, a column's kv_idx once a column)
# with the same result as the int32 math converted per score. ALiBi's |q_idx - kv_idx|: an
# integer add, abs and conversion per score become one float subtraction (its abs is an
# operand modifier). The mark (FLOAT_CAST + the cast's key) rides in a spec's wide_ints,
# which every kernel cache key holds and every renderer reads (render.lift_float_casts)
FLOAT_CAST = "f:"
FLOAT_EXACT = 2.0 ** 24
# NEG is not: -(q_idx - kv_idx) at q_idx = kv_idx is -0.0 in float, whose sign a division
# would show (the int math's 0 converts to +0.0); sums, differences and extremes of these
# never give -0.0 (x - x is +0.0)
_LIFTABLE = frozenset({Op.ADD, Op.SUB, Op.ABS, Op.MAX, Op.MIN, Op.CONST, Op.B, Op.H,
                       Op.Q_IDX, Op.KV_IDX})


def float_casts(ranges: dict[Node, tuple[float, float]]) -> list[str]:
    """Keys of the INT -> FLOAT casts among ``ranges``' nodes whose operand's graph is
    index math of _LIFTABLE ops with every value within +-FLOAT_EXACT."""
    found = []
    for node in ranges:
        if node.op is not Op.CAST or node.dtype is not DType.FLOAT:
            continue
        source = node.src[0]
        if source.dtype is not DType.INT or source.op is Op.CONST:
            continue
        below = source.toposort()
        if all(n.op in _LIFTABLE and n.dtype is DType.INT and n in ranges
               and -FLOAT_EXACT <= ranges[n][0] and ranges[n][1] <= FLOAT_EXACT
               for n in below) and any(n.op in (Op.Q_IDX, Op.KV_IDX) for n in below):
            found.append(node.key)
    return found


_MODS_WIDE: dict[tuple, tuple[str, ...]] = {}


def mods_int64_nodes(mods, domain: Domain) -> tuple[str, ...]:
    """``int64_nodes`` of several TracedMods (None entries skipped), merged: each mod's LOAD
    slots index its own captured tensors. Memoized by the mods' keys and the sizes (a dict
    lookup: the FP8 forward asks on every call)."""
    memo_key = (*(mod.key if mod is not None else None for mod in mods), *domain.sizes)
    keys = _MODS_WIDE.get(memo_key)
    if keys is None:
        merged: set[str] = set()
        for mod in mods:
            if mod is not None:
                dtypes = tuple(dtype for _, dtype in mod.buffer_specs)
                merged.update(int64_nodes(rendered_roots(mod.root), dtypes, domain))
        keys = tuple(sorted(merged))
        if len(_MODS_WIDE) >= _MAX_MEMO:
            _MODS_WIDE.clear()
        _MODS_WIDE[memo_key] = keys
    return keys


# the widest range of a score_mod's output (log2 units) that a fixed subtrahend serves: every
# finite score's P = exp2(score - max) is then at least 2**-STATIC_SPAN, far inside bf16's and
# float32's normal range (2**-126), also after a product with a value of V down to 2**-30
STATIC_SPAN = 96.0
_LOG2E = 1.4426950408889634


def static_score_max(score, domain: Domain) -> float | None:
    """The score_mod's largest output over ``domain`` (natural units) where its whole output
    range is finite and at most ``STATIC_SPAN`` wide in log2 units (softcap: cap * tanh(x /
    cap) spans 2 * cap), else None: a softmax can then subtract this bound instead of a
    running row max. Captured tensors count at their dtype's range (never read). Taken on the
    domain rounded up to powers of two, like ``int64_nodes``."""
    if score is None or domain.empty:
        return None
    dtypes = tuple(dtype for _, dtype in score.buffer_specs)
    lo, hi = value_ranges([score.root], dtypes, domain.rounded())[score.root]
    if not (-float("inf") < lo <= hi < float("inf")) or (hi - lo) * _LOG2E > STATIC_SPAN:
        return None
    return hi
