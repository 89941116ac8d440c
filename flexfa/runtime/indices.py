"""Captured-tensor reads in range: the check before a launch.

torch, and flexfa's eager evaluator (``create_block_mask``, the reference), raise IndexError
for ``bias[kv_idx]`` with a bias shorter than S; the kernels instead wrap a negative index once
and clamp it into the tensor (so that padded rows and columns past L and S read in bounds),
which would turn the same mod into a silently different one. So before a launch every read
``tensor[i0, i1, ...]`` of a mod is checked over the call's indices (b < B, h < Hq, q_idx < L,
kv_idx < S): each index must lie in -n..n-1 for a dimension of size n, as in torch.

1. The interval rules (``codegen.ranges.value_ranges``) prove most reads in range at once.
2. Where they cannot (``bias[(q_idx * q_idx) % 37 - 5]``), the index expression is evaluated
   exactly over the indices it reads (q_idx alone: L values; q_idx and kv_idx: L x S, in
   chunks), on the call's device.
3. An index computed from captured tensor values (``bias[doc[q_idx]]``) is evaluated on those
   values; again whenever one of those tensors changed since (its version counter, which
   every in-place torch op bumps; a write torch does not see, such as a custom kernel's, is
   not noticed).

Steps 1 and 2 are memoized by the mods' structure and the lengths, so a repeated call costs
one dict lookup.

Integer ``//`` and ``%`` (and ``torch.fmod``, ``div(rounding_mode=...)``) by a traced divisor
are checked the same way: torch raises ZeroDivisionError wherever the divisor is 0 (in a
``torch.where`` branch not taken too), where a kernel would compute garbage. The interval rules
prove most divisors nonzero; the others are evaluated exactly.
"""
from __future__ import annotations

import dataclasses

import torch

from ..codegen.ranges import Domain, value_ranges
from ..codegen.render import leaf_ops
from ..errors import InputError
from ..frontend.evaluate import evaluate_node
from ..frontend.ir import DType, Node, Op
from ..frontend.trace import TracedMod
from ..memo import OwnedMemo, contents_of

_CHUNK = 1 << 22  # index values evaluated at once
_MAX_MEMO = 1024


@dataclasses.dataclass(frozen=True)
class _Read:
    """One dimension of one captured-tensor read: ``tensor[..., index, ...]``; or, with
    ``size`` 0, the divisor ``index`` of the integer division ``load``, which must not be 0."""

    load: Node
    dim: int
    index: Node
    size: int

    @property
    def reads_values(self) -> bool:
        """The index is computed from captured tensor values."""
        return any(n.op is Op.LOAD for n in self.index.toposort())


@dataclasses.dataclass(frozen=True)
class _OutOfRange:
    read: _Read
    shape: tuple[int, ...]
    lo: int
    hi: int


_DIVISIONS = (Op.FLOORDIV, Op.MOD, Op.FMOD)


def _reads(mod: TracedMod) -> list[_Read]:
    """Every dimension of every read, inner reads (those an index reads) first, and every
    integer divisor that is not a constant (a constant 0 is refused when rendering)."""
    reads = []
    for node in mod.root.toposort():
        if node.op is Op.LOAD:
            reads += [_Read(node, dim, index, mod.buffer_specs[node.arg][0][dim])
                      for dim, index in enumerate(node.src)]
        elif node.op in _DIVISIONS and node.dtype is DType.INT and node.src[1].op is not Op.CONST:
            reads.append(_Read(node, 1, node.src[1], 0))
    return reads


def _in_range(read: _Read, lo: float, hi: float, zero: bool | None = None) -> bool:
    """Whether values from ``lo`` to ``hi`` are a valid index (a nonzero divisor: ``zero``,
    whether 0 is among them, decides where it is known)."""
    if read.size == 0:
        return not zero if zero is not None else not lo <= 0 <= hi
    return -read.size <= lo and hi <= read.size - 1


