"""Input checks of the FP8 path: clear, early errors naming the argument and the values."""
from __future__ import annotations

import numbers

import torch

from ..inputs import (check_readable, check_shapes, dual_level_open, refuse_tangents,
                      requiring_grad)
from ..errors import FlexFAError, InputError, InputTypeError, check_bool, check_int, dims
from .inputs import DESCALE_MIN, FP8_DTYPE, FP8Inputs

HIGH_PRECISION = (torch.bfloat16, torch.float16, torch.float32)
MIN_CAPABILITY = (8, 9)  # Ada (sm_89) and Hopper (sm_90) have e4m3 tensor cores
_NAMES = ("query", "key", "value")


class FP8UnsupportedError(FlexFAError, NotImplementedError):
    """Something the FP8 path does not do (its backward, e5m2 inputs, older GPUs)."""


def _is_fp8(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 1


MAX_BLOCK = 1 << 16  # rows of one scale block (2**31 overflowed the kernel's int32 offsets)


def check_block_size(block_size) -> tuple[int, int]:
    """``block_size`` (int or (block_q, block_kv)) -> (block_q, block_kv), powers of two >= 16."""
    pair = (block_size, block_size) if isinstance(block_size, numbers.Integral) else block_size
    if (not isinstance(pair, (tuple, list)) or len(pair) != 2
            or any(isinstance(b, bool) or not isinstance(b, numbers.Integral) for b in pair)):
        raise InputTypeError(f"block_size must be an int or a pair of ints (block_q, block_kv), "
                             f"got {block_size!r}")
    for b in pair:
        if b < 16 or b & (b - 1) or b > MAX_BLOCK:
            raise InputError(f"block_size {tuple(pair)}: each must be a power of two from 16 "
                             f"to {MAX_BLOCK} (the kernel's tiles divide the scale blocks), "
                             f"got {b}")
    return int(pair[0]), int(pair[1])


def check_quantize_inputs(q, k, v, rotate, per_tensor, fused=None) -> None:
    """bf16/fp16/fp32 4-D tensors of consistent shapes on one device."""
    for name, tensor in zip(_NAMES, (q, k, v)):
        if not isinstance(tensor, torch.Tensor):
            raise InputTypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if _is_fp8(tensor.dtype):
            raise InputError(f"{name} is already {tensor.dtype}; quantize takes bf16, fp16 or "
                             "fp32 tensors")
        if tensor.dtype not in HIGH_PRECISION:
            raise InputTypeError(f"{name} has dtype {tensor.dtype}; quantize takes bfloat16, "
                                 "float16 or float32")
        if tensor.dim() != 4:
            raise InputError(f"{name} must be 4-D [B, H, seq_len, head_dim], got shape "
                             f"{dims(tensor)}")
        if tensor.device != q.device:
            raise InputError(f"{name} is on {tensor.device} but query is on {q.device}")
        if tensor.dtype != q.dtype:  # as flex_attention: no dtype is picked among them
            raise InputError(f"{name} has dtype {tensor.dtype} but query has {q.dtype}; query, "
                             "key and value must share one dtype")
    check_shapes(q, k, v, enable_gqa=True)
    for name, flag in (("rotate", rotate), ("per_tensor", per_tensor), ("fused", fused)):
        if not (name == "fused" and flag is None):
            check_bool(name, flag)
    if per_tensor and fused:
        raise InputError("per_tensor=True quantizes with torch operations; pass fused=None or "
                         "False with it")


def check_mixed(query, key, value) -> bool:
    """True when all three are FP8 tensors; an error when some are and some are not."""
    tensors = [t for t in (query, key, value) if isinstance(t, torch.Tensor)]
    fp8 = [name for name, t in zip(_NAMES, (query, key, value))
           if isinstance(t, torch.Tensor) and _is_fp8(t.dtype)]
    if fp8 and len(fp8) != len(tensors):
        dtypes = ", ".join(f"{n} {t.dtype}" for n, t in zip(_NAMES, (query, key, value))
                           if isinstance(t, torch.Tensor))
        raise InputError(f"query, key and value mix FP8 and higher-precision dtypes ({dtypes}); "
                         "pass all three in bf16/fp16 (they are quantized for you) or an "
                         "FP8Inputs from flexfa.fp8.quantize")
    return bool(fp8)


def check_scale(name: str, scale, want: tuple[int, ...], device) -> None:
    if not isinstance(scale, torch.Tensor):
        raise InputTypeError(f"{name} must be a float32 tensor, got {type(scale).__name__}")
    if tuple(scale.shape) != want:
        raise InputError(f"{name} has shape {dims(scale)}; expected {want} "
                         "[B, heads, ceil(seq_len / block)] for these inputs and block sizes")
    if scale.dtype != torch.float32:
        raise InputTypeError(f"{name} has dtype {scale.dtype}; scales must be float32")
    if scale.device != device:
        raise InputError(f"{name} is on {scale.device} but query is on {device}")
    check_readable(name, scale)


def check_fp8_inputs(x: FP8Inputs, enable_gqa: bool) -> None:
    """e4m3 tensors of consistent shapes, scales of the right shapes, one device."""
    if not isinstance(x, FP8Inputs):
        raise InputTypeError(f"expected FP8Inputs (from flexfa.fp8.quantize), got {type(x).__name__}")
    block_q, block_kv = check_block_size((x.block_q, x.block_kv))
    for name, tensor in zip(_NAMES, (x.q, x.k, x.v)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
            raise InputError(f"FP8Inputs.{name[0]} must be a 4-D tensor, got "
                             f"{getattr(tensor, 'shape', type(tensor).__name__)}")
        if tensor.dtype != FP8_DTYPE:
            raise FP8UnsupportedError(
                f"FP8Inputs.{name[0]} has dtype {tensor.dtype}; the FP8 kernel takes "
                "torch.float8_e4m3fn only (e5m2 and other FP8 formats are not supported)")
        if tensor.device != x.q.device:
            raise InputError(f"FP8Inputs.{name[0]} is on {tensor.device} but q is on {x.q.device}")
        check_readable(f"FP8Inputs.{name[0]}", tensor)
    check_shapes(x.q, x.k, x.v, enable_gqa)
    if x.k.shape[0] != x.q.shape[0]:  # the kernel indexes k and v with q's batch index
        raise InputError(f"FP8Inputs.k and .v have batch size {x.k.shape[0]} but q has "
                         f"{x.q.shape[0]}; an FP8Inputs holds k and v per batch entry (quantize "
                         "them expanded to q's batch, as flexfa.fp8.quantize does)")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise InputTypeError(f"FP8Inputs.dtype (the output dtype) must be bfloat16 or float16, "
                             f"got {x.dtype}")
    check_bool("FP8Inputs.positive_scales", x.positive_scales)  # truthiness would fold q.k
    head_dim = x.head_dim
    if isinstance(head_dim, bool) or not isinstance(head_dim, numbers.Integral) or \
            not 1 <= head_dim <= x.q.shape[3]:
        raise InputError(f"FP8Inputs.head_dim (the head dim before padding) must be an int in "
                         f"1..{x.q.shape[3]} (q's head dim), got {head_dim!r}")
    B, Hq, L, _ = x.q.shape
    Hkv, S = x.k.shape[1], x.k.shape[2]
    check_scale("q_scale", x.q_scale, (B, Hq, -(-L // block_q)), x.q.device)
    for name in ("k_scale", "v_scale"):
        check_scale(name, getattr(x, name), (B, Hkv, -(-S // block_kv)), x.q.device)


def check_positive_scales(x: FP8Inputs) -> None:
    """With ``positive_scales`` the kernel folds the descales into exp2's FMA, exact only for
    descales > 0: those ``quantize`` wrote pass unchecked (``FP8Inputs.scales_as_written``);
    others are checked here (one host synchronisation), as a negative or non-finite one gave
    a wrong result with no error."""
    if not x.positive_scales or x.scales_as_written():
        return
    for name in ("q_scale", "k_scale", "v_scale"):
        scale = getattr(x, name)
        good = (scale >= DESCALE_MIN) & torch.isfinite(scale)
        if not bool(good.all()):  # (True for no elements)
            bad = scale[~good].flatten()[0].item()
            raise InputError(
                f"FP8Inputs.positive_scales is True but {name} holds {bad!r}; the kernel folds "
                "descales into the softmax's exponent only where every one is finite and at "
                f"least {DESCALE_MIN!r} (2**-60, quantize's smallest: a product of smaller "
                "ones can underflow to 0): pass positive_scales=False "
                "(dataclasses.replace(x, positive_scales=False)) for descales of any sign "
                "or size")


def check_fp8_device(device: torch.device) -> None:
    """FP8 tensor cores exist from compute capability 8.9 on; CPU runs the interpreter."""
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise InputError(f"inputs are on {device}; the FP8 path runs on CUDA or CPU "
                         "(interpreter)")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise FP8UnsupportedError(
            f"FP8 attention needs a GPU with FP8 tensor cores (compute capability >= 8.9, "
            f"e.g. L4/L40/H100/H200); {torch.cuda.get_device_name(device)} has "
            f"{capability[0]}.{capability[1]}. Use flexfa.flex_attention in bf16 instead")


def check_no_grad(tensors, buffers) -> None:
    """The FP8 path has no backward: refuse inputs or captured tensors that require grad."""
    named = [*tensors, *(("a score_mod captured tensor", t) for t in buffers)]
    if dual_level_open():
        refuse_tangents("fp8.flex_attention_fp8", named)
    needing = requiring_grad(named)
    if needing:
        raise FP8UnsupportedError(
            f"FP8 attention is forward-only, but {', '.join(needing)} requires grad; run it "
            "under torch.no_grad() / torch.inference_mode(), detach the inputs, or use "
            "flexfa.flex_attention (bf16) for training")
