"""``flex_attention``: the drop-in for ``torch.nn.attention.flex_attention.flex_attention``.

Inputs are validated first (flexfa's error classes, naming the argument and the values), the
mods are traced and simplified, and the call goes through ``FlexAttentionFunction`` when a
gradient is needed, else straight to the forward kernel.
"""
from __future__ import annotations

import operator
import weakref

import torch
from torch.autograd import forward_ad

from . import compiled
from .autograd import FlexAttentionFunction
from .calls import attention_call
from .errors import InputTypeError, check_bool
from .features import check_sinks, prepare_dropout
from .flops import count as count_flops
from .inputs import (autocast_inputs, check_aux, check_block_mask, check_scale, check_shapes,
                     check_tensors, readable, refuse_tangents, refuse_transforms)
from .lazy import lazy_function
from .memo import BoundedMemo
from .prepared import lookup, record, signature
from .runtime.options import parse_kernel_options
from .runtime.pipeline import prepare_score_mod

try:  # torch >= 2.9: flex_attention's return_aux request and result types
    from torch.nn.attention.flex_attention import AuxOutput
except ImportError:  # pragma: no cover - older torch
    from typing import NamedTuple

    class AuxOutput(NamedTuple):
        """The auxiliary outputs of ``flex_attention(..., return_aux=...)``: None where not
        requested (torch's ``AuxOutput`` where torch has one)."""

        lse: torch.Tensor | None = None
        max_scores: torch.Tensor | None = None

run_forward = lazy_function("flexfa.runtime.forward", "run_forward")  # loads Triton
check_early = lazy_function("flexfa.runtime.backward", "check_early")

# signatures whose tensor, shape and block-mask checks passed: a repeated call skips them (the
# Python-side cost of a cached call, benchmarks/host_cost.py). An entry holds the block
# mask and its tables only by weak reference (ids in the key, identity checked on a hit), so
# it neither keeps a dropped mask alive nor matches a new object that reuses an id.
_VALIDATED = BoundedMemo(256, "validated signatures")
_MASK_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices", "mask_mod")
_mask_fields = operator.attrgetter(*_MASK_FIELDS)
# the tables whose shapes check_block_mask reads (B, H and the tiles; check_tables, run
# whenever a table changed, checks the other tables' shapes against these). A table cannot
# move to another device in place.
_shaped_fields = operator.itemgetter(0, 1, 3, 5, 7)


def _validation_key(query, key, value, block_mask, enable_gqa) -> tuple | None:
    """(key, objects) of everything the tensor, shape and block-mask checks read, for plain
    tensors (None: a tensor subclass or one the kernels cannot read as it is, checked every
    time). The mask enters by the identity of the object and of each table (``objects``), and
    by its block size, lengths and tables' shapes."""
    if not type(query) is type(key) is type(value) is torch.Tensor or \
            not readable(query, key, value):
        return None
    if block_mask is None:
        objects, mask_key = (), None
    else:
        try:
            fields = _mask_fields(block_mask)
        except AttributeError:  # a duck-typed mask without some of the tables
            fields = tuple(getattr(block_mask, n, None) for n in _MASK_FIELDS)
        objects = (block_mask, *fields)
        try:  # shapes too: ``set_`` / ``resize_`` change them in place (the same objects)
            shapes = [None if t is None else t.shape for t in _shaped_fields(fields)]
        except AttributeError:  # a table that is not a tensor: refused by the check
            return None
        mask_key = (tuple(map(id, objects)), getattr(block_mask, "BLOCK_SIZE", None),
                    getattr(block_mask, "seq_lengths", None), tuple(shapes))
    key_ = (query.shape, key.shape, value.shape, query.dtype, key.dtype, value.dtype,
            query.device, key.device, value.device, enable_gqa, mask_key)
    return key_, objects


def _weak(objects: tuple) -> tuple | None:
    """Weak references to ``objects`` (None entries kept as None), or None if one of them
    cannot be weakly referenced (such a signature is checked every time)."""
    try:
        return tuple(None if o is None else weakref.ref(o) for o in objects)
    except TypeError:
        return None


