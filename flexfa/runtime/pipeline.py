"""The front half of the compile pipeline: trace -> simplify, with FLEXFA_DEBUG dumps.

The backward continues from the same prepared mods (grad -> render -> load).
"""
from __future__ import annotations

import dataclasses
import weakref

from ..frontend import simplify
from ..frontend.ir import Node
from ..frontend.trace import (MASK_MOD, SCORE_MOD, TracedMod, _fingerprint, memo_get,
                              memo_put, trace)
from .debug import debug, debug_enabled

_SIMPLIFIED: dict[Node, Node] = {}  # root -> simplified root (nodes are hash-consed)
_PREPARED: "weakref.WeakKeyDictionary[TracedMod, TracedMod]" = weakref.WeakKeyDictionary()


def prepare(traced: TracedMod) -> TracedMod:
    """``traced`` with its IR simplified; buffers (slots, values) are unchanged."""
    prepared = _PREPARED.get(traced)
    if prepared is None:
        prepared = _PREPARED[traced] = _simplified(traced)
    return prepared


def _simplified(traced: TracedMod) -> TracedMod:
    root = _SIMPLIFIED.get(traced.root)
    if root is None:
        root = _SIMPLIFIED[traced.root] = simplify(traced.root)
        if debug_enabled():
            debug(f"traced {traced.kind} {traced.name}", traced.format())
            debug(f"simplified {traced.kind} {traced.name}",
                  dataclasses.replace(traced, root=root).format())
    if root is traced.root:
        return traced
    return dataclasses.replace(traced, root=root)


# fn -> (fingerprint, prepared): skips trace()'s signature inspection on repeated calls; the
# fingerprint (closure cells, globals, captured tensors' identity and shape) is trace's own
_BY_FUNCTION: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def prepare_score_mod(score_mod) -> TracedMod | None:
    if score_mod is None:
        return None
    fingerprint = _fingerprint(score_mod)
    prepared = memo_get(_BY_FUNCTION, score_mod, fingerprint)
    if prepared is None:
        prepared = prepare(trace(score_mod, SCORE_MOD))
        memo_put(_BY_FUNCTION, score_mod, fingerprint, prepared)
    return prepared


def prepare_mask(block_mask) -> TracedMod | None:
    """The block mask's mask_mod, traced (flexfa's BlockMask keeps its trace) and simplified."""
    if block_mask is None:
        return None
    traced = getattr(block_mask, "traced_mask", None)
    if traced is None:
        traced = trace(block_mask.mask_mod, MASK_MOD)
    return prepare(traced)
