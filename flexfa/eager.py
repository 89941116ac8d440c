"""flexfa's entry points inside ``torch.compile``d code.

flexfa generates, compiles and launches its own kernels from Python (block-mask analysis,
tracing of the mods, plan caches, Triton launches), none of which Dynamo can or should trace.
Traced by ``torch.compile``, a call of an entry point is a graph break: Dynamo ends the graph
before it, the call runs eagerly (its autograd node joins the compiled graphs' ones, so
gradients flow through), and a new graph starts after it. ``fullgraph=True`` therefore
rejects a model that calls flexfa (Dynamo's error names the disabled function).
"""
from __future__ import annotations

import functools

import torch


def outside_compile(fn):
    """``fn`` as an entry point that runs outside torch.compile's graphs (see the module
    docstring); called eagerly it costs one ``torch.compiler.is_compiling()`` check.
    ``flexfa.flex_attention`` does the same check inline (its per-call cost matters)."""
    eager = torch.compiler.disable(fn)

    @functools.wraps(fn)
    def entry(*args, **kwargs):
        if torch.compiler.is_compiling():
            return eager(*args, **kwargs)
        return fn(*args, **kwargs)
    return entry