def _exact_range(index: Node, buffers, domain: Domain, device) -> tuple[int, int, bool]:
    """(min, max, whether 0 occurs) of ``index`` over the domain's values of the leaves it
    reads."""
    sizes = {Op.B: domain.batch, Op.H: domain.heads, Op.Q_IDX: domain.q_len,
             Op.KV_IDX: domain.kv_len}
    used = [op for op in sizes if op in leaf_ops(index)]
    longest = max(used, key=sizes.__getitem__, default=None)
    others = 1
    for op in used:
        others *= sizes[op] if op is not longest else 1
    step = max(1, _CHUNK // others)
    total = sizes[longest] if longest is not None else 1
    lows, highs, zeros = [], [], []
    for start in range(0, total, step):
        grids = {}
        for axis, op in enumerate(sizes):
            if op in used:
                values = (torch.arange(start, min(start + step, total), device=device)
                          if op is longest else torch.arange(sizes[op], device=device))
                shape = [1, 1, 1, 1]
                shape[axis] = -1
                grids[op] = values.view(shape)
        values = evaluate_node(index, b=grids.get(Op.B), h=grids.get(Op.H),
                               q_idx=grids.get(Op.Q_IDX), kv_idx=grids.get(Op.KV_IDX),
                               buffers=buffers, device=device)
        low, high = torch.aminmax(values.reshape(-1))
        lows.append(low)
        highs.append(high)
        zeros.append((values == 0).any())
    return (int(torch.stack(lows).min()), int(torch.stack(highs).max()),
            bool(torch.stack(zeros).any()))


def _static(mod: TracedMod, domain: Domain, device) -> tuple[_OutOfRange | None, tuple]:
    """(the first read out of range or None, the reads whose index reads tensor values)."""
    reads = _reads(mod)
    if not reads:
        return None, ()
    dtypes = tuple(dtype for _, dtype in mod.buffer_specs)
    coarse = value_ranges([mod.root], dtypes, domain.rounded())
    ranges = None
    from_values = []
    for read in reads:
        if _in_range(read, *coarse[read.index]):
            continue
        if ranges is None:
            ranges = value_ranges([mod.root], dtypes, domain)
        if _in_range(read, *ranges[read.index]):
            continue
        if read.reads_values:
            from_values.append(read)
            continue
        if Op.SCORE in leaf_ops(read.index):  # (its values are known in the kernel only)
            raise _score_dependent(mod, read)
        lo, hi, zero = _exact_range(read.index, (), domain, device)
        if not _in_range(read, lo, hi, zero):
            return _OutOfRange(read, _shape(mod, read), lo, hi), ()
    return None, tuple(from_values)


_STATIC: dict[tuple, tuple] = {}
# mod -> {(domain, read): ``memo.contents_of`` the tensors its index read when it was last
# checked (their versions and memory: ``t.data = other`` keeps the version)},
# weakly keyed on the mod and bounded per mod: a mod kept for a run of varying lengths meets
# a new domain per length
_CHECKED_VALUES = OwnedMemo(owners=1024, per_owner=256, name="captured-value index checks")


def check_captured_indices(score: TracedMod | None, mask: TracedMod | None,
                           q_shape: tuple[int, ...], kv_len: int, device) -> None:
    """Raise an InputError naming the mod, the tensor's shape, the dimension and the index
    range when a read of a captured tensor leaves it for some b < B, h < Hq, q_idx < L,
    kv_idx < kv_len, where ``q_shape`` is the query's [B, Hq, L, E], or when an integer
    divisor is 0 there (see the module docstring)."""
    if score is not None:
        _check_mod(score, q_shape, kv_len, device)
    if mask is not None:
        _check_mod(mask, q_shape, kv_len, device)


def reads_values(score: TracedMod | None, mask: TracedMod | None, q_shape: tuple[int, ...],
                 kv_len: int) -> bool:
    """Whether ``check_captured_indices`` for these mods and sizes has work on each call
    (indices computed from captured tensor values, whose versions it checks); True where it
    has not run for them yet. Its other outcomes depend only on the mods' keys and sizes."""
    for mod in (score, mask):
        if mod is not None and mod.buffers:
            result = _STATIC.get((mod.key, q_shape, kv_len))
            if result is None or result[0] is not None or result[1]:
                return True
    return False


def _check_mod(mod: TracedMod, q_shape, kv_len: int, device) -> None:
    memo_key = (mod.key, q_shape, kv_len)
    result = _STATIC.get(memo_key)
    if result is None:
        domain = Domain(q_shape[0], q_shape[1], q_shape[2], kv_len)
        result = (None, ()) if domain.empty else _static(mod, domain, device)
        if len(_STATIC) >= _MAX_MEMO:
            _STATIC.clear()
        _STATIC[memo_key] = result
    bad, from_values = result
    if bad is not None or from_values:
        domain = Domain(q_shape[0], q_shape[1], q_shape[2], kv_len)
        if bad is not None:
            raise _error(mod, bad, domain)
        _check_values(mod, from_values, domain)


def _check_values(mod: TracedMod, reads: tuple[_Read, ...], domain: Domain) -> None:
    for read in reads:
        slots = sorted({n.arg for n in read.index.toposort() if n.op is Op.LOAD})
        contents = contents_of([mod.buffers[slot] for slot in slots])
        known = None if contents is None else _CHECKED_VALUES.get(mod, (domain, read))
        if known is not None and known[0] == contents[0]:
            continue
        device = mod.buffers[slots[0]].device
        lo, hi, zero = _exact_range(read.index, mod.buffers, domain, device)
        if not _in_range(read, lo, hi, zero):
            raise _error(mod, _OutOfRange(read, _shape(mod, read), lo, hi), domain)
        if contents is not None:
            _CHECKED_VALUES.put(mod, (domain, read), contents)


def _shape(mod: TracedMod, read: _Read) -> tuple[int, ...]:
    return () if read.size == 0 else tuple(mod.buffer_specs[read.load.arg][0])


def _score_dependent(mod: TracedMod, read: _Read) -> InputError:
    """A read whose index (or integer divisor) is computed from the score and not proven in
    range by its interval: nothing can check it before the launch (the check's exact
    evaluation failed with a bare ValueError needing a value for score)."""
    if read.size == 0:
        return InputError(
            f"the {mod.kind} {mod.name!r} divides integers by a divisor computed from score, "
            "which can be 0 as far as flexfa can tell before the launch (torch raises "
            "ZeroDivisionError there); keep it nonzero (e.g. torch.clamp(d, min=1))")
    return InputError(
        f"the {mod.kind} {mod.name!r} reads a captured tensor of shape {_shape(mod, read)} at "
        f"an index computed from score in dimension {read.dim} (size {read.size}), whose "
        "range flexfa cannot check before the launch (a read out of range would read other "
        f"memory); bound it, e.g. with .clamp({-read.size}, {read.size - 1}) or % {read.size}")


def _error(mod: TracedMod, bad: _OutOfRange, domain: Domain) -> InputError:
    size = bad.read.size
    where = (f"b < {domain.batch}, h < {domain.heads}, q_idx < {domain.q_len}, kv_idx < "
             f"{domain.kv_len}")
    if size == 0:
        symbol = {Op.FLOORDIV: "//", Op.MOD: "%", Op.FMOD: "torch.fmod"}[bad.read.load.op]
        return InputError(
            f"the {mod.kind} {mod.name!r} divides integers ({symbol}) by a divisor that is 0 "
            f"for some {where} (its values: {bad.lo}..{bad.hi}); torch raises "
            "ZeroDivisionError for it, in a torch.where branch not taken too: keep the "
            "divisor nonzero (e.g. torch.clamp(d, min=1))")
    return InputError(
        f"the {mod.kind} {mod.name!r} reads a captured tensor of shape {bad.shape} at indices "
        f"{bad.lo}..{bad.hi} in dimension {bad.read.dim} (size {size}), for {where}; "
        f"indices must lie in {-size}..{size - 1} (torch raises IndexError for this read)")