def _still_same(refs: tuple, objects: tuple) -> bool:
    return all((r is None and o is None) or (r is not None and r() is o)
               for r, o in zip(refs, objects))


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None,
                   enable_gqa=False, return_lse=False, kernel_options=None, *, return_aux=None,
                   sinks=None, dropout_p=0.0, dropout_seed=None):
    """Attention with a score_mod and a block mask, as one fused kernel generated for them.

    query ``[B, Hq, L, E]``, key ``[B, Hkv, S, E]``, value ``[B, Hkv, S, Ev]`` (fp16, bf16 or
    fp32, one device; under ``torch.autocast`` cast to its dtype first, as torch casts them)
    -> out ``[B, Hq, L, Ev]`` in query's dtype; with ``return_lse`` also
    lse ``[B, Hq, L]`` float32 (natural log; -inf for a row that attends to nothing, whose
    output is 0). ``return_aux=AuxRequest(lse=..., max_scores=...)`` (torch's newer form)
    returns ``(out, AuxOutput(lse, max_scores))``, each None unless requested; max_scores
    ``[B, Hq, L]`` float32 is each row's largest score_mod(q.k * scale) over the keys its mask
    keeps (-inf for a row with nothing to attend), without a gradient.
    ``score_mod(score, b, h, q_idx, kv_idx)`` sees ``q.k * scale``; ``scale`` defaults to
    ``1/sqrt(E)``. ``block_mask=None`` is dense attention. CUDA inputs run compiled kernels;
    CPU inputs run the same kernels under the Triton interpreter. Inside ``torch.compile`` a
    call is captured as the ``flexfa::flex_attention`` operator (``flexfa.compiled``).
    ``kernel_options``: docs/kernel-options.md (``flexfa.runtime.options.SCHEMA``).
    ``sinks`` (flexfa's, docs/sinks.md): ``[Hq]`` per-head sink logits (float32 or the query's
    dtype), one more term of each row's softmax denominator with no value; lse includes it,
    a row with nothing to attend gets out 0 and lse = its sink; gradients flow into it.
    ``dropout_p`` (flexfa's, as SDPA's; docs/dropout.md): drop each attention probability
    with this probability and scale the kept ones by 1 / keep rate (about 1 / (1 - p)); lse
    is unaffected; applied whenever p > 0 (pass ``p if module.training else 0.0``).
    ``dropout_seed``: an int or a (seed, offset) pair; None draws one from torch's generator
    of the query's device.
    """
    if torch.compiler.is_compiling():  # traced by torch.compile: the flexfa:: operators
        out, lse, maxs, aux_lse = compiled.attention(query, key, value, score_mod, block_mask,
                                                     scale, enable_gqa, return_lse,
                                                     kernel_options, return_aux, sinks,
                                                     dropout_p, dropout_seed)
        return _result(out, lse, maxs, return_lse, return_aux, aux_lse)
    if torch._C._are_functorch_transforms_active():  # (their wrapped tensors: no storage)
        refuse_transforms("flex_attention")
    query, key, value = autocast_inputs(query, key, value)
    prepared = signature(query, key, value, score_mod, scale, enable_gqa, return_lse,
                         kernel_options, return_aux, sinks, dropout_p, dropout_seed)
    score = None  # the score_mod's trace, where the lookup made it
    if prepared is not None:  # a repeated call: its checks of what may have changed
        found, score = lookup(prepared, query, key, value, score_mod, block_mask)
        if found is not None:
            call, key, value = found
            if return_aux is None:
                out, lse, _ = attend(query, key, value, call, return_lse, False)
                return (out, lse) if return_lse else out
            aux_lse, aux_max = return_aux  # torch's AuxRequest of two bools (signature's)
            out, lse, maxs = attend(query, key, value, call, aux_lse, aux_max)
            return _result(out, lse, maxs, False, return_aux, aux_lse)
    signature_ = _validation_key(query, key, value, block_mask, enable_gqa)
    checked = False  # the tensor, shape and block-mask checks passed for this signature before
    if signature_ is not None:
        try:
            refs = _VALIDATED.get(signature_[0])
        except TypeError:  # a mask field that cannot be hashed: checked every time
            signature_ = refs = None
        checked = refs is not None and _still_same(refs, signature_[1])
    if not checked:
        check_tensors(query, key, value)
    enable_gqa = check_bool("enable_gqa", enable_gqa)
    return_lse = check_bool("return_lse", return_lse)
    aux_lse, aux_max = check_aux(return_aux, return_lse)
    if not checked:
        check_shapes(query, key, value, enable_gqa)
    scale = check_scale(scale, query.shape[3])
    if score_mod is not None and not callable(score_mod):
        raise InputTypeError(f"score_mod must be callable or None, got {type(score_mod).__name__}")
    if not checked:
        check_block_mask(block_mask, query, key)
        refs = _weak(signature_[1]) if signature_ is not None else None
        if refs is not None:
            _VALIDATED[signature_[0]] = refs
    options = parse_kernel_options(kernel_options)
    if score is None:
        score = prepare_score_mod(score_mod)
    sinks = check_sinks(sinks, query.shape[1], query.dtype, query.device)
    call, key, value = attention_call(query, key, value, score, block_mask, scale, options,
                                      torch.is_grad_enabled(), sinks,
                                      prepare_dropout(dropout_p, dropout_seed, query.device))
    if prepared is not None:
        record(prepared, query, key, score_mod, block_mask, call)
    out, lse, maxs = attend(query, key, value, call, return_lse or aux_lse, aux_max)
    return _result(out, lse, maxs, return_lse, return_aux, aux_lse)


def attend(query, key, value, call, return_lse: bool, return_max: bool,
           func: str = "flex_attention"):
    """(out, lse or None, row max or None) of a validated call: through the autograd Function
    when a gradient is needed (lse is then always computed), else the forward alone; ``func``
    names the entry point in errors (an input with a forward-mode tangent is refused)."""
    buffers = call.score.buffers if call.score is not None else ()
    # (captured tensors the trace dropped that require grad: their gradient is zeros)
    dropped = tuple(t for t in call.score.dropped if t.requires_grad) if call.score else ()
    sinks = call.sinks
    if getattr(forward_ad, "_current_level", -1) >= 0:  # (inputs.dual_level_open)
        refuse_tangents(func, (("query", query), ("key", key), ("value", value),
                               ("sinks", sinks), *((f"score_mod's captured tensor {n}", t)
                                                   for n, t in enumerate(buffers))))
    if torch._C._len_torch_dispatch_stack():  # a FlopCounterMode counts it (flexfa.flops)
        count_flops(query, key.shape[2], value.shape[3], call.block_mask)
    if torch.is_grad_enabled() and (
            query.requires_grad or key.requires_grad or value.requires_grad
            or (sinks is not None and sinks.requires_grad)
            or (buffers and any(t.requires_grad for t in buffers)) or dropped):
        if call.options.gluon_bwd_stages:  # (its backward family's refusal, before a launch)
            check_early(call, query, key, value)
        return FlexAttentionFunction.apply(query, key, value, call, return_max, sinks, *buffers,
                                           *dropped)
    return run_forward(query, key, value, call, return_lse, return_max)


def _result(out, lse, maxs, return_lse: bool, return_aux, aux_lse: bool):
    if return_aux is not None:
        return out, AuxOutput(lse=lse if aux_lse else None, max_scores=maxs)
    return (out, lse) if return_lse else out
