"""Tracing a Python mod into the IR: call it with proxies (proxy.py), check what it returned,
simplify, and cache the result by function identity plus a fingerprint of its closure.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import math
import numbers
import types
import weakref

import torch

from ..errors import TraceError, dims
from . import ir
from . import torch_functions  # noqa: F401  (registers the torch-function handlers)
from ..memo import OwnedMemo, contents_key, memory_of, version_of
from .guards import Guard, guard, pins, pins_hold, torch_state, torch_state_holds
from .ir import DType, Node, Op
from .proxy import BufferView, Proxy, Tracer, lift, supported_functions
from .simplify import simplify

__all__ = ["MASK_MOD", "SCORE_MOD", "TracedMod", "mod_kind", "trace", "supported_functions",
           "Proxy"]

SCORE_MOD = "score_mod"
MASK_MOD = "mask_mod"
_ARGS = {SCORE_MOD: ("score", "b", "h", "q_idx", "kv_idx"), MASK_MOD: ("b", "h", "q_idx", "kv_idx")}


@dataclasses.dataclass(frozen=True, eq=False)
class TracedMod:
    """A traced mod: the IR root plus the captured tensors its LOAD nodes read, by slot."""

    kind: str  # SCORE_MOD or MASK_MOD
    root: Node
    buffers: tuple[torch.Tensor, ...]
    name: str
    # captured tensors the mod read that simplification removed (read only in a branch never
    # taken, ``torch.where(q_idx < q_idx, t, score)``): no kernel reads them, but those that
    # require grad get torch's zero gradient (flexfa.api.attend, flexfa.autograd), not None
    dropped: tuple[torch.Tensor, ...] = ()

    @functools.cached_property
    def buffer_specs(self) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
        return tuple((tuple(t.shape), t.dtype) for t in self.buffers)

    @functools.cached_property
    def key(self) -> str:
        """Structural cache key: kind, IR and buffer shapes/dtypes, never buffer values."""
        text = f"{self.kind}|{self.root.key}|{self.buffer_specs!r}"
        return hashlib.sha256(text.encode()).hexdigest()

    @property
    def grad_buffers(self) -> tuple[int, ...]:
        """Slots of captured tensors that require grad."""
        return tuple(i for i, t in enumerate(self.buffers) if t.requires_grad)

    def format(self) -> str:
        """The IR listing under a header naming the mod and its captured buffers."""
        lines = [f"{self.kind} {self.name}"]
        lines += [f"buf{i}: {str(t.dtype).replace('torch.', '')}{list(t.shape)}"
                  + (" requires_grad" if t.requires_grad else "")
                  for i, t in enumerate(self.buffers)]
        return "\n".join(lines) + "\n" + ir.format_ir(self.root)

    def __repr__(self) -> str:
        return f"TracedMod({self.kind} {self.name!r}, key={self.key[:12]})"


# ---- trace entry point and cache ----------------------------------------------------------

def mod_kind(fn) -> str:
    """score_mod (5 positional args) or mask_mod (4), from the signature."""
    if not callable(fn):
        raise TraceError(f"a mod must be callable, got {type(fn).__name__} {fn!r:.60}")
    try:  # a module's signature is its forward's (__call__ takes *args)
        sig = inspect.signature(fn.forward if isinstance(fn, torch.nn.Module) else fn)
    except (TypeError, ValueError) as exc:
        raise TraceError(f"cannot read the signature of mod {mod_name(fn)!r}: {exc}") from None
    params = list(sig.parameters.values())
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        raise TraceError(f"mod {mod_name(fn)!r} takes *args; write score_mod(score, b, h, q_idx, "
                         "kv_idx) or mask_mod(b, h, q_idx, kv_idx) with named parameters")
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                  and p.default is p.empty]
    count = len(positional)
    if count == 5:
        return SCORE_MOD
    if count == 4:
        return MASK_MOD
    raise TraceError(
        f"mod {mod_name(fn)!r} takes {count} required positional arguments; a score_mod takes 5 "
        "(score, b, h, q_idx, kv_idx) and a mask_mod takes 4 (b, h, q_idx, kv_idx)")


def mod_name(fn) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _captured_tensors(fn, depth=0):
    """Tensors reachable from the mod's closure and referenced globals (for in-place checks
    of a mod whose state ``guards.guard`` cannot walk)."""
    found = []
    for value in _referenced_values(fn):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, types.FunctionType) and depth < 4:
            found.extend(_captured_tensors(value, depth + 1))
    return found


def _referenced_values(fn):
    if isinstance(fn, types.MethodType):
        yield fn.__self__
        fn = fn.__func__
    if isinstance(fn, functools.partial):
        yield fn.func
        yield from fn.args
        yield from fn.keywords.values()
        return
    code = getattr(fn, "__code__", None)
    if code is None:
        return
    for cell in fn.__closure__ or ():
        try:
            yield cell.cell_contents
        except ValueError:  # empty cell
            continue
    globals_ = getattr(fn, "__globals__", {})
    for name in code.co_names:
        if name in globals_:
            yield globals_[name]
    yield from fn.__defaults__ or ()
    yield from (fn.__kwdefaults__ or {}).values()


def trace(fn, kind: str | None = None) -> TracedMod:
    """Trace ``fn`` into a ``TracedMod``. ``kind`` defaults to what the arity says.

    Traces are memoized per mod under a guard (``guards.guard``: every Python value the mod
    can reach, compared on each call), so calling this per step costs microseconds and a mod
    whose state changed (``self.window = 24``) is traced again."""
    return trace_entry(fn, kind).traced


@dataclasses.dataclass(eq=False)
class TraceEntry:
    """A trace and what it was made under: the mod's guard and the contents (version
    counters, memory addresses) of the captured tensors whose values Python read while
    tracing (``float(t)``, ``if t.sum() > 0``), and room for what later steps derive from it
    (``derived``, e.g. the simplified mod)."""

    traced: TracedMod
    guard: Guard | None
    # (weakref to tensor, its contents_key before the trace, its memory_of keeping that key
    # valid) of each captured tensor whose values were read
    reads: tuple = ()
    raw_root: Node | None = None  # the IR as traced, before simplification (debug dumps)
    derived: dict = dataclasses.field(default_factory=dict)
    # weakrefs to the captured tensors whose sizes Python read while tracing (``t.shape[0]``):
    # the IR may hold them as constants (the guard covers them; torch.compile pins them)
    sized: tuple = ()
    # a plain function's bindings (``guards.pins``), checked instead of its guard where set
    pins: tuple | None = None
    # (name, value) of torch's global state its code may read (``guards.torch_state``:
    # ``torch.is_grad_enabled()``), compared besides the guard; usually empty
    state: tuple = ()

    def reads_unchanged(self) -> bool:
        for ref, key, _storage in self.reads:
            tensor = ref()
            if tensor is None or key is None or contents_key(tensor) != key:
                return False  # (None: an inference tensor, whose edits cannot be told)
        return True


# mod -> {(kind, method's function): TraceEntry}, weakly keyed on the mod (a bound method's
# instance): dropping the mod drops its traces and the captured tensors they hold
TRACE_MEMO = OwnedMemo(owners=1024, per_owner=8, name="traces")


def _owner_and_key(fn, kind: str) -> tuple:
    if isinstance(fn, types.MethodType):
        return fn.__self__, (kind, fn.__func__)
    return fn, (kind, None)


def trace_entry(fn, kind: str | None = None) -> TraceEntry:
    """The memoized ``TraceEntry`` of ``fn`` whose guard still holds, or a new trace (kept
    when it may be reused: ``_reusable``)."""
    if kind not in (None, SCORE_MOD, MASK_MOD):
        raise TraceError(f"kind must be {SCORE_MOD!r}, {MASK_MOD!r} or None, got {kind!r}")
    expected = None
    if kind is None:
        expected = kind = mod_kind(fn)
    owner, key = _owner_and_key(fn, kind)
    entry = TRACE_MEMO.get(owner, key)
    if entry is not None and entry.pins is not None and pins_hold(fn, entry.pins) and \
            (not entry.reads or entry.reads_unchanged()) and \
            (not entry.state or torch_state_holds(entry.state)):
        return entry  # (a plain function's bindings unchanged: its guard would be equal)
    names = frozenset() if entry is None or entry.guard is None else entry.guard.names
    current = guard(fn, names)
    if (entry is not None and current is not None and current == entry.guard
            and (not entry.reads or entry.reads_unchanged())
            and (not entry.state or torch_state_holds(entry.state))):
        return entry
    if expected is None:
        expected = mod_kind(fn)
    if kind != expected:
        raise TraceError(f"expected a {kind} but {mod_name(fn)!r} has the arity of a {expected}")
    pinned = pins(fn) if current is not None else None  # (taken before the trace)
    state = torch_state(current.names) if current is not None else ()
    traced, reads, raw, sized = _trace_uncached(fn, kind, current)
    entry = TraceEntry(traced, current, reads, raw, sized=sized, state=state)
    if _reusable(current, traced):
        current.keep()  # its objects held weakly from now on
        if pinned is not None and pins_hold(fn, pinned) and guard(fn, current.names) == current:
            entry.pins = pinned  # (the state did not change while tracing)
        TRACE_MEMO.put(owner, key, entry)
    return entry


def memoized(fn, kind: str) -> TracedMod | None:
    """The trace the memo keeps for ``fn`` (its guard not checked), or None."""
    entry = TRACE_MEMO.get(*_owner_and_key(fn, kind))
    return entry.traced if entry is not None else None


def _reusable(current: Guard | None, traced: TracedMod) -> bool:
    """A trace may be reused when its mod is guarded and every buffer is a tensor the mod
    captured. A buffer computed while tracing (``torch.tanh(t0)`` of a captured 0-d tensor
    runs eagerly) holds this call's values and, for a parameter, this call's autograd graph;
    so does a removed one that requires grad (``dropped``: ``w = bias * bias`` read only in a
    branch the trace removes gets its zero gradient through that graph, which a second
    backward would find freed)."""
    if current is None:
        return False
    captured = {id(t) for t in current.tensors}
    return (all(id(t) in captured for t in traced.buffers)
            and all(id(t) in captured for t in traced.dropped if t.requires_grad))


def _trace_uncached(fn, kind: str, current: Guard | None) -> tuple:
    """(the trace of ``fn``, ``TraceEntry.reads`` of each captured tensor whose values
    Python read while tracing, the IR before simplification, weakrefs to the captured tensors
    whose sizes it read)."""
    name = mod_name(fn)
    tracer = Tracer(name)
    leaves = {"score": ir.score(), "b": ir.index(Op.B), "h": ir.index(Op.H),
              "q_idx": ir.index(Op.Q_IDX), "kv_idx": ir.index(Op.KV_IDX)}
    args = [Proxy(leaves[a], tracer) for a in _ARGS[kind]]
    watched = list(current.tensors) if current is not None else _captured_tensors(fn)
    versions = [version_of(t) for t in watched]
    # (read before the trace: an edit meanwhile, another thread's, leaves the entry stale)
    keys = [(contents_key(t), memory_of(t)) for t in watched]
    reads = _ValueReads({id(t) for t in watched}, tracer)
    try:
        with reads:
            result = fn(*args)
    except (TraceError, RecursionError):
        raise
    except Exception as exc:
        raise TraceError(f"in mod {name!r}: tracing raised {type(exc).__name__}: {exc}") from exc
    for tensor, version in zip(watched, versions):
        # (another thread, a training loop's optimizer step, may edit it meanwhile: that is
        # no error of the mod; the memo then holds the versions read before, so it is stale)
        if version_of(tensor) != version and reads.mutated:
            raise tracer.error(
                f"the mod modified the captured tensor of shape {dims(tensor)} in place "
                "(e.g. bias.add_(1) or bias[0] = 0); mods must be pure")
    raw = _result_node(tracer, result, kind)
    root, buffers = _drop_unused_buffers(simplify(raw), tuple(tracer.buffers))
    read = tuple((weakref.ref(t), *key) for t, key in zip(watched, keys) if id(t) in reads.read)
    sized = tuple(weakref.ref(t) for t in watched if id(t) in reads.sized)
    kept = {id(t) for t in buffers}
    dropped = tuple(t for t in tracer.buffers if id(t) not in kept)
    return TracedMod(kind, root, buffers, name, dropped), read, raw, sized


# tensor methods and properties that read metadata, not values (printing reads values:
# ``float(f"{t}")`` is a read like ``float(t)``)
_METADATA = frozenset({"shape", "size", "dim", "ndim", "ndimension", "dtype", "device", "stride",
                       "numel", "nelement", "requires_grad", "is_cuda", "is_cpu", "layout",
                       "__len__", "is_floating_point", "is_complex", "is_contiguous",
                       "element_size", "storage_offset", "grad_fn", "is_leaf", "names",
                       "is_sparse", "is_quantized", "is_meta"})
# those that read sizes (the number of dimensions is fixed under dynamic shapes, and the tracer
# reads it of every indexed tensor)
_SIZES = frozenset({"shape", "size", "__len__", "numel", "nelement"})


def _function_name(func) -> str:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):  # a property's accessor: name it by the property
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


# torch functions that draw from a random generator
_RANDOM = frozenset({"rand", "randn", "randint", "randperm", "rand_like", "randn_like",
                     "randint_like", "bernoulli", "bernoulli_", "multinomial", "normal",
                     "normal_", "poisson", "binomial", "uniform_", "random_", "exponential_",
                     "geometric_", "cauchy_", "log_normal_"})


class _ValueReads(torch.overrides.TorchFunctionMode):
    """Records which watched tensors a torch function touched eagerly while a mod was traced
    (no traced value among its arguments, not a metadata query): their values decided the
    trace, so the memo also guards their versions. Also records those whose sizes were read
    (``sized``), and whether the mod called an in-place function (``mutated``: torch
    function modes are per thread, so another thread's edits are not seen). Refuses random
    draws: a trace holds one draw as a constant, which the memo would give every later call
    (torch's flex_attention refuses them too, under vmap)."""

    def __init__(self, watched: set[int], tracer: Tracer):
        super().__init__()
        self.watched, self.tracer = watched, tracer
        self.read: set[int] = set()
        self.sized: set[int] = set()
        self.mutated = False

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _function_name(func)
        if not self.mutated and _in_place(name, kwargs):
            self.mutated = True
        if name in _RANDOM:
            raise self.tracer.error(
                f"{name}(...) draws random numbers; a mod must give the same result on every "
                "call (torch's flex_attention refuses random operations too): draw them "
                "outside the mod and capture the tensor")
        if self.watched and name in _SIZES:
            self.sized.update(id(x) for x in args[:1] if id(x) in self.watched)
        elif self.watched and name not in _METADATA:
            operands = [*args, *kwargs.values()]
            flat = [x for v in operands for x in (v if isinstance(v, (tuple, list)) else (v,))]
            if not any(isinstance(x, (Proxy, BufferView)) for x in flat):
                self.read.update(id(x) for x in flat if id(x) in self.watched)
        return func(*args, **kwargs)


def _in_place(name: str, kwargs: dict) -> bool:
    """Whether a torch function of this name (``add_``, ``aten::add_.Tensor``,
    ``__setitem__``) or with an ``out=`` argument writes into a tensor."""
    base = name.partition(".")[0]
    return ((base.endswith("_") and not base.endswith("__")) or base == "__setitem__"
            or kwargs.get("out") is not None)


def _drop_unused_buffers(root: Node, buffers: tuple) -> tuple[Node, tuple]:
    """Renumber LOAD slots after simplification removed reads (``0 * bias[q_idx]``)."""
    used = sorted({n.arg for n in root.toposort() if n.op is Op.LOAD})
    if len(used) == len(buffers):
        return root, buffers
    new_slot = {old: new for new, old in enumerate(used)}
    root = ir.rewrite(root, lambda n: ir.load(new_slot[n.arg], n.src, n.dtype)
                      if n.op is Op.LOAD else n)
    return root, tuple(buffers[i] for i in used)


def _result_node(tracer: Tracer, result, kind: str) -> Node:
    if result is None:
        raise tracer.error("the mod returned None; a score_mod returns the new score, a "
                           "mask_mod returns a bool")
    if isinstance(result, (Proxy, bool, numbers.Real, torch.Tensor, BufferView)):
        node = lift(result, tracer)
    else:
        raise tracer.error(f"the mod returned a {type(result).__name__}; expected a traced value")
    if kind == MASK_MOD:
        if node.dtype is not DType.BOOL:
            raise tracer.error(f"a mask_mod must return bool (True = keep), got {node.dtype.value}")
        return node
    return ir.cast(node, DType.FLOAT)
