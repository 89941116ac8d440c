"""Functions whose module loads on their first call: ``import flexfa`` stays cheap.

The runtime imports Triton (about half a second) and the operators register with
``torch.library``; a process that only builds block masks, or imports flexfa without calling
it, needs neither.
"""
from __future__ import annotations

import importlib


def lazy_function(module: str, name: str):
    """A stand-in for ``module.name`` that imports ``module`` on the first call."""
    found = []

    def call(*args, **kwargs):
        if not found:
            found.append(getattr(importlib.import_module(module), name))
        return found[0](*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"``{module}.{name}``, imported on the first call."
    return call
