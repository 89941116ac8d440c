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

from ..errors import TraceError
from . import ir
from . import torch_functions  # noqa: F401  (registers the torch-function handlers)
from .ir import DType, Node, Op
from .proxy import Proxy, _BufferView, _lift, _Tracer, supported_functions
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
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise TraceError(f"cannot read the signature of mod {_name(fn)!r}: {exc}") from None
    params = list(sig.parameters.values())
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        raise TraceError(f"mod {_name(fn)!r} takes *args; write score_mod(score, b, h, q_idx, "
                         "kv_idx) or mask_mod(b, h, q_idx, kv_idx) with named parameters")
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                  and p.default is p.empty]
    count = len(positional)
    if count == 5:
        return SCORE_MOD
    if count == 4:
        return MASK_MOD
    raise TraceError(
        f"mod {_name(fn)!r} takes {count} required positional arguments; a score_mod takes 5 "
        "(score, b, h, q_idx, kv_idx) and a mask_mod takes 4 (b, h, q_idx, kv_idx)")


def _name(fn) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _captured_tensors(fn, depth=0):
    """Tensors reachable from the mod's closure and referenced globals (for in-place checks)."""
    found = []
    for value in _referenced_values(fn):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, types.FunctionType) and depth < 4:
            found.extend(_captured_tensors(value, depth + 1))
    return found


def _referenced_values(fn):
    fn = inspect.unwrap(fn) if isinstance(fn, types.FunctionType) else fn
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


def trace(fn, kind: str | None = None) -> TracedMod:
    """Trace ``fn`` into a ``TracedMod``. ``kind`` defaults to what the arity says.

    Traces are cached by function identity plus a fingerprint of what the function can see
    (closure cells, referenced globals), so calling this per step costs microseconds."""
    if kind not in (None, SCORE_MOD, MASK_MOD):
        raise TraceError(f"kind must be {SCORE_MOD!r}, {MASK_MOD!r} or None, got {kind!r}")
    fingerprint = _fingerprint(fn)
    cached = memo_get(_CACHE, fn, fingerprint)
    if cached is not None and kind in (None, cached.kind):
        return cached
    expected = mod_kind(fn)
    kind = kind or expected
    if kind != expected:
        raise TraceError(f"expected a {kind} but {_name(fn)!r} has the arity of a {expected}")
    traced = _trace_uncached(fn, kind)
    memo_put(_CACHE, fn, fingerprint, traced)
    return traced


def trace_is_reusable(fn, traced: TracedMod) -> bool:
    """True when every buffer is a tensor the mod captured. A buffer computed while tracing
    (``torch.tanh(t0)`` of a captured 0-d tensor runs eagerly) holds this call's values and,
    for a parameter, this call's autograd graph: such a trace must not be reused."""
    captured = {id(t) for t in _captured_tensors(fn)}
    return all(id(t) in captured for t in traced.buffers)


def memo_get(memo, fn, fingerprint) -> TracedMod | None:
    """What ``memo`` (a WeakKeyDictionary keyed by mod) holds for ``fn`` under this
    ``fingerprint`` (from ``_fingerprint``), or None."""
    if fingerprint is None:
        return None
    try:
        hit = memo.get(fn)
    except TypeError:  # not weak-referenceable: never memoized
        return None
    return hit[1] if hit is not None and hit[0] == fingerprint else None


def memo_put(memo, fn, fingerprint, traced: TracedMod) -> None:
    """Memoize ``traced`` for ``fn`` when it may be reused (see ``trace_is_reusable``)."""
    if fingerprint is not None and trace_is_reusable(fn, traced):
        try:
            memo[fn] = (fingerprint, traced)
        except TypeError:  # not weak-referenceable
            pass


