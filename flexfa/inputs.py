"""Input checks of the public entry points: each names the argument and the values.

``flex_attention`` and ``flex_attention_fp8`` run them before any kernel; a repeated call
skips the ones whose inputs it has seen (``flexfa.api``).
"""
from __future__ import annotations

import math
import numbers

import torch
from torch.autograd import forward_ad

from .blockmask.block_mask import SLICED, sliced_mask_mod
from .errors import InputError, InputTypeError, check_bool, dims
from .frontend.trace import TracedMod

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
# CUDA's limit on a grid's y and z dimensions: the kernels put the (batch, head) pairs there
# (the backward's and the dense forward's grids; a masked forward puts them on the x axis)
MAX_CUDA_PROGRAM_ROWS = 65535
MAX_SCALE = torch.finfo(torch.float32).max / math.log2(math.e)
# float32's smallest normal: a scale below it is subnormal in the kernels' float32 (flushed to
# zero on GPUs; a float64 scalar under the interpreter, which then fails inside Triton)
MIN_SCALE = torch.finfo(torch.float32).tiny
# (as text once: Dynamo does not format a float constant inside a traced f-string everywhere)
_MAX_SCALE_TEXT, _MIN_SCALE_TEXT = f"{MAX_SCALE:.3e}", f"{MIN_SCALE:.3e}"
_NAMES = ("query", "key", "value")
_TABLE_DIMS = tuple((f"{prefix}{side}_{kind}", dims) for prefix in ("", "full_")
                    for side in ("kv", "q") for kind, dims in (("num_blocks", 3), ("indices", 4)))


def check_tensors(query, key, value) -> None:
    for name, tensor in zip(_NAMES, (query, key, value)):
        if not isinstance(tensor, torch.Tensor):
            raise InputTypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 4:
            raise InputError(f"{name} must be 4-D [B, H, seq_len, head_dim], got shape "
                             f"{dims(tensor)} ({tensor.dim()}-D)")
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise InputTypeError(f"{name} has dtype {tensor.dtype}; flex_attention supports "
                                 "float16, bfloat16 and float32")
        if tensor.device.type not in ("cpu", "cuda"):
            raise InputError(f"{name} is on device {tensor.device}; flexfa runs on CUDA "
                             "(compiled kernels) or CPU (Triton interpreter)")
        check_readable(name, tensor)
    for name, tensor in zip(_NAMES[1:], (key, value)):
        if tensor.dtype != query.dtype:
            raise InputError(f"{name} has dtype {tensor.dtype} but query has {query.dtype}; "
                             "query, key and value must share one dtype")
        if tensor.device != query.device:
            raise InputError(f"{name} is on {tensor.device} but query is on {query.device}")


def autocast_inputs(query, key, value) -> tuple:
    """(query, key, value) as torch's flex_attention computes them under ``torch.autocast``
    (its Autocast rule): each floating-point tensor on the autocast's device type, float64
    excepted, cast to the autocast dtype (out comes in it; the casts carry the gradients
    back); unchanged without an active autocast (one check)."""
    if not torch._C._is_any_autocast_enabled() or not isinstance(query, torch.Tensor):
        return query, key, value
    device = query.device.type
    if not torch.is_autocast_enabled(device):
        return query, key, value
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point()
                 and t.device.type == device and t.dtype is not torch.float64 else t
                 for t in (query, key, value))


def readable(query, key, value) -> bool:
    """Whether the kernels can read each tensor through its data pointer and strides: a
    strided layout (not sparse, mkldnn or nested) without the negative bit (a lazily negated
    view such as ``z.conj().imag``, whose memory holds the values' negations)."""
    return (query.layout is key.layout is value.layout is torch.strided
            and not (query.is_neg() or key.is_neg() or value.is_neg()))


_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__


def check_readable(name: str, tensor: torch.Tensor) -> None:
    """An InputError naming ``name`` unless the kernels can read ``tensor`` (``readable``)."""
    if tensor.layout is not torch.strided:
        raise InputError(f"{name} has layout {tensor.layout}; flexfa's kernels read strided "
                         "tensors: pass a dense one (.to_dense())")
    if torch.compiler.is_compiling():
        return  # (Dynamo cannot trace these: the operator checks its real inputs)
    if type(tensor).__torch_dispatch__ is not _PLAIN_DISPATCH:
        # a wrapper subclass (DTensor, FakeTensor, TwoTensor, MaskedTensor): no storage of its
        # own the kernels could read (they failed inside Triton on it)
        hint = {"DTensor": "pass .to_local() (this rank's shard) or .full_tensor()",
                "FakeTensor": "call flex_attention under torch.compile, whose operator has a "
                              "fake implementation, or with real tensors"}.get(
            type(tensor).__name__, "pass a plain tensor")
        raise InputTypeError(f"{name} is a {type(tensor).__name__}, a tensor subclass that "
                             f"dispatches its own operations; flexfa's kernels read plain "
                             f"tensors' memory: {hint}")
    if tensor.is_neg():
        raise InputError(f"{name} is a lazily negated view (its negative bit is set, as for "
                         "z.conj().imag): its memory holds the values' negations, which the "
                         "kernels would read; pass .resolve_neg() of it")


