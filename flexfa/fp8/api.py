"""``flex_attention_fp8``: flex_attention with Q, K, V in e4m3 (forward only)."""
from __future__ import annotations

import dataclasses

import torch

from ..inputs import (broadcast_batch, check_block_mask, check_buffers, check_scale,
                      refuse_transforms)
from ..blockmask.analysis import check_broadcast
from ..blockmask.coarsen import runnable_block_mask
from ..blockmask.validate import check_tables
from ..errors import InputError, InputTypeError, check_bool
from ..eager import outside_compile
from ..features import check_no_dropout, check_sinks
from ..flops import count as count_flops
from ..lazy import lazy_function
from ..runtime.call import AttentionCall
from ..calls import check_captured_indices
from ..runtime.options import FOREIGN_BACKENDS, HINTS, parse_kernel_options
from ..runtime.pipeline import prepare_mask, prepare_score_mod
from .checks import (check_fp8_device, check_fp8_inputs, check_mixed, check_no_grad,
                     check_positive_scales)
from .quantize import FP8Inputs, quantize

_TENSORS = ("q", "k", "v", "q_scale", "k_scale", "v_scale")
run_fp8_forward = lazy_function("flexfa.runtime.forward", "run_fp8_forward")  # loads Triton


def _inputs(query, key, value, rotate, block_size, seed) -> FP8Inputs:
    """``query`` if it is an FP8Inputs, else the three bf16/fp16 tensors quantized."""
    if isinstance(query, FP8Inputs):
        if key is not None or value is not None:
            raise InputError("query is an FP8Inputs (it holds q, k and v): pass key=None and "
                             "value=None")
        return query
    if check_mixed(query, key, value):
        raise InputError("query, key and value are FP8 tensors without their scales; pass the "
                         "FP8Inputs that flexfa.fp8.quantize returns (tensors and scales "
                         "together), or bf16/fp16 tensors to be quantized here")
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if isinstance(tensor, torch.Tensor) and tensor.dtype not in (torch.bfloat16,
                                                                       torch.float16):
            raise InputTypeError(f"{name} has dtype {tensor.dtype}; flex_attention_fp8 takes "
                                 "bfloat16 or float16 tensors (or an FP8Inputs)")
    check_no_grad((("query", query), ("key", key), ("value", value)), ())
    if isinstance(query, torch.Tensor):
        check_fp8_device(query.device)  # before the quantization kernel runs
        if isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor) and \
                key.dim() == value.dim() == query.dim() == 4 and \
                key.shape[0] == value.shape[0] == 1 < query.shape[0]:
            # key and value of batch 1 shared by the query's batch, as flex_attention
            # takes them: quantized per batch entry (scales are per batch entry)
            key, value = broadcast_batch(query, key, value)
    return quantize(query, key, value, block_size=block_size, rotate=rotate, seed=seed)


