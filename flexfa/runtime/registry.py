"""Kernel families as plug-ins: each says when it applies, plans a call and runs its plan.

A family is one object registered here, in a preference order per direction ("forward",
"backward", "fp8"): a call takes the first family that applies to it on its target, or the
one ``kernel_options["BACKEND"]`` names (an error naming the reason when that one cannot run
the call). Adding a family is one module under ``flexfa/runtime/families/`` and one
``register`` call there (docs/design.md walks through it).

The protocol (``KernelFamily``):

- ``name`` (the BACKEND value that forces it), ``direction``, ``priority`` (higher first);
- ``features``: the optional features of a call it implements ("sinks", "dropout"; none by
  default), so that a call using one never reaches a family that would ignore it;
- ``why_not(target, call, *tensors)``: None when the family can run the call, else a phrase
  saying why not (shown when BACKEND forces it);
- ``check_options(call, *tensors)``: raise what the family's own kernel_options would make
  its first call raise (none by default), so that a backward family's refusal comes at the
  forward, before any launch (``runtime.backward.check_early``);
- ``first_call(key, target, call, *inputs)``: plan (tune, render, load), keep the plan under
  ``key`` (``flexfa.runtime.plans``) and run it;
- ``run(plan, call, *inputs)``: the cached path.
"""
from __future__ import annotations

import logging

from ..errors import InputError
from .target import Target

log = logging.getLogger("flexfa")

DIRECTIONS = ("forward", "backward", "fp8")
_FAMILIES: dict[str, list] = {direction: [] for direction in DIRECTIONS}
_LOGGED: set = set()


class KernelFamily:
    """Base class of the families; see the module docstring."""

    name = ""
    direction = "forward"
    priority = 0
    features: frozenset = frozenset()

    def why_not(self, target: Target, call, *tensors) -> str | None:
        return None

    def check_options(self, call, *tensors) -> None:
        return None

    def first_call(self, key, target: Target, call, *inputs):
        raise NotImplementedError

    def run(self, plan, call, *inputs):
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<kernel family {self.name} ({self.direction})>"


def register(family: KernelFamily) -> KernelFamily:
    assert family.direction in DIRECTIONS, family.direction
    families = _FAMILIES[family.direction]
    assert all(f.name != family.name for f in families), f"{family.name} registered twice"
    families.append(family)
    families.sort(key=lambda f: -f.priority)
    return family


def families(direction: str) -> tuple:
    return tuple(_FAMILIES[direction])


def choose(direction: str, target: Target, call, *tensors) -> KernelFamily:
    """The family that runs this call: the forced one (BACKEND names a family of this
    direction), else the first that applies."""
    candidates = _FAMILIES[direction]
    forced = call.options.backend
    for family in candidates:
        if family.name.upper() == forced:
            reason = _why_not(family, target, call, tensors)
            if reason is not None:
                raise InputError(f"kernel_options BACKEND={forced!r} cannot run this call: "
                                 f"{reason}")
            return family
    reasons = []
    for family in candidates:
        reason = _why_not(family, target, call, tensors)
        if reason is None:
            if target.newer_than_known:
                _log_newer(target, family)
            return family
        reasons.append(f"{family.name}: {reason}")
    raise InputError(f"no {direction} kernel family runs this call on {target}: "
                     + "; ".join(reasons))


def _why_not(family: KernelFamily, target: Target, call, tensors) -> str | None:
    """The family's reason not to run the call, a feature it lacks first."""
    missing = call.features - family.features
    if missing:
        return f"it has no {' and '.join(sorted(missing))}"
    return family.why_not(target, call, *tensors)


def _log_newer(target: Target, family: KernelFamily) -> None:
    if (target, family.name) not in _LOGGED:
        _LOGGED.add((target, family.name))
        log.warning("flexfa: %s is newer than the GPUs flexfa's kernels were tuned for; its "
                    "%s calls use the %s family (kernel_options BACKEND chooses another)",
                    target, family.direction, family.name)
