"""The eager reference: dense attention with a score_mod and a mask, in float64 by default.

It materializes the ``[B, H, L, S]`` scores, so it is for checking at small sizes only (the
demo, the examples, the tests). The mods are traced and evaluated through
``flexfa.frontend.evaluate``, the same IR the kernels are generated from, and the whole
computation is differentiable in q, k, v and in captured tensors that require grad.
"""
from __future__ import annotations

import math
import numbers

import torch

from .errors import InputError, InputTypeError, check_bool, dims
from .frontend import dense_mask, evaluate, index_grids, trace
from .runtime.dropout import scale as dropout_scale


def attention_reference(query, key, value, score_mod=None, mask_mod=None, *, scale=None,
                        enable_gqa=False, return_lse=False, return_max=False,
                        dtype=torch.float64, sinks=None, dropout_mask=None, dropout_p=0.0):
    """``softmax(score_mod(q k^T * scale) masked by mask_mod) @ v``, computed in ``dtype``.

    Shapes as ``flex_attention``: query ``[B, Hq, L, E]``, key ``[B, Hkv, S, E]``, value
    ``[B, Hkv, S, Ev]``. A row with nothing to attend gives out = 0 and lse = -inf (and zero
    gradients). Returns out, then lse (natural log) if ``return_lse``, then each row's max
    score (-inf for an empty row; torch's ``AuxRequest(max_scores=True)``) if ``return_max``,
    in ``dtype``.

    ``sinks`` [Hq]: per-head logits that join each row's softmax as a column without a value
    (lse includes them; an empty row gets out 0 and lse = its sink); differentiable.
    ``dropout_mask`` (bool [B, Hq, L, S], e.g. ``flexfa.dropout_mask``) with ``dropout_p``:
    the probabilities are multiplied by mask / (the keep rate: 1 - p rounded to a multiple of
    2**-16, ``flexfa.runtime.dropout.scale``) before ``@ v``; lse is unaffected.
    """
    _check_inputs(query, key, value, scale, enable_gqa, sinks, dropout_mask, dropout_p)
    B, Hq, L, E = query.shape
    Hkv, S = key.shape[1], key.shape[2]
    if Hq != Hkv:
        if not enable_gqa or Hq % Hkv:
            raise InputError(f"query has {Hq} heads but key has {Hkv}; pass enable_gqa=True "
                             "with query heads a multiple of key heads")
        key = key.repeat_interleave(Hq // Hkv, dim=1)
        value = value.repeat_interleave(Hq // Hkv, dim=1)
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    q, k, v = (t.to(dtype) for t in (query, key, value))
    scores = q @ k.transpose(-1, -2) * scale
    if score_mod is not None:
        b, h, q_idx, kv_idx = index_grids(B, Hq, L, S, device=query.device)
        scores = evaluate(trace(score_mod), score=scores, b=b, h=h, q_idx=q_idx, kv_idx=kv_idx,
                          float_dtype=dtype).expand(B, Hq, L, S)
    if mask_mod is not None:
        keep = dense_mask(trace(mask_mod), B, Hq, L, S, device=query.device)
        scores = scores.masked_fill(~keep, -math.inf)
    row_max = scores.amax(dim=-1) if return_max else None
    if sinks is not None:  # one more column, without a value
        sink_column = sinks.to(dtype).view(1, Hq, 1, 1).expand(B, Hq, L, 1)
        scores = torch.cat([scores.expand(B, Hq, L, S), sink_column], dim=-1)
    # empty rows: take the logsumexp of zeros instead of -inf (a NaN-free backward), then
    # report -inf; their probabilities exp(-inf - finite) are exactly 0. A row is empty only
    # when every score is -inf: one of NaN or +inf scores is not, its lse NaN or +inf (torch's)
    has_any = (scores != -math.inf).any(dim=-1, keepdim=True)
    lse = torch.logsumexp(torch.where(has_any, scores, torch.zeros_like(scores)), dim=-1,
                          keepdim=True)
    # softmax (its row max subtracted), not exp(scores - lse): where log(sum) is below half an
    # ulp of a huge row max, lse rounds to that max and exp(scores - lse) sums V instead of
    # averaging it. A row whose lse is +inf (a +inf sink or score) keeps exp(scores - lse):
    # the limit, 0 for its finite scores (its softmax input zeroed: no NaN in the backward)
    limit = lse == math.inf
    finite = torch.where(has_any & ~limit, scores, torch.zeros_like(scores))
    probs = torch.where(limit, torch.exp(scores - lse), torch.softmax(finite, dim=-1) * has_any)
    if sinks is not None:
        probs = probs[..., :S]
    if dropout_mask is not None:
        probs = probs * dropout_mask.to(dtype) * dropout_scale(dropout_p)
    out = probs @ v
    results = [out]
    if return_lse:
        results.append(torch.where(has_any, lse, torch.full_like(lse, -math.inf)).squeeze(-1))
    if return_max:
        results.append(row_max)
    return results[0] if len(results) == 1 else tuple(results)


def _check_inputs(query, key, value, scale, enable_gqa, sinks, dropout_mask, dropout_p):
    """The reference's arguments as flex_attention checks them (float64 allowed): it
    broadcast a key batch of 3 against a query batch of 1, read a float dropout mask as
    weights and ran p > 0 without a mask, all silently, and crashed inside torch on others."""
    func = "attention_reference"
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or not t.is_floating_point():
            raise InputTypeError(f"{func}: {name} must be a 4-D float tensor, got "
                                 f"{getattr(t, 'dtype', type(t).__name__)} of shape "
                                 f"{tuple(getattr(t, 'shape', ()))}")
    B, Hq, L, E = query.shape
    if key.shape[0] != value.shape[0] or key.shape[0] not in (1, B) or key.shape[1] != \
            value.shape[1] or key.shape[2] != value.shape[2] or key.shape[3] != E:
        raise InputError(f"{func}: query {dims(query)}, key {dims(key)} and value "
                         f"{dims(value)} must be [B, Hq, L, E], [B or 1, Hkv, S, E] and "
                         "[B or 1, Hkv, S, Ev]")
    check_bool(f"{func}: enable_gqa", enable_gqa)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)
                              or not math.isfinite(scale)):
        raise InputError(f"{func}: scale must be a finite number or None, got {scale!r:.40}")
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (Hq,)):
        raise InputError(f"{func}: sinks must be a tensor of shape ({Hq},), got "
                         f"{tuple(getattr(sinks, 'shape', ())) or type(sinks).__name__}")
    if not isinstance(dropout_p, numbers.Real) or not 0 <= dropout_p < 1:
        raise InputError(f"{func}: dropout_p must be in [0, 1), got {dropout_p!r:.40}")
    if dropout_mask is None and dropout_p > 0:
        raise InputError(f"{func}: dropout_p={dropout_p} needs the call's keep mask as "
                         "dropout_mask (flexfa.dropout_mask(seed, B, H, L, S, p))")
    if dropout_mask is not None and (not isinstance(dropout_mask, torch.Tensor)
                                     or dropout_mask.dtype is not torch.bool):
        raise InputTypeError(f"{func}: dropout_mask must be a bool tensor (flexfa.dropout_mask), "
                             f"got {getattr(dropout_mask, 'dtype', type(dropout_mask).__name__)}")


def max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference, computed in float64 (0.0 for empty tensors)."""
    if got.numel() == 0:
        return 0.0
    return (got.detach().double() - want.detach().double()).abs().max().item()


def error_bound(eager_error: float, dtype: torch.dtype, fudge: float = 4.0) -> float:
    """How far a kernel result may be from the float64 reference.

    ``fudge`` times the error of the same computation done eagerly in the kernel's input
    dtype, plus a floor for that dtype (kernels accumulate in float32 in a different order).
    """
    floor = {torch.float16: 2e-3, torch.bfloat16: 1e-2}.get(dtype, 1e-4)
    return fudge * eager_error + floor
