"""``flex_decode``: attention of a few new query rows per sequence against a KV cache, with
per-sequence lengths and query positions, on a contiguous or a paged cache (the decode
family, ``flexfa.runtime.families.decode``).

Shapes, dtypes and devices are checked on every call (no host synchronisation). The values of
``kv_lens``, ``q_offsets`` and the page table are checked too with ``validate=True`` (the
default: one synchronisation); a serving loop whose ``PagedKVCache`` keeps them right passes
``validate=False``, which a CUDA-graph capture needs. Inference only: under grad mode, inputs
that require grad are refused (the output would carry them no gradient).
"""
from __future__ import annotations

import torch

from .blockmask.analysis import check_broadcast
from .blockmask.coarsen import runnable_block_mask
from .blockmask.validate import capturing, check_tables
from .eager import outside_compile
from .errors import InputError, InputTypeError, check_bool, dims
from .features import check_sinks
from .flops import count as count_flops
from .inputs import (autocast_inputs, broadcast_batch, check_block_mask_type, check_buffers,
                     check_head_dim, check_scale, check_table_shapes, check_tensors,
                     dual_level_open, refuse_tangents, refuse_transforms, requiring_grad)
from .runtime.call import AttentionCall
from .calls import check_captured_indices
from .lazy import lazy_function
from .runtime.decode_inputs import MAX_Q_LEN, DecodeInputs, DecodeWorkspace, kv_geometry
from .runtime.options import parse_kernel_options
from .runtime.pipeline import prepare_mask, prepare_score_mod
from .scores import check_score_range

run_decode = lazy_function("flexfa.runtime.families.decode", "run_decode")  # loads Triton

__all__ = ["flex_decode", "DecodeWorkspace", "check_decode_values", "check_no_grad",
           "decode_call"]


@outside_compile
def flex_decode(query, key, value, score_mod=None, block_mask=None, scale=None, *,
                kv_lens=None, q_offsets=None, page_table=None, return_lse=False,
                kernel_options=None, workspace: DecodeWorkspace | None = None,
                validate: bool = True, sinks=None):
    """Attention of ``query`` [B, Hq, L, E] (L <= 16 new rows per sequence) against a cache.

    The cache is ``key`` [B, Hkv, S, E] / ``value`` [B, Hkv, S, Ev] (batch 1: one cache
    shared by every query, as ``flex_attention`` broadcasts it) or, with ``page_table``
    [B, max_pages] int32, a paged cache [num_pages, page_size, Hkv, E] / [..., Ev] (vLLM's
    layout; ``flexfa.PagedKVCache`` keeps one), where logical key ``i`` of sequence ``b`` is
    row ``i % page_size`` of page ``page_table[b, i // page_size]``; S is then max_pages *
    page_size. Hq must be a multiple of Hkv (any ratio whose query heads per kv head times L
    are at most 128: one tile packs them).

    ``kv_lens`` [B] int32: sequence b has keys ``0 .. kv_lens[b] - 1`` (default: S).
    ``q_offsets`` [B] int32: the position of query row 0 of sequence b, so that row i has
    ``q_idx = q_offsets[b] + i`` in the mods (default: ``kv_lens[b] - L``, the queries being
    the last L keys, when ``kv_lens`` is given, else 0). The mods see the logical ``kv_idx``.
    A ``block_mask`` covers the positions: built for (L, S) without offsets, for (S, S) with
    them (``create_block_mask(mask_mod, B, H, S, S)``, as gpt-fast builds its masks).

    Returns ``out`` [B, Hq, L, Ev] (and lse [B, Hq, L] float32 with ``return_lse``); with a
    ``workspace`` the workspace's tensors, overwritten by the next call with it.
    ``kernel_options``: those of ``flex_attention`` (``SPLIT_KV`` fixes the split count).
    ``sinks`` [Hq]: attention sinks, as ``flex_attention``'s (docs/sinks.md); lse includes them.
    Under ``torch.autocast`` query, key and value are cast to its dtype first, as
    ``flex_attention``'s (a cache in another dtype is copied each call: keep it in the
    autocast dtype). Inside ``torch.compile`` a call is captured as the
    ``flexfa::flex_decode`` operator (``flexfa.compiled``; no ``workspace`` there).
    """
    query, key, value = autocast_inputs(query, key, value)
    return decode_call(query, key, value, score_mod, block_mask, scale, kv_lens, q_offsets,
                       page_table, return_lse, kernel_options, workspace, validate, sinks)


