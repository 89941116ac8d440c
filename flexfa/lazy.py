"""Functions whose module loads on their first call: ``import flexfa`` stays cheap.

The runtime imports Triton (about half a second) and the operators register with
``torch.library``; a process that only builds block masks, or imports flexfa without calling
it, needs neither.
"""
from __future__ import annotations

import importlib

# this package's own name: "flexfa", or the name another copy of the tree was imported under
# (benchmarks/tree_ab.py loads an older tree as "flexfa_old": its lazy functions must load
# its own runtime, not this process's flexfa)
_PACKAGE = __name__.rpartition(".")[0]


def lazy_function(module: str, name: str):
    """A stand-in for ``module.name`` that imports ``module`` on the first call; a module
    under ``flexfa.`` is looked up in this copy's own package."""
    if module.startswith("flexfa."):
        module = _PACKAGE + module[len("flexfa"):]
    found = []

    def call(*args, **kwargs):
        if not found:
            found.append(getattr(importlib.import_module(module), name))
        return found[0](*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"``{module}.{name}``, imported on the first call."
    return call
