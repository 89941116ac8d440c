"""``varlen_attention``: packed documents given by offsets, as ``flash_attn_varlen_func`` takes them.

query ``[total_q, Hq, E]``, key / value ``[total_k, Hkv, E / Ev]`` and the offsets run as one
flex_attention call on ``[1, H, total, E]`` views (no copy) under the documents' BlockMask
(``varlen_block_mask``), which is kept per offsets tensor: the layers of one batch share it,
its checks and its plans. A score_mod sees each document as a batch entry: ``b`` is the
document's index and ``q_idx`` / ``kv_idx`` are positions inside the document; flexfa rewrites
its IR to read them from per-token tensors (no new trace), so new lengths never compile anew.
"""
from __future__ import annotations

import numbers
import weakref

import torch

from .api import attend
from .blockmask.block_mask import BlockMask
from .blockmask.checks import block_size_pair
from .blockmask.offsets import check_offsets, check_window
from .blockmask.varlen import checked_block_mask
from .eager import outside_compile
from .errors import InputError, InputTypeError, check_bool, dims
from .features import check_sinks, prepare_dropout
from .frontend import ir
from .frontend.ir import DType, Op
from .frontend.trace import SCORE_MOD, TracedMod
from .inputs import (autocast_inputs, check_buffers, check_scale, check_shapes, check_tensors,
                     refuse_transforms)
from .memo import BoundedMemo, OwnedMemo, contents_of
from .calls import check_captured_indices
from .runtime.call import AttentionCall
from .runtime.options import parse_kernel_options
from .runtime.pipeline import prepare_score_mod
from .scores import check_score_range

__all__ = ["varlen_attention"]

# cu_seqlens_q -> {(its version, cu_seqlens_k's id and version, lengths, options): (weakref
# to cu_seqlens_k, BlockMask)}: held weakly by the offsets tensor, dropped with it
_MASKS = OwnedMemo(owners=64, per_owner=8, name="varlen block masks")
_NAMES = ("query", "key", "value")


