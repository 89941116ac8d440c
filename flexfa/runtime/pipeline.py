"""The front half of the compile pipeline: trace (which simplifies), with FLEXFA_DEBUG dumps.

The backward continues from the same traced mods (grad -> render -> load). Traces are
memoized under their guards by ``flexfa.frontend.trace``; nothing here holds a mod or its
captured tensors.
"""
from __future__ import annotations

from ..frontend.ir import format_ir
from ..frontend.trace import MASK_MOD, SCORE_MOD, TracedMod, trace, trace_entry
from .debug import debug, debug_enabled


def _dump(entry) -> None:
    """FLEXFA_DEBUG: the IR as traced and after simplification."""
    if debug_enabled():
        traced = entry.traced
        if entry.raw_root is not None:
            debug(f"traced {traced.kind} {traced.name}", format_ir(entry.raw_root))
        debug(f"simplified {traced.kind} {traced.name}", traced.format())


def prepare_score_mod(score_mod) -> TracedMod | None:
    """The score_mod traced (memoized under its guard) and simplified."""
    if score_mod is None:
        return None
    entry = trace_entry(score_mod, SCORE_MOD)
    if "dumped" not in entry.derived:
        entry.derived["dumped"] = True
        _dump(entry)
    return entry.traced


def prepare_mask(block_mask) -> TracedMod | None:
    """The block mask's mask_mod, traced (flexfa's BlockMask keeps its trace) and simplified."""
    if block_mask is None:
        return None
    traced = getattr(block_mask, "traced_mask", None)
    return traced if traced is not None else trace(block_mask.mask_mod, MASK_MOD)