def decode_call(query, key, value, score_mod, block_mask, scale, kv_lens, q_offsets, page_table,
                return_lse, kernel_options, workspace, validate, sinks, traced_score=None):
    """``flex_decode`` of a call; ``traced_score`` (the ``flexfa::flex_decode`` operator's)
    is a score_mod traced already, used instead of ``score_mod``."""
    refuse_transforms("flex_decode")
    validate = check_bool("validate", validate)
    return_lse = check_bool("return_lse", return_lse)
    check_tensors(query, key, value)
    if workspace is not None and not isinstance(workspace, DecodeWorkspace):
        raise InputTypeError(f"workspace must be a flexfa.DecodeWorkspace or None, got "
                             f"{type(workspace).__name__}")
    if page_table is None and key.shape[0] == value.shape[0] == 1:
        key, value = broadcast_batch(query, key, value)  # one cache shared by every query
    inputs = _decode_inputs(query, key, value, kv_lens, q_offsets, page_table, workspace)
    Hkv, S = kv_geometry(key, inputs)
    B, Hq, L, E = query.shape
    scale = check_scale(scale, E)
    check_score_range(query, key, scale)  # only for an enormous scale, as flex_attention
    if score_mod is not None and not callable(score_mod):
        raise InputTypeError(f"score_mod must be callable or None, got {type(score_mod).__name__}")
    q_positions = S if inputs.offsets else L  # the block mask's q length
    past = _check_block_mask(block_mask, query, B, Hq, q_positions, S)
    if validate:
        check_decode_values(inputs, L, S, key.shape[0] if inputs.paged else None)
    options = parse_kernel_options(kernel_options)
    score = traced_score if traced_score is not None else prepare_score_mod(score_mod)
    mask = prepare_mask(block_mask)
    check_broadcast(mask, block_mask, B, Hq, q_positions, S)
    runnable = runnable_block_mask(block_mask, mask, past)
    if runnable is not block_mask:
        block_mask, mask = runnable, runnable.traced_mask
    check_buffers(score, "score_mod", query.device)
    check_buffers(mask, "mask_mod", query.device)
    check_no_grad(query, key, value, sinks, score.buffers if score else (),
                  mask.buffers if mask else ())
    check_captured_indices(score, mask, (B, Hq, q_positions, E), S, query.device)
    sinks = check_sinks(sinks, Hq, query.dtype, query.device)
    call = AttentionCall(score, mask, block_mask, scale, options, Hq // Hkv, sinks=sinks)
    if B == 0:  # nothing to launch: empty results, as flex_attention gives
        out = query.new_empty(0, Hq, L, value.shape[-1])
        lse = query.new_empty(0, Hq, L, dtype=torch.float32)
        return (out, lse) if return_lse else out
    if torch._C._len_torch_dispatch_stack():  # a FlopCounterMode counts it (flexfa.flops)
        count_flops(query, S, value.shape[-1])
    out, lse, _ = run_decode(query, key, value, call, inputs, return_lse)
    return (out, lse) if return_lse else out


def check_no_grad(query, key, value, sinks, score_buffers, mask_buffers) -> None:
    """flex_decode has no backward: an InputError for inputs that require grad, whose
    gradient the output would silently not carry (as flexfa.fp8's forward refuses them)."""
    named = [("query", query), ("key", key), ("value", value), ("sinks", sinks)]
    named += [("a score_mod captured tensor", t) for t in score_buffers]
    named += [("a mask_mod captured tensor", t) for t in mask_buffers]
    if dual_level_open():
        refuse_tangents("flex_decode", named)
    needing = requiring_grad(named)
    if needing:
        raise InputError(f"flex_decode is inference only (it has no backward), but "
                         f"{', '.join(needing)} requires grad; run it under torch.no_grad() / "
                         "torch.inference_mode(), detach the inputs, or use "
                         "flexfa.flex_attention, which has gradients")


def _int32_rows(name: str, tensor, shape: tuple, device) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise InputTypeError(f"{name} must be a torch.Tensor or None, got "
                             f"{type(tensor).__name__}")
    if tensor.dtype != torch.int32 or tuple(tensor.shape) != shape:
        raise InputError(f"{name} must be int32 of shape {shape}, got {tensor.dtype} of shape "
                         f"{dims(tensor)}")
    if tensor.device != device:
        raise InputError(f"{name} is on {tensor.device} but query is on {device}")
    if tensor.dim() == 1 and tensor.stride(0) != 1:
        raise InputError(f"{name} must be contiguous, got stride {tensor.stride(0)}")


def _decode_inputs(query, key, value, kv_lens, q_offsets, page_table, workspace) -> DecodeInputs:
    """The cache's layout checked against the query (no tensor values read)."""
    B, Hq, L, E = query.shape
    if not 1 <= L <= MAX_Q_LEN:
        raise InputError(f"query has {L} rows per head; flex_decode runs 1..{MAX_Q_LEN} (use "
                         "flex_attention for longer chunks)")
    page_size = 0
    if page_table is not None:
        if not isinstance(page_table, torch.Tensor) or page_table.dim() != 2:
            raise InputError("page_table must be a 2-D int32 tensor [B, max_pages], got "
                             + (f"shape {dims(page_table)}" if isinstance(page_table, torch.Tensor)
                                else type(page_table).__name__))
        _int32_rows("page_table", page_table, (B, page_table.shape[1]), query.device)
        pages, page_size, Hkv, _ = key.shape
        if tuple(value.shape[:3]) != (pages, page_size, Hkv):
            raise InputError(f"value cache has shape {dims(value)} but key cache "
                             f"{dims(key)}; both are [num_pages, page_size, Hkv, dim]")
        if page_size == 0 or page_size % 16:
            raise InputError(f"the paged cache has page_size {page_size}; the decode kernel "
                             "needs a positive multiple of 16")
    else:
        if key.shape[0] != B or value.shape[0] != B:
            raise InputError(f"key and value have batch sizes {key.shape[0]}, {value.shape[0]} "
                             f"but query has {B}; give both the query's batch or both 1 (one "
                             "cache shared by every query)")
        Hkv = key.shape[1]
        if tuple(value.shape[1:3]) != tuple(key.shape[1:3]):
            raise InputError(f"value has shape {dims(value)} but key {dims(key)}; "
                             "they need the same heads and length")
    if key.shape[3] != E:
        raise InputError(f"key has head_dim {key.shape[3]} but query has {E}")
    check_head_dim("query/key head_dim", E)
    check_head_dim("value head_dim", value.shape[3])
    if Hkv == 0:
        raise InputError(f"the cache has 0 heads (query {Hq}); attention needs at least one "
                         "head")
    if Hq % Hkv:
        raise InputError(f"query has {Hq} heads but the cache has {Hkv}; query heads must be a "
                         "multiple of kv heads")
    for name, tensor in (("kv_lens", kv_lens), ("q_offsets", q_offsets)):
        if tensor is not None:
            _int32_rows(name, tensor, (B,), query.device)
    return DecodeInputs(kv_lens, q_offsets, page_table, page_size, workspace)


def _check_block_mask(block_mask, query, B: int, Hq: int, q_len: int, S: int) -> bool | None:
    """Raise InputError unless the mask fits the call; else ``check_tables``' result."""
    if block_mask is None:
        return False
    check_block_mask_type(block_mask)
    mask_B, mask_H = block_mask.kv_num_blocks.shape[:2]
    lengths = tuple(getattr(block_mask, "seq_lengths", (q_len, S)))
    if mask_B not in (1, B) or mask_H not in (1, Hq) or lengths != (q_len, S):
        raise InputError(f"block_mask was built for (B={mask_B}, H={mask_H}, lengths={lengths}) "
                         f"but flex_decode needs (B={B} or 1, H={Hq} or 1, lengths={(q_len, S)}): "
                         "query positions x cache length, (S, S) with kv_lens or q_offsets")
    if block_mask.kv_num_blocks.device != query.device:
        raise InputError(f"block_mask is on {block_mask.kv_num_blocks.device} but query is on "
                         f"{query.device}")
    check_table_shapes(block_mask, q_len, S)
    return check_tables(block_mask, q_len, S)


def check_decode_values(inputs: DecodeInputs, L: int, S: int, num_pages: int | None) -> None:
    """The values of ``kv_lens``, ``q_offsets`` and the page table (one host synchronisation):
    0 <= kv_lens <= S, 0 <= q_offsets and q_offsets + L <= the sequence's length, and page
    table entries in 0 .. num_pages - 1 for every page holding keys below kv_lens."""
    if inputs.kv_lens is None and inputs.q_offsets is None and not inputs.paged:
        return  # no values to read (a capture needs no validate=False then)
    if capturing():
        raise InputError("flex_decode cannot check tensor values while a CUDA graph is being "
                         "captured; pass validate=False (check them before capturing)")
    lens = inputs.kv_lens
    if lens is not None:
        bad = ((lens < 0) | (lens > S)).nonzero()
        if len(bad):
            b = int(bad[0, 0])
            raise InputError(f"kv_lens[{b}] = {int(lens[b])} is outside the cache's 0..{S} keys")
    if inputs.q_offsets is not None:
        ends = inputs.q_offsets.long() + L  # int64: offsets near 2**31 must not wrap
        limit = lens if lens is not None else torch.full_like(ends, S)
        bad = ((inputs.q_offsets < 0) | (ends > limit)).nonzero()
        if len(bad):
            b = int(bad[0, 0])
            offset = int(inputs.q_offsets[b])
            raise InputError(f"q_offsets[{b}] = {offset} is negative" if offset < 0 else
                             f"q_offsets[{b}] = {offset} puts the {L} query rows at positions "
                             f"past the sequence's {int(limit[b])} keys (kv_lens, else the "
                             "cache length)")
    if inputs.paged:
        table, size = inputs.page_table, inputs.page_size
        used = -(-(lens if lens is not None else torch.full((table.shape[0],), S,
                                                             device=table.device)) // size)
        live = torch.arange(table.shape[1], device=table.device)[None, :] < used[:, None]
        bad = (live & ((table < 0) | (table >= num_pages))).nonzero()
        if len(bad):
            b, i = (int(x) for x in bad[0])
            raise InputError(f"page_table[{b}, {i}] = {int(table[b, i])} is not a page of the "
                             f"cache (0..{num_pages - 1}); sequence {b} uses its first "
                             f"{int(used[b])} pages")