@outside_compile
def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                     max_seqlen_k=None, causal=False, window=None, score_mod=None, scale=None,
                     return_lse=False, kernel_options=None, *, BLOCK_SIZE=128, sinks=None,
                     dropout_p=0.0, dropout_seed=None):
    """Attention within each packed document; ``flash_attn_varlen_func``'s interface.

    ``q`` ``[total_q, Hq, E]``, ``k`` ``[total_k, Hkv, E]``, ``v`` ``[total_k, Hkv, Ev]`` (Hkv
    divides Hq: grouped-query attention), ``cu_seqlens_q`` / ``cu_seqlens_k`` int32 or int64
    offsets with one entry more than documents (on the CPU or q's device) -> out ``[total_q,
    Hq, Ev]``, and with ``return_lse`` lse ``[Hq, total_q]`` float32 (natural log; -inf, or the
    head's sink with ``sinks``, and out 0 for a query that sees no key). ``causal`` is per
    document and aligned at its end (bottom-right, as flash_attn: query i of lq sees keys
    0..i + lk - lq); ``window=w`` keeps
    the keys at distance 0..w-1 before the query's diagonal (causal) or under w on both sides.
    ``max_seqlen_q`` / ``max_seqlen_k``, where given, must be at least the longest document.
    Offsets of no tokens (last entry 0) give flex_attention's results of an empty side.
    ``score_mod(score, b, h, q_idx, kv_idx)`` sees b = document, q_idx / kv_idx inside it;
    gradients reach q, k, v and the score_mod's captured tensors. ``BLOCK_SIZE`` is the mask's
    tile, ``kernel_options`` as for ``flex_attention``. ``sinks`` ``[Hq]`` (docs/sinks.md: one
    logit per head in every query's softmax) and ``dropout_p`` / ``dropout_seed``
    (docs/dropout.md) as ``flex_attention``'s; the keep mask is the packed call's,
    ``flexfa.dropout_mask(seed, 1, Hq, total_q, total_k, p)[0]`` at the packed positions.
    Under ``torch.autocast`` q, k and v are cast to its dtype first, as ``flex_attention``'s.
    """
    func = "varlen_attention"
    refuse_transforms(func)
    for name, tensor in zip(_NAMES, (q, k, v)):
        if isinstance(tensor, torch.Tensor) and tensor.dim() != 3:
            raise InputError(f"{func}: {name} must be 3-D [total_tokens, heads, head_dim], got "
                             f"shape {dims(tensor)}")
    query, key, value = autocast_inputs(*(t.unsqueeze(0).transpose(1, 2)
                                          if isinstance(t, torch.Tensor) else t
                                          for t in (q, k, v)))  # (as flex_attention)
    check_tensors(query, key, value)
    check_shapes(query, key, value, enable_gqa=True)
    causal = check_bool(f"{func}: causal", causal)
    return_lse = check_bool(f"{func}: return_lse", return_lse)
    window = check_window(func, window)
    scale = check_scale(scale, query.shape[3])
    if score_mod is not None and not callable(score_mod):
        raise InputTypeError(f"{func}: score_mod must be callable or None, got "
                             f"{type(score_mod).__name__}")
    block = block_size_pair(func, BLOCK_SIZE)
    if block[0] % 16 or block[1] % 16:
        raise InputError(f"{func}: BLOCK_SIZE must be a multiple of 16 (the kernels' tiles "
                         f"divide the documents' blocks), got BLOCK_SIZE={BLOCK_SIZE!r}")
    if q.shape[0] and k.shape[0]:
        block_mask = packed_block_mask(func, cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0],
                                       causal, window, block, q.device)
        offsets = block_mask.documents.offsets
    else:  # no queries or no keys: flex_attention's empty results (out 0, lse -inf or the
        # head's sink), no mask and nothing launched past the empty forward
        offsets = check_offsets(func, cu_seqlens_q, cu_seqlens_k, q.device, q.shape[0],
                                k.shape[0], empty_ok=True)
        block_mask = None
    for name, given, longest in (("max_seqlen_q", max_seqlen_q, offsets.max_q),
                                 ("max_seqlen_k", max_seqlen_k, offsets.max_k)):
        _check_max_seqlen(func, name, given, longest)
    check_score_range(query, key, scale)
    options = parse_kernel_options(kernel_options)
    sinks = check_sinks(sinks, query.shape[1], query.dtype, query.device)
    dropout = prepare_dropout(dropout_p, dropout_seed, query.device)
    if block_mask is None:  # nothing is scored; the score_mod's learnable tensors get zeros
        mask = None
        score = prepare_score_mod(score_mod)
        check_buffers(score, "score_mod", query.device)
    else:
        score = local_score_mod(func, score_mod, block_mask, query.shape[1])
        mask = block_mask.traced_mask
    call = AttentionCall(score, mask, block_mask, scale, options,
                         query.shape[1] // key.shape[1], sinks, dropout)
    out, lse, _ = attend(query, key, value, call, return_lse, False, func)
    out = out[0].transpose(0, 1)  # [total_q, Hq, Ev], a view
    return (out, lse[0]) if return_lse else out


def packed_block_mask(func: str, cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int,
                      causal: bool, window, block, device) -> BlockMask:
    """The documents' BlockMask, kept per offsets tensors (identity, version counter and
    memory: an in-place edit or ``cu.data = other`` builds a new one) for the calls of the
    same batch. Offsets on the CPU are also keyed by their contents: a write through a NumPy
    array sharing their memory (a loader refilling one buffer) bumps no version counter."""
    offsets = (cu_seqlens_q, cu_seqlens_k)
    contents = (contents_of(offsets) if all(isinstance(t, torch.Tensor) for t in offsets)
                else None)  # (not tensors: refused below; inference tensors: no key)
    versions = None if contents is None else contents[0]
    if versions is not None and all(t.device.type == "cpu" for t in offsets):
        try:
            versions += tuple(t.detach().numpy().tobytes() for t in offsets)
        except (RuntimeError, TypeError):  # a dtype NumPy lacks: refused below
            versions = None
    key = (versions, id(cu_seqlens_k), total_q, total_k, causal, window, block, device)
    if versions is not None:
        found = _MASKS.get(cu_seqlens_q, key)
        if found is not None and found[0]() is cu_seqlens_k:
            return found[1]
    mask = checked_block_mask(func, cu_seqlens_q, cu_seqlens_k, device, (total_q, total_k),
                              causal, window, block)
    if versions is not None:
        _MASKS.put(cu_seqlens_q, key, (weakref.ref(cu_seqlens_k), mask, contents[1]))
    return mask


def _check_max_seqlen(func: str, name: str, given, longest: int) -> None:
    if given is None:
        return
    if isinstance(given, bool) or not isinstance(given, numbers.Integral):
        raise InputTypeError(f"{func}: {name} must be an int or None, got "
                             f"{type(given).__name__} {given!r}")
    if given < longest:
        raise InputError(f"{func}: {name} is {given} but the longest document has {longest} "
                         "tokens; pass at least that, or None")


# ---- the score_mod on document-local positions ----------------------------------------------

# the leaves a score_mod reads that become per-token reads: (leaf, TokenTensors field, index)
_LOCAL = ((Op.B, "doc_q", Op.Q_IDX), (Op.Q_IDX, "pos_q", Op.Q_IDX),
          (Op.KV_IDX, "pos_k", Op.KV_IDX))
# (IR root, buffer count) -> (localized root, TokenTensors field of each added slot)
_LOCALIZED = BoundedMemo(256, "varlen score_mods")
# a mask's Documents -> {(score_mod trace's id, query heads, its captured tensors'
# ``contents_of`` keys): (weakref to the trace, their memory, held so the keys' addresses name
# no other)}: score_mods whose reads were checked document by document
_PER_DOCUMENT = OwnedMemo(owners=64, per_owner=8, name="varlen per-document index checks")


def local_score_mod(func: str, score_mod, block_mask: BlockMask, heads: int) -> TracedMod | None:
    """The traced ``score_mod`` with b, q_idx and kv_idx replaced by the document, and the
    positions inside it, of the packed token (reads of the mask's per-token tensors). Its own
    captured-tensor reads are checked in every document (``_check_reads``)."""
    traced = prepare_score_mod(score_mod)
    if traced is None:
        return None
    offsets, tokens = block_mask.documents.offsets, block_mask.documents.tokens
    check_buffers(traced, "score_mod", offsets.device)
    _check_reads(func, traced, block_mask.documents, heads)
    memo_key = (traced.root, len(traced.buffers))
    localized = _LOCALIZED.get(memo_key)
    if localized is None:
        localized = _LOCALIZED[memo_key] = _localize(traced.root, len(traced.buffers))
    root, fields = localized
    # dropped: the tensors simplification removed get flex_attention's zero gradient
    return TracedMod(SCORE_MOD, root, traced.buffers + tuple(getattr(tokens, f) for f in fields),
                     f"{traced.name}_varlen", traced.dropped)


def _check_reads(func: str, traced: TracedMod, documents, heads: int) -> None:
    """The score_mod's captured-tensor reads in range for every document (``b``, and q_idx /
    kv_idx inside it), as torch would find them calling it on each document alone. First
    over b < documents, q_idx < longest query document, kv_idx < longest key document (one
    memoized check); only where that fails, document by document (``bias[cu[b] + q_idx]``
    with a packed per-token tensor is in range in every document but not for the longest
    length at the last document), once per mask, heads and captured tensors' versions."""
    offsets = documents.offsets
    try:
        check_captured_indices(traced, None, (offsets.documents, heads, offsets.max_q),
                               offsets.max_k, offsets.device)
        return
    except InputError:
        pass
    contents = contents_of(traced.buffers)  # (None for inference tensors: every call)
    key = None if contents is None else (id(traced), heads, contents[0])
    found = None if key is None else _PER_DOCUMENT.get(documents, key)
    if found is not None and found[0]() is traced:
        return
    # one host read of the offsets (a device sync for CUDA ones), on this path only
    starts_q, starts_k = offsets.cu_q.tolist(), offsets.cu_k.tolist()
    for doc in range(offsets.documents):
        lq, lk = starts_q[doc + 1] - starts_q[doc], starts_k[doc + 1] - starts_k[doc]
        if lq == 0 or lk == 0:  # no score to compute: nothing is read
            continue
        root = ir.rewrite(traced.root, lambda n: ir.const(doc, DType.INT) if n.op is Op.B else n)
        try:
            check_captured_indices(TracedMod(SCORE_MOD, root, traced.buffers, traced.name),
                                   None, (1, heads, lq), lk, offsets.device)
        except InputError as error:  # (checked with b fixed: name it, not its range 0..0)
            message = str(error).replace("for b < 1,", f"for b = {doc},")
            raise InputError(f"{func}: in document {doc} ({lq} queries, {lk} keys) "
                             f"{message}") from None
    if key is not None:
        _PER_DOCUMENT.put(documents, key, (weakref.ref(traced), contents[1]))


def _localize(root: ir.Node, slots: int) -> tuple[ir.Node, tuple[str, ...]]:
    used = {node.op for node in root.toposort()}
    reads = {}
    for leaf, field, index in _LOCAL:
        if leaf in used:
            reads[leaf] = ir.load(slots + len(reads), (ir.index(index),), DType.INT), field
    localized = ir.rewrite(root, lambda n: reads[n.op][0] if n.op in reads else n)
    return localized, tuple(field for _, field in reads.values())