TRANSFORMS_MESSAGE = (
    "flexfa.{func} does not support torch.func's transforms (vmap, grad, jvp, jacrev, ...), "
    "nor batched gradients (is_grads_batched=True, jacobian(vectorize=True)) that use them: "
    "its kernels have no batching rule. Call it outside the transform (a batch dimension in "
    "q, k, v instead of vmap; torch.autograd.grad instead of torch.func.grad)")
FORWARD_AD_MESSAGE = (
    "flexfa.{func} does not support forward-mode AD: its {what} is a dual tensor "
    "(torch.autograd.forward_ad), and flexfa's kernels compute no tangent; use reverse mode "
    "(backward / torch.autograd.grad)")


def refuse_transforms(func: str, tensors=()) -> None:
    """An InputError under torch.func's transforms, or where one of ``tensors`` is batched
    by the older vmap of batched gradients (``is_grads_batched=True``, no transform active):
    their tensors have no storage the host code and the kernels could read (they failed deep
    inside with torch's storage errors); ``func`` names the entry point."""
    batched = getattr(torch._C._functorch, "is_legacy_batchedtensor", None)
    if torch._C._are_functorch_transforms_active() or (batched is not None and any(
            t is not None and batched(t) for t in tensors)):
        raise InputError(TRANSFORMS_MESSAGE.format(func=func))


def dual_level_open() -> bool:
    """Whether a dual level of forward-mode AD is open (``forward_ad.dual_level``)."""
    return getattr(forward_ad, "_current_level", -1) >= 0


def refuse_tangents(func: str, named) -> None:
    """An InputError where one of ``named``'s (name, tensor or None) pairs is a dual tensor
    with a tangent (callers ask ``dual_level_open`` first): entry point ``func``'s forward
    would drop it silently."""
    for what, tensor in named:
        if isinstance(tensor, torch.Tensor) and \
                forward_ad.unpack_dual(tensor).tangent is not None:
            raise InputError(FORWARD_AD_MESSAGE.format(func=func, what=what))


def requiring_grad(named) -> list[str]:
    """The names of the tensors in ``named`` ((name, tensor or None) pairs) that require
    grad, where grad mode is on (else none): what a forward-only entry point must refuse, as
    its output would silently carry no gradient to them."""
    if not torch.is_grad_enabled():
        return []
    return [name for name, t in named if isinstance(t, torch.Tensor) and t.requires_grad]


def check_head_dim(label: str, dim: int) -> None:
    """An InputError unless ``dim`` is a head dim the kernels take (1..MAX_HEAD_DIM);
    ``label`` names it in the message."""
    if not 1 <= dim <= MAX_HEAD_DIM:
        raise InputError(f"{label} is {dim}; flexfa supports 1..{MAX_HEAD_DIM}")


def check_shapes(query, key, value, enable_gqa: bool) -> None:
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
    check_head_dim("query/key head_dim", E)
    check_head_dim("value head_dim", value.shape[3])
    Hkv = key.shape[1]
    if Hkv == 0:
        raise InputError(f"key and value have 0 heads (query {Hq}); attention needs at least "
                         "one head")
    if Hq % Hkv:
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


def broadcast_batch(query, key, value) -> tuple:
    """key and value of batch 1 shared by a larger query batch (as torch broadcasts them):
    expanded without a copy (batch stride 0), before the autograd Function, so that autograd
    sums the batch entries' gradients into the shared key and value."""
    B = query.shape[0]
    if key.shape[0] == B:
        return key, value
    return key.expand(B, *key.shape[1:]), value.expand(B, *value.shape[1:])


def shown(value, typed: bool = False) -> str:
    """``value`` as an error message shows it: its repr (at most 40 characters; after its
    type's name with ``typed``), or under torch.compile its type (Dynamo cannot format a
    value it made symbolic, nor a tensor)."""
    if torch.compiler.is_compiling():
        return f"a {type(value).__name__} traced by torch.compile"
    return f"{type(value).__name__} {value!r:.40}" if typed else f"{value!r:.40}"