def _standard(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a contiguous tensor's standard strides (a copy only where they differ)."""
    strides, step = [], 1
    for size in reversed(t.shape):
        strides.append(step)
        step *= max(size, 1)
    return t if t.stride() == tuple(reversed(strides)) else \
        t.clone(memory_format=torch.contiguous_format)


@outside_compile
def flex_attention_fp8(query, key=None, value=None, score_mod=None, block_mask=None, scale=None,
                       rotate=True, block_size=128, enable_gqa=False, return_lse=False,
                       kernel_options=None, seed=0, *, sinks=None, dropout_p=0.0):
    """Attention with a score_mod and a block mask on e4m3 tensor cores (forward only).

    ``query, key, value``: bf16/fp16 tensors shaped as for ``flexfa.flex_attention``, which
    are quantized here (``flexfa.fp8.quantize(..., block_size, rotate, seed)``), or
    ``query=`` an ``FP8Inputs`` from ``quantize`` with ``key=value=None`` (then ``rotate``,
    ``block_size`` and ``seed`` are already decided). The score_mod sees the descaled float32
    ``q.k * scale`` (``scale`` defaults to ``1/sqrt(E)`` of the original head dim); the output
    has the inputs' dtype, lse is float32. Raises ``FP8UnsupportedError`` when a gradient is
    required or the GPU has no FP8 tensor cores (compute capability < 8.9).
    ``sinks``: per-head sink logits as in ``flexfa.flex_attention`` (float32 or the output
    dtype; no gradient here). ``dropout_p`` > 0 is an InputError: no dropout in this
    forward-only path.
    """
    refuse_transforms("fp8.flex_attention_fp8")
    check_no_dropout(dropout_p, "flex_attention_fp8")
    x = _inputs(query, key, value, rotate, block_size, seed)
    enable_gqa = check_bool("enable_gqa", enable_gqa)
    return_lse = check_bool("return_lse", return_lse)
    check_fp8_inputs(x, enable_gqa)
    check_fp8_device(x.q.device)
    scale = check_scale(scale, x.head_dim)
    if score_mod is not None and not callable(score_mod):
        raise InputTypeError(f"score_mod must be callable or None, got {type(score_mod).__name__}")
    check_block_mask(block_mask, x.q, x.k)
    past = check_tables(block_mask, x.q.shape[2], x.k.shape[2])
    score, mask = prepare_score_mod(score_mod), prepare_mask(block_mask)
    check_broadcast(mask, block_mask, *x.q.shape[:3], x.k.shape[2])
    runnable = runnable_block_mask(block_mask, mask, past)
    if runnable is not block_mask:  # blocks the kernels cannot tile: an equal coarser mask
        block_mask, mask = runnable, runnable.traced_mask
    check_buffers(score, "score_mod", x.q.device)
    check_buffers(mask, "mask_mod", x.q.device)
    check_captured_indices(score, mask, x.q.shape, x.k.shape[2], x.q.device)
    # an FP8Inputs built by hand may hold tensors that require grad; a mask's captured tensors
    # are refused as flex_attention refuses them (no gradient would reach any of them)
    named = [("sinks", sinks), *((f"FP8Inputs.{n}", getattr(x, n)) for n in _TENSORS)]
    named += [("a mask_mod captured tensor", t) for t in (mask.buffers if mask is not None else ())]
    check_no_grad(named, score.buffers if score is not None else ())
    sinks = check_sinks(sinks, x.q.shape[1], x.dtype, x.q.device)
    call = AttentionCall(score, mask, block_mask, scale, _fp8_options(kernel_options),
                         x.q.shape[1] // x.k.shape[1], sinks)
    check_positive_scales(x)
    # the kernel reads K's and V's scales with one set of strides: standard ones (contiguous()
    # keeps a size-1 dimension's stride as it is)
    x = dataclasses.replace(x, **{n: _standard(getattr(x, n))
                                  for n in ("q_scale", "k_scale", "v_scale")})
    if torch._C._len_torch_dispatch_stack():  # a FlopCounterMode counts it (flexfa.flops)
        count_flops(x.q, x.k.shape[2], x.v.shape[3], block_mask, head_dim=x.head_dim)
    out, lse = run_fp8_forward(x, call, return_lse)
    return (out, lse) if return_lse else out


# the kernel_options keys the FP8 kernel reads (bare or with the forward's prefix), and
# ``deterministic`` (its one forward kernel is)
FP8_KEYS = frozenset({"BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "maxnreg", "USE_TMA",
                      "HEAD_GROUP", "deterministic"})


def _fp8_options(kernel_options):
    """``kernel_options`` parsed, refusing keys the FP8 kernel does not read (a forced family,
    SPLIT_KV, the backward's tiles...: it took and ignored them silently)."""
    options = parse_kernel_options(kernel_options)  # (its type and value errors first)
    for key, value in (kernel_options or {}).items():
        bare = key[4:] if key.startswith("fwd_") else key
        if value is None or bare in FP8_KEYS or bare in HINTS or \
                (bare == "BACKEND" and str(value).upper() in ("AUTO", "TRITON",
                                                            *FOREIGN_BACKENDS)):
            continue  # (torch's hints and foreign backends change nothing anywhere)
        raise InputError(f"kernel_options[{key!r}] does not apply to flex_attention_fp8, whose "
                         f"one forward kernel takes only {sorted(FP8_KEYS)}")
    return options

