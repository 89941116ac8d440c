"""``flex_attention``: the drop-in for ``torch.nn.attention.flex_attention.flex_attention``.

Inputs are validated first (flexfa's error classes, naming the argument and the values), the
mods are traced and simplified, and the call goes through ``FlexAttentionFunction`` when a
gradient is needed, else straight to the forward kernel.
"""
from __future__ import annotations

import math
import numbers
import operator
import weakref

import torch

from .blockmask.block_mask import SLICED, sliced_mask_mod
from .blockmask.coarsen import runnable_block_mask
from .blockmask.validate import check_tables
from .errors import InputError, InputTypeError, check_bool
from .scores import check_score_range
from .frontend.grad import check_mask_mod_grad
from .frontend.trace import TracedMod
from .memo import BoundedMemo
from .runtime.forward import AttentionCall, run_forward
from .runtime.indices import check_captured_indices
from .runtime.options import parse_kernel_options
from .runtime.pipeline import prepare_mask, prepare_score_mod

try:  # torch >= 2.9: flex_attention's return_aux request and result types
    from torch.nn.attention.flex_attention import AuxOutput
except ImportError:  # pragma: no cover - older torch
    from typing import NamedTuple

    class AuxOutput(NamedTuple):
        """The auxiliary outputs of ``flex_attention(..., return_aux=...)``: None where not
        requested (torch's ``AuxOutput`` where torch has one)."""

        lse: torch.Tensor | None = None
        max_scores: torch.Tensor | None = None

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
# CUDA's limit on a grid's y and z dimensions: the kernels put the (batch, head) pairs there
# (the backward's and the dense forward's grids; a masked forward puts them on the x axis)
MAX_CUDA_PROGRAM_ROWS = 65535
MAX_SCALE = torch.finfo(torch.float32).max / math.log2(math.e)
_NAMES = ("query", "key", "value")


def _check_tensors(query, key, value) -> None:
    for name, tensor in zip(_NAMES, (query, key, value)):
        if not isinstance(tensor, torch.Tensor):
            raise InputTypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 4:
            raise InputError(f"{name} must be 4-D [B, H, seq_len, head_dim], got shape "
                             f"{tuple(tensor.shape)} ({tensor.dim()}-D)")
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise InputTypeError(f"{name} has dtype {tensor.dtype}; flex_attention supports "
                                 "float16, bfloat16 and float32")
        if tensor.device.type not in ("cpu", "cuda"):
            raise InputError(f"{name} is on device {tensor.device}; flexfa runs on CUDA "
                             "(compiled kernels) or CPU (Triton interpreter)")
    for name, tensor in zip(_NAMES[1:], (key, value)):
        if tensor.dtype != query.dtype:
            raise InputError(f"{name} has dtype {tensor.dtype} but query has {query.dtype}; "
                             "query, key and value must share one dtype")
        if tensor.device != query.device:
            raise InputError(f"{name} is on {tensor.device} but query is on {query.device}")