def check_scale(scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise InputTypeError(f"scale must be a float or None, got {type(scale).__name__} {scale!r}")
    # comparisons, not math.isfinite: under torch.compile a float argument Dynamo made dynamic
    # is symbolic, which comparisons trace (as guards) and math.isfinite and str() do not
    shown = "a float traced by torch.compile" if torch.compiler.is_compiling() else \
        f"{str(scale):.40}"
    if scale != scale or scale == math.inf or scale == -math.inf:
        raise InputError(f"scale must be finite, got {shown}")
    if abs(scale) > MAX_SCALE:  # the kernels hold scale * log2(e) in float32
        raise InputError(f"scale is {shown}; it must be at most {_MAX_SCALE_TEXT} in "
                         "magnitude (kernels keep scale * log2(e) in float32)")
    if 0 < abs(scale) < MIN_SCALE:
        raise InputError(f"scale is {shown}; a nonzero scale must be at least {_MIN_SCALE_TEXT} "
                         "in magnitude (float32's smallest normal number: the kernels hold it "
                         "in float32); pass 0.0 for scores of 0")
    return float(scale)


def check_aux(return_aux, return_lse: bool) -> tuple[bool, bool]:
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


def check_block_mask_type(block_mask) -> None:
    """A BlockMask (flexfa's, torch's or one with their tables), not a sliced one."""
    if not all(hasattr(block_mask, a) for a in ("kv_num_blocks", "kv_indices", "BLOCK_SIZE")):
        raise InputTypeError(f"block_mask must be a BlockMask (from create_block_mask) or None, "
                             f"got {type(block_mask).__name__}")
    if getattr(block_mask, "mask_mod", None) is sliced_mask_mod:  # flexfa's or torch's
        raise InputError(SLICED)
    # torch's from_kv_blocks keeps 2- or 3-dim tables as given; the kernels index [B, H, ...]
    # (the full and q tables may be None; a sparse table has no memory the kernels can read)
    for name, ndim in _TABLE_DIMS:
        table = getattr(block_mask, name, None)
        if table is None and name not in ("kv_num_blocks", "kv_indices"):
            continue
        if isinstance(table, torch.Tensor) and table.layout is not torch.strided:
            raise InputError(f"block_mask.{name} has layout {table.layout}; the kernels read "
                             "strided tables: pass dense ones (.to_dense())")
        if not isinstance(table, torch.Tensor) or table.dim() != ndim:
            found = (f"shape {dims(table)}" if isinstance(table, torch.Tensor)
                     else type(table).__name__)
            rows, cols = ("KV_TILES", "Q_TILES") if "q_" in name else ("Q_TILES", "KV_TILES")
            raise InputError(f"block_mask.{name} has {found}; flex_attention needs [B, H, "
                             f"{rows}{f', {cols}' if ndim == 4 else ''}] tables: build the "
                             "mask with flexfa.BlockMask.from_kv_blocks, which adds size-1 "
                             "batch and head dims to tables without them")


def check_block_mask(block_mask, query, key) -> None:
    if block_mask is None:
        return
    check_block_mask_type(block_mask)
    B, Hq, L, _ = query.shape
    S = key.shape[2]
    if hasattr(block_mask, "_check_compatible"):
        block_mask._check_compatible(B, Hq, L, S)
    mask_B, mask_H = block_mask.kv_num_blocks.shape[:2]
    seq_lengths = tuple(getattr(block_mask, "seq_lengths", (L, S)))
    if mask_B not in (1, B) or mask_H not in (1, Hq) or seq_lengths != (L, S):
        raise InputError(f"block_mask was built for (B={mask_B}, H={mask_H}, lengths="
                         f"{seq_lengths}) but the inputs have (B={B}, H={Hq}, lengths={(L, S)})")
    check_table_shapes(block_mask, L, S)
    if block_mask.kv_num_blocks.device != query.device:
        raise InputError(f"block_mask is on {block_mask.kv_num_blocks.device} but query is on "
                         f"{query.device}; move it with block_mask.to(device)")


def check_table_shapes(block_mask, L: int, S: int) -> None:
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


def check_buffers(traced: TracedMod | None, what: str, device: torch.device) -> None:
    if traced is None:
        return
    for slot, tensor in enumerate(traced.buffers):
        check_readable(f"the captured tensor of shape {dims(tensor)} that the {what} "
                       f"{traced.name!r} reads", tensor)
        if tensor.numel() == 0:  # a kernel would read out of bounds: there is no element
            raise InputError(f"the {what} {traced.name!r} reads a captured tensor of shape "
                             f"{dims(tensor)}, which has no elements")
        if tensor.device != device:
            raise InputError(f"the {what} {traced.name!r} reads a captured tensor of shape "
                             f"{dims(tensor)} on {tensor.device} but query is on "
                             f"{device}; move the captured tensor to {device}")
