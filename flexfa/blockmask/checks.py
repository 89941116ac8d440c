"""Argument checks shared by create_block_mask, create_mask and BlockMask."""
from __future__ import annotations

import numbers

import torch

from ..errors import InputError, InputTypeError

MIN_BLOCK, MAX_BLOCK = 16, 256


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def block_size_pair(func: str, value) -> tuple[int, int]:
    """``BLOCK_SIZE`` as ``(q, kv)``: an int or a pair of powers of two in 16..256."""
    pair = (value, value) if _is_int(value) else value
    if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not all(_is_int(v) for v in pair):
        raise InputTypeError(f"{func}: BLOCK_SIZE must be an int or a (q, kv) pair of ints, "
                             f"got {type(value).__name__} {value!r}")
    for size in pair:
        if not (MIN_BLOCK <= size <= MAX_BLOCK and size & (size - 1) == 0):
            raise InputError(f"{func}: BLOCK_SIZE must be a power of two from {MIN_BLOCK} to "
                             f"{MAX_BLOCK}, got BLOCK_SIZE={value!r}")
    return int(pair[0]), int(pair[1])


def positive_int(func: str, name: str, value) -> int:
    if not _is_int(value):
        raise InputTypeError(f"{func}: {name} must be an int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise InputError(f"{func}: {name} must be positive, got {name}={value}")
    return int(value)


def batch_size(func: str, name: str, value) -> int:
    """B or H: a positive int, or None meaning 1 (broadcast over every batch / head)."""
    return 1 if value is None else positive_int(func, name, value)


def resolve_device(func: str, device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InputError(f"{func}: device={device!r} is not a torch device ({exc})") from None
    if device.type not in ("cpu", "cuda"):
        raise InputError(f"{func}: device={str(device)!r} is not supported; block masks are "
                         "built on 'cpu' or 'cuda'")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"{func}: device={str(device)!r} but CUDA is not available on this "
                         "machine; pass device='cpu'")
    return device