def _check_shapes(query, key, value, enable_gqa: bool) -> None:
    B, Hq, L, E = query.shape
    if key.shape[0] not in (1, B):
        raise InputError(f"key has batch size {key.shape[0]} but query has {B}; key and value "
                         "need the query's batch size, or 1 to be shared by every batch entry")
    if value.shape[0] != key.shape[0]:
        raise InputError(f"value has batch size {value.shape[0]} but key has {key.shape[0]}")
    if key.shape[1] != value.shape[1]:
        raise InputError(f"value has {value.shape[1]} heads but key has {key.shape[1]}")
    if key.shape[2] != value.shape[2]:
        raise InputError(f"value has sequence length {value.shape[2]} but key has {key.shape[2]}")
    if key.shape[3] != E:
        raise InputError(f"key has head_dim {key.shape[3]} but query has {E}; q.k needs equal "
                         "head dims")
    for name, dim in (("query/key", E), ("value", value.shape[3])):
        if not 1 <= dim <= MAX_HEAD_DIM:
            raise InputError(f"{name} head_dim is {dim}; flexfa supports 1..{MAX_HEAD_DIM}")
    Hkv = key.shape[1]
    if Hkv == 0 or Hq % Hkv:
        raise InputError(f"query has {Hq} heads but key has {Hkv}; query heads must be a "
                         "multiple of key heads (grouped-query attention)")
    if Hq != Hkv and not enable_gqa:
        raise InputError(f"query has {Hq} heads but key has {Hkv}; pass enable_gqa=True for "
                         "grouped-query attention, or give key/value as many heads as query")
    if query.is_cuda and B * Hq > MAX_CUDA_PROGRAM_ROWS:
        raise InputError(f"query has batch {B} x {Hq} heads = {B * Hq} (batch, head) pairs; "
                         f"the CUDA kernels run them on a grid axis of at most "
                         f"{MAX_CUDA_PROGRAM_ROWS}: split the batch into calls of at most "
                         f"{MAX_CUDA_PROGRAM_ROWS // Hq} batch entries")


def _broadcast_batch(query, key, value) -> tuple:
    """key and value of batch 1 shared by a larger query batch (as torch broadcasts them):
    expanded without a copy (batch stride 0), before the autograd Function, so that autograd
    sums the batch entries' gradients into the shared key and value."""
    B = query.shape[0]
    if key.shape[0] == B:
        return key, value
    return key.expand(B, *key.shape[1:]), value.expand(B, *value.shape[1:])


