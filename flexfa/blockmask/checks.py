"""Argument checks shared by create_block_mask, create_mask and BlockMask."""
from __future__ import annotations

import contextlib

import numbers

import torch

from ..errors import InputError, InputTypeError

# the block tables, page tables and sequence lengths are int32 (as torch's): a size, length or
# block past it cannot be indexed (it failed after minutes of building tables, or in torch)
MAX_SIZE = 2 ** 31 - 1


def _is_int(value) -> bool:
    # a plain int first: the ABC check costs about 1 us, paid on every call that builds a mask
    return type(value) is int or (isinstance(value, numbers.Integral) and
                                  not isinstance(value, bool))


def block_size_pair(func: str, value, name: str = "BLOCK_SIZE") -> tuple[int, int]:
    """``BLOCK_SIZE`` as ``(q, kv)``: a positive int or a pair of them, as torch accepts
    (e.g. ``(1, 64)`` for decoding). The kernels' tiles are powers of two from 16 up: a mask
    whose blocks they cannot tile runs through an equivalent mask of coarser blocks
    (``flexfa.blockmask.coarsen``). ``name``: the argument as the caller calls it."""
    pair = (value, value) if _is_int(value) else value
    if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not all(_is_int(v) for v in pair):
        raise InputTypeError(f"{func}: {name} must be an int or a (q, kv) pair of ints, "
                             f"got {type(value).__name__} {value!r}")
    if min(pair) <= 0:
        raise InputError(f"{func}: {name} must be positive, got {name}={value!r}")
    if max(pair) > MAX_SIZE:
        raise InputError(f"{func}: {name} must be at most {MAX_SIZE} (int32), got "
                         f"{name}={value!r}")
    return int(pair[0]), int(pair[1])


def positive_int(func: str, name: str, value) -> int:
    if not _is_int(value):
        raise InputTypeError(f"{func}: {name} must be an int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise InputError(f"{func}: {name} must be positive, got {name}={value}")
    if value > MAX_SIZE:
        raise InputError(f"{func}: {name} must be at most {MAX_SIZE} (int32), got {name}={value}")
    return int(value)


def batch_size(func: str, name: str, value) -> int:
    """B or H: a positive int, or None meaning 1 (broadcast over every batch / head)."""
    return 1 if value is None else positive_int(func, name, value)


def default_device() -> torch.device:
    """torch's default for ``create_block_mask(device=None)``: the current accelerator, else
    the CPU. flexfa runs on CUDA or the CPU, so another accelerator (MPS, XPU) gives the CPU,
    and so does a CUDA build of torch on a machine without a GPU (torch would fail there)."""
    current = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    cuda = current is not None and current.type == "cuda" and torch.cuda.is_available()
    return torch.device("cuda" if cuda else "cpu")


def indexed(device: torch.device) -> torch.device:
    """``device`` with its index: "cuda" is the current GPU (where a tensor made for "cuda"
    lands), so that what is cached or built per device tells GPUs apart."""
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def on_device(device: torch.device):
    """Triton launches (and times, ``triton.testing.do_bench``) on the current CUDA device:
    a context making ``device`` current where it is not; nothing for CPU tensors."""
    if device.type != "cuda" or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def resolve_device(func: str, device) -> torch.device:
    if device is None:
        return default_device()
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:  # (ValueError: an int past int64)
        raise InputError(f"{func}: device={device!r} is not a torch device ({exc})") from None
    if device.type not in ("cpu", "cuda"):
        raise InputError(f"{func}: device={str(device)!r} is not supported; flexfa runs on "
                         "'cpu' or 'cuda'")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"{func}: device={str(device)!r} but CUDA is not available on this "
                         "machine; pass device='cpu'")
    return device