def _trace_uncached(fn, kind: str) -> TracedMod:
    name = _name(fn)
    tracer = _Tracer(name)
    leaves = {"score": ir.score(), "b": ir.index(Op.B), "h": ir.index(Op.H),
              "q_idx": ir.index(Op.Q_IDX), "kv_idx": ir.index(Op.KV_IDX)}
    args = [Proxy(leaves[a], tracer) for a in _ARGS[kind]]
    watched = _captured_tensors(fn)
    versions = [t._version for t in watched]
    try:
        result = fn(*args)
    except (TraceError, RecursionError):
        raise
    except Exception as exc:
        raise TraceError(f"in mod {name!r}: tracing raised {type(exc).__name__}: {exc}") from exc
    for tensor, version in zip(watched, versions):
        if tensor._version != version:
            raise tracer.error(
                f"the mod modified the captured tensor of shape {tuple(tensor.shape)} in place "
                "(e.g. bias.add_(1) or bias[0] = 0); mods must be pure")
    root = simplify(_result_node(tracer, result, kind))
    root, buffers = _drop_unused_buffers(root, tuple(tracer.buffers))
    return TracedMod(kind, root, buffers, name)


def _drop_unused_buffers(root: Node, buffers: tuple) -> tuple[Node, tuple]:
    """Renumber LOAD slots after simplification removed reads (``0 * bias[q_idx]``)."""
    used = sorted({n.arg for n in root.toposort() if n.op is Op.LOAD})
    if len(used) == len(buffers):
        return root, buffers
    new_slot = {old: new for new, old in enumerate(used)}
    root = ir.rewrite(root, lambda n: ir.load(new_slot[n.arg], n.src, n.dtype)
                      if n.op is Op.LOAD else n)
    return root, tuple(buffers[i] for i in used)


def _result_node(tracer: _Tracer, result, kind: str) -> Node:
    if result is None:
        raise tracer.error("the mod returned None; a score_mod returns the new score, a "
                           "mask_mod returns a bool")
    if isinstance(result, (Proxy, bool, numbers.Real, torch.Tensor, _BufferView)):
        node = _lift(result, tracer)
    else:
        raise tracer.error(f"the mod returned a {type(result).__name__}; expected a traced value")
    if kind == MASK_MOD:
        if node.dtype is not DType.BOOL:
            raise tracer.error(f"a mask_mod must return bool (True = keep), got {node.dtype.value}")
        return node
    return ir.cast(node, DType.FLOAT)


# Cache by function identity plus a fingerprint of everything the function can see that
# would change its trace: closure cells and referenced globals (scalars by value, tensors by
# identity and shape, nested functions recursively). Anything unfingerprintable disables the
# cache for that function, so a stale trace is never returned.
_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _fingerprint(fn, depth=0):
    if depth > 4:
        return None
    parts = []
    code = getattr(fn, "__code__", None)
    if code is None and not isinstance(fn, functools.partial):
        return None
    parts.append(id(code))
    for value in _referenced_values(fn):
        fp = _value_fingerprint(value, depth)
        if fp is None:
            return None
        parts.append(fp)
    return tuple(parts)


def _value_fingerprint(value, depth):
    if value is None or isinstance(value, (bool, int, float, str, complex)):
        return (type(value), value if not (isinstance(value, float) and math.isnan(value)) else "nan")
    if isinstance(value, torch.Tensor):
        return ("t", id(value), tuple(value.shape), value.dtype, value.requires_grad)
    if isinstance(value, (types.ModuleType, type, torch.dtype, types.BuiltinFunctionType)):
        return ("id", id(value))
    if isinstance(value, (types.FunctionType, functools.partial)):
        inner = _fingerprint(value, depth + 1)
        return None if inner is None else ("fn", id(value), inner)
    if isinstance(value, tuple):
        items = [_value_fingerprint(v, depth) for v in value]
        return None if any(i is None for i in items) else ("tuple",) + tuple(items)
    if callable(value) and getattr(value, "__module__", "").startswith(("torch", "math", "flexfa")):
        return ("id", id(value))
    return None
