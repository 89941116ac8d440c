"""flexfa's entry points inside ``torch.compile``d code.

``flexfa.flex_attention`` and ``flexfa.create_block_mask`` are captured into the graph as
``flexfa::`` operators (``flexfa.compiled``, which registers itself here with ``in_graph``).
An entry point without such a version (``flexfa.fp8.flex_attention_fp8``) is a graph break:
Dynamo ends the graph before it, the call runs eagerly (its autograd node joins the compiled
graphs' ones, so gradients flow through), and a new graph starts after it. Nothing here
imports ``torch._dynamo``: that happens on the first call inside a compiled region, where
Dynamo is loaded already.
"""
from __future__ import annotations

import functools

import torch

# entry point name -> its version for torch.compile (registered by a higher layer)
_IN_GRAPH: dict = {}


def in_graph(name: str):
    """Register the decorated function as what the entry point ``name`` runs while Dynamo
    traces it."""
    def register(fn):
        _IN_GRAPH[name] = fn
        return fn
    return register


def outside_compile(fn):
    """``fn`` as an entry point for torch.compile'd code: its ``in_graph`` version while Dynamo
    traces, else (none registered) a graph break (see the module docstring); called eagerly it
    costs one ``torch.compiler.is_compiling()`` check."""
    name = fn.__name__
    disabled = []

    @functools.wraps(fn)
    def entry(*args, **kwargs):
        if torch.compiler.is_compiling():
            traced = _IN_GRAPH.get(name)
            if traced is not None:
                return traced(*args, **kwargs)
            if not disabled:  # made on first use, when Dynamo is already loaded
                disabled.append(torch.compiler.disable(fn))
            return disabled[0](*args, **kwargs)
        return fn(*args, **kwargs)
    return entry
