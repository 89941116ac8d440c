"""Mask combinators: ``and_masks``, ``or_masks`` and ``noop_mask``, as in torch.

They are plain Python mask_mods: called with traced values they trace like any mod, called
with real index tensors they compute the mask (so they also work with torch's own
``create_block_mask``). Each combined mod is named after its parts,
e.g. ``and_masks(causal, sliding_window_64)``, so errors and kernel names say what it is.
"""
from __future__ import annotations

import torch

from ..errors import InputTypeError
from .trace import MASK_MOD, mod_kind, mod_name


def noop_mask(b, h, q_idx, kv_idx):
    """Keep everything: True for every (b, h, q_idx, kv_idx)."""
    return b.new_ones((), dtype=torch.bool)


def and_masks(*mask_mods):
    """A mask_mod keeping what every one of ``mask_mods`` keeps (all True if none given)."""
    return _combine("and_masks", mask_mods, start=True, combine=lambda x, y: x & y)


def or_masks(*mask_mods):
    """A mask_mod keeping what any one of ``mask_mods`` keeps (all False if none given)."""
    return _combine("or_masks", mask_mods, start=False, combine=lambda x, y: x | y)


def _combine(combinator: str, mask_mods: tuple, start: bool, combine):
    for position, mod in enumerate(mask_mods):
        if not callable(mod):
            raise InputTypeError(f"{combinator}: argument {position} must be a mask_mod "
                                 f"(a function), got {type(mod).__name__} {mod!r:.60}")
        if torch.compiler.is_compiling():
            # (Dynamo cannot read a signature of a function made in the compiled code; the
            # combined mod's trace, outside Dynamo, calls each with four arguments)
            continue
        kind = mod_kind(mod)
        if kind != MASK_MOD:
            raise InputTypeError(
                f"{combinator}: argument {position} ({mod_name(mod)}) is a {kind}; only mask_mods "
                "(b, h, q_idx, kv_idx) -> bool can be combined")

    def combined(b, h, q_idx, kv_idx):
        result = b.new_full((), start, dtype=torch.bool)
        for mod in mask_mods:
            result = combine(result, mod(b, h, q_idx, kv_idx))
        return result

    name = f"{combinator}({', '.join(mod_name(m) for m in mask_mods)})"
    combined.__name__ = combined.__qualname__ = name
    combined.__doc__ = f"The mask_mod {name}."
    return combined
