"""FLOP counts of flexfa's calls for ``torch.utils.flop_counter.FlopCounterMode``.

``FlopCounterMode`` counts the aten operators it sees dispatched; flexfa's kernels are Triton
launches it never sees, so a model using flexfa counted no attention FLOPs at all. Each eager
call therefore reports its count, while such a mode is on torch's dispatch stack (and only
then: no operator and no host read otherwise), through two operators that compute nothing,
``flexfa::attention_forward(int flops)`` and ``flexfa::attention_backward(int flops)``, whose
flop formulas return their argument; the mode lists them under those names, in the module
that made the call. The counts are torch's for ``flex_attention`` (and SDPA): dense over the
shapes, two GEMMs forward (``2 B Hq L S (E + Ev)``) and five backward
(``2 B Hq L S (3 E + 2 Ev)``), whatever the mask skips, so a model counts as under torch's
``flex_attention``. A block mask of packed documents (``varlen_block_mask``,
``varlen_attention``) counts each document's queries against its own keys, as torch counts
``flash_attn_varlen``: ``sum(lq_i * lk_i)`` in place of ``L * S``. The ``flexfa::`` operators
of ``torch.compile``'s graphs (``flexfa.ops``) have the same formulas.
"""
from __future__ import annotations

import torch

_MARKERS: dict = {}  # "forward" / "backward" -> the operator (made on the first count)


def attention_flops(batch_heads: int, pairs: int, head_dim: int, value_dim: int,
                    backward: bool) -> int:
    """FLOPs of attention over ``pairs`` (query, key) pairs per head in each of
    ``batch_heads`` (B * Hq): a GEMM of ``m x n x k`` counts ``2 m n k``, as torch's."""
    per_pair = 3 * head_dim + 2 * value_dim if backward else head_dim + value_dim
    return 2 * batch_heads * pairs * per_pair


def counting():
    """The ``FlopCounterMode``'s mode on torch's dispatch stack, or None (callers first test
    ``torch._C._len_torch_dispatch_stack()``: nothing Python runs on the usual call)."""
    if not torch._C._len_torch_dispatch_stack():
        return None
    from torch.utils import flop_counter
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    # (the mode FlopCounterMode pushes is its helper _FlopCounterMode since torch 2.4)
    modes = (flop_counter.FlopCounterMode, getattr(flop_counter, "_FlopCounterMode",
                                                   flop_counter.FlopCounterMode))
    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, modes):
            return mode
    return None


def count(query, keys: int, value_dim: int, block_mask=None, backward: bool = False,
          head_dim: int | None = None) -> None:
    """Report one call's FLOPs to the ``FlopCounterMode`` on the stack, if there is one:
    ``query`` ``[B, Hq, L, E]`` (E: ``head_dim`` where given, the unpadded one), ``keys`` the
    keys each row is scored against (S), ``value_dim`` Ev, ``block_mask`` the call's (its
    packed documents, if any)."""
    mode = counting()
    if mode is None:
        return
    B, Hq, L, E = query.shape
    documents = getattr(block_mask, "documents", None)
    if documents is not None and documents.offsets.total_q == L:
        pairs = _document_pairs(documents.offsets)
    else:
        pairs = L * keys
    flops = attention_flops(B * Hq, pairs, E if head_dim is None else head_dim, value_dim,
                            backward)
    op = marker("backward" if backward else "forward")
    # a FlopCounterMode copies torch's formulas when it is made: one made before this
    # operator's first count is given its formula here
    registry = getattr(getattr(mode, "counter", mode), "flop_registry", None)
    if isinstance(registry, dict) and op.overloadpacket not in registry:
        registry[op.overloadpacket] = _formula
    op(flops)


def _document_pairs(offsets) -> int:
    """sum(lq_i * lk_i) over the packed documents (reads the offsets on the host)."""
    lq = offsets.cu_q.to("cpu", torch.int64).diff()
    lk = offsets.cu_k.to("cpu", torch.int64).diff()
    return int((lq * lk).sum())


def _formula(flops, *args, out_val=None, **kwargs) -> int:
    return flops


_formula._get_raw = True  # (register_flop_formula's mark of a formula given raw arguments)


def marker(which: str):
    """The operator ``flexfa::attention_<which>(int flops)`` (made and given its flop formula
    on the first count; modes made after that count it through torch's registry)."""
    op = _MARKERS.get(which)
    if op is None:
        op = _MARKERS[which] = _make_marker(which)
    return op


def _make_marker(which: str):
    from torch.utils.flop_counter import register_flop_formula

    @torch.library.custom_op(f"flexfa::attention_{which}", mutates_args=())
    def report(flops: int) -> None:
        """Computes nothing: ``FlopCounterMode`` counts ``flops`` when it sees this call."""

    op = getattr(torch.ops.flexfa, f"attention_{which}")
    register_flop_formula(op, get_raw=True)(_formula)
    return op.default