def _check_scale(scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise InputTypeError(f"scale must be a float or None, got {type(scale).__name__} {scale!r}")
    if not math.isfinite(scale):
        raise InputError(f"scale must be finite, got {scale}")
    if abs(scale) > MAX_SCALE:  # the kernels hold scale * log2(e) in float32
        raise InputError(f"scale is {scale}; it must be at most {MAX_SCALE:.3e} in magnitude "
                         "(kernels keep scale * log2(e) in float32)")
    return float(scale)


def _check_aux(return_aux, return_lse: bool) -> tuple[bool, bool]:
    """Whether ``return_aux`` (torch's ``AuxRequest(lse=..., max_scores=...)`` or None) asks
    for (lse, max_scores)."""
    if return_aux is None:
        return False, False
    if return_lse:
        raise InputError("return_lse and return_aux cannot both be given: use "
                         "return_aux=AuxRequest(lse=True) alone")
    fields = {}
    for field in ("lse", "max_scores"):
        if not hasattr(return_aux, field):
            raise InputTypeError(f"return_aux must be an AuxRequest(lse=..., max_scores=...) or "
                                 f"None, got {type(return_aux).__name__} {return_aux!r:.80}")
        fields[field] = check_bool(f"return_aux.{field}", getattr(return_aux, field))
    return fields["lse"], fields["max_scores"]


def _check_block_mask(block_mask, query, key) -> None:
    if block_mask is None:
        return
    if not all(hasattr(block_mask, a) for a in ("kv_num_blocks", "kv_indices", "BLOCK_SIZE")):
        raise InputTypeError(f"block_mask must be a BlockMask (from create_block_mask) or None, "
                             f"got {type(block_mask).__name__}")
    if getattr(block_mask, "mask_mod", None) is sliced_mask_mod:  # flexfa's or torch's
        raise InputError(SLICED)
    B, Hq, L, _ = query.shape
    S = key.shape[2]
    if hasattr(block_mask, "_check_compatible"):
        block_mask._check_compatible(B, Hq, L, S)
    mask_B, mask_H = block_mask.kv_num_blocks.shape[:2]
    seq_lengths = tuple(getattr(block_mask, "seq_lengths", (L, S)))
    if mask_B not in (1, B) or mask_H not in (1, Hq) or seq_lengths != (L, S):
        raise InputError(f"block_mask was built for (B={mask_B}, H={mask_H}, lengths="
                         f"{seq_lengths}) but the inputs have (B={B}, H={Hq}, lengths={(L, S)})")
    _check_table_shapes(block_mask, L, S)
    if block_mask.kv_num_blocks.device != query.device:
        raise InputError(f"block_mask is on {block_mask.kv_num_blocks.device} but query is on "
                         f"{query.device}; move it with block_mask.to(device)")


def _check_table_shapes(block_mask, L: int, S: int) -> None:
    """The tables must have a row for every q tile and a column for every kv tile of (L, S):
    the kernels index them without bounds checks."""
    block_q, block_kv = (int(b) for b in block_mask.BLOCK_SIZE)
    q_tiles, kv_tiles = -(-L // block_q), -(-S // block_kv)
    needs = {"kv_indices": (q_tiles, kv_tiles), "full_kv_indices": (q_tiles, kv_tiles),
             "q_indices": (kv_tiles, q_tiles), "full_q_indices": (kv_tiles, q_tiles)}
    for name, (rows, cols) in needs.items():
        table = getattr(block_mask, name, None)
        if table is not None and (table.shape[-2] < rows or table.shape[-1] < cols):
            raise InputError(
                f"block_mask.{name} has {table.shape[-2]} x {table.shape[-1]} tiles but lengths "
                f"(L={L}, S={S}) with BLOCK_SIZE {(block_q, block_kv)} need {rows} x {cols}")


def _check_buffers(traced: TracedMod | None, what: str, device: torch.device) -> None:
    if traced is None:
        return
    for slot, tensor in enumerate(traced.buffers):
        if tensor.numel() == 0:  # a kernel would read out of bounds: there is no element
            raise InputError(f"the {what} {traced.name!r} reads a captured tensor of shape "
                             f"{tuple(tensor.shape)}, which has no elements")
        if tensor.device != device:
            raise InputError(f"the {what} {traced.name!r} reads a captured tensor of shape "
                             f"{tuple(tensor.shape)} on {tensor.device} but query is on "
                             f"{device}; move the captured tensor to {device}")


# signatures whose tensor, shape and block-mask checks passed: a repeated call skips them (the
# Python-side cost of a cached call, benchmarks/python_dispatch.py). An entry holds the block
# mask and its tables only by weak reference (ids in the key, identity checked on a hit), so
# it neither keeps a dropped mask alive nor matches a new object that reuses an id.
_VALIDATED = BoundedMemo(256, "validated signatures")
_MASK_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices", "mask_mod")
_mask_fields = operator.attrgetter(*_MASK_FIELDS)


def _validation_key(query, key, value, block_mask, enable_gqa) -> tuple | None:
    """(key, objects) of everything the tensor, shape and block-mask checks read, for plain
    tensors (None: a tensor subclass, checked every time). The mask enters by the identity of
    the object and of each table (``objects``), and by its block size and lengths."""
    if not type(query) is type(key) is type(value) is torch.Tensor:
        return None
    if block_mask is None:
        objects, mask_key = (), None
    else:
        try:
            fields = _mask_fields(block_mask)
        except AttributeError:  # a duck-typed mask without some of the tables
            fields = tuple(getattr(block_mask, n, None) for n in _MASK_FIELDS)
        objects = (block_mask, *fields)
        mask_key = (tuple(map(id, objects)), getattr(block_mask, "BLOCK_SIZE", None),
                    getattr(block_mask, "seq_lengths", None))
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
                   enable_gqa=False, return_lse=False, kernel_options=None, *, return_aux=None):
    """Attention with a score_mod and a block mask, as one fused kernel generated for them.

    query ``[B, Hq, L, E]``, key ``[B, Hkv, S, E]``, value ``[B, Hkv, S, Ev]`` (fp16, bf16 or
    fp32, one device) -> out ``[B, Hq, L, Ev]`` in query's dtype; with ``return_lse`` also
    lse ``[B, Hq, L]`` float32 (natural log; -inf for a row that attends to nothing, whose
    output is 0). ``return_aux=AuxRequest(lse=..., max_scores=...)`` (torch's newer form)
    returns ``(out, AuxOutput(lse, max_scores))``, each None unless requested; max_scores
    ``[B, Hq, L]`` float32 is each row's largest score_mod(q.k * scale) over the keys its mask
    keeps (-inf for a row with nothing to attend), without a gradient.
    ``score_mod(score, b, h, q_idx, kv_idx)`` sees ``q.k * scale``; ``scale`` defaults to
    ``1/sqrt(E)``. ``block_mask=None`` is dense attention. CUDA inputs run compiled kernels;
    CPU inputs run the same kernels under the Triton interpreter. Inside ``torch.compile`` a
    call is a graph break that runs eagerly (``flexfa.runtime.eager``).
    ``kernel_options``: see ``flexfa.runtime.options.ALLOWED``.
    """
    if torch.compiler.is_compiling():  # traced by torch.compile: a graph break, run eagerly
        return _flex_attention_eager(query, key, value, score_mod, block_mask, scale, enable_gqa,
                                     return_lse, kernel_options, return_aux=return_aux)
    signature = _validation_key(query, key, value, block_mask, enable_gqa)
    checked = False  # the tensor, shape and block-mask checks passed for this signature before
    if signature is not None:
        try:
            refs = _VALIDATED.get(signature[0])
        except TypeError:  # a mask field that cannot be hashed: checked every time
            signature = refs = None
        checked = refs is not None and _still_same(refs, signature[1])
    if not checked:
        _check_tensors(query, key, value)
    enable_gqa = check_bool("enable_gqa", enable_gqa)
    return_lse = check_bool("return_lse", return_lse)
    aux_lse, aux_max = _check_aux(return_aux, return_lse)
    if not checked:
        _check_shapes(query, key, value, enable_gqa)
    scale = _check_scale(scale, query.shape[3])
    if score_mod is not None and not callable(score_mod):
        raise InputTypeError(f"score_mod must be callable or None, got {type(score_mod).__name__}")
    if not checked:
        _check_block_mask(block_mask, query, key)
        refs = _weak(signature[1]) if signature is not None else None
        if refs is not None:
            _VALIDATED[signature[0]] = refs
    check_tables(block_mask, query.shape[2], key.shape[2])  # contents, again after any edit
    key, value = _broadcast_batch(query, key, value)
    check_score_range(query, key, scale)  # only for an enormous scale
    options = parse_kernel_options(kernel_options)
    score = prepare_score_mod(score_mod)
    mask = prepare_mask(block_mask)
    runnable = runnable_block_mask(block_mask, mask)
    if runnable is not block_mask:  # blocks the kernels cannot tile: an equal coarser mask
        block_mask, mask = runnable, runnable.traced_mask
    if mask is not None and torch.is_grad_enabled():
        check_mask_mod_grad(mask)  # a mask has no gradient: error on grad-requiring captures
    _check_buffers(score, "score_mod", query.device)
    _check_buffers(mask, "mask_mod", query.device)
    check_captured_indices(score, mask, query.shape, key.shape[2], query.device)
    call = AttentionCall(score, mask, block_mask, scale, options, query.shape[1] // key.shape[1])
    buffers = score.buffers if score is not None else ()
    needs_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (query, key, value, *buffers))
    if needs_grad:
        from .autograd import FlexAttentionFunction
        out, lse, maxs = FlexAttentionFunction.apply(query, key, value, call, aux_max, *buffers)
    else:
        out, lse, maxs = run_forward(query, key, value, call, return_lse or aux_lse, aux_max)
    if return_aux is not None:
        return out, AuxOutput(lse=lse if aux_lse else None, max_scores=maxs)
    return (out, lse) if return_lse else out


# flex_attention outside torch.compile's graphs (flexfa.runtime.eager): what a traced call runs
_flex_attention_eager = torch.compiler.disable(flex_attention)
