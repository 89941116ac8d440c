"""Random-sign Hadamard rotation along the head dim ("incoherent processing", FlashAttention-3).

``R = diag(signs) @ H / sqrt(d)``, with ``H`` the d x d Sylvester Hadamard matrix (entries
+-1) and ``signs`` a random +-1 vector, is orthogonal, so rotating Q and K with the same
``R`` leaves every q.k unchanged in exact arithmetic while spreading a few large channels
(outliers) over all d channels: the block amax, and with it the FP8 quantization step,
shrinks. ``d`` must be a power of two; other head dims are padded with zero channels first
(zeros add nothing to q.k).
"""
from __future__ import annotations

import functools
import math

import torch

from ..errors import InputError, check_int


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def padded_dim(head_dim: int, minimum: int = 32) -> int:
    """The power of two (>= ``minimum``, FP8 dots need K >= 32) a rotated head dim pads to."""
    d = minimum
    while d < head_dim:
        d *= 2
    return d


@functools.lru_cache(maxsize=8)  # d x d floats: hadamard_matrix(8192) alone is 256 MB
def _sylvester(d: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@functools.lru_cache(maxsize=32)
def _on_device(d: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return _sylvester(d).to(device=device, dtype=dtype)


def hadamard_matrix(d: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """The d x d Sylvester Hadamard matrix, entries +-1 (``H @ H.T == d * I``). Cached per
    device (no host-to-device copy per call): treat it as read-only."""
    if not is_power_of_two(d):
        raise InputError(f"a Hadamard matrix needs a power-of-two size, got d={d}")
    return _on_device(d, torch.device(device or "cpu"), dtype)


@functools.lru_cache(maxsize=64)
def _signs(d: int, seed: int, device: torch.device) -> torch.Tensor:
    bits = torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(seed))
    return (1.0 - 2.0 * bits.to(torch.float32)).to(device)


def random_signs(d: int, seed: int = 0, device=None) -> torch.Tensor:
    """A reproducible +-1 float32 vector of length d (the same for Q and K of one call);
    cached per (d, seed, device): treat it as read-only."""
    return _signs(d, int(seed), torch.device(device or "cpu"))


@functools.lru_cache(maxsize=64)
def _signed(d: int, seed: int, device: torch.device) -> torch.Tensor:
    return (hadamard_matrix(d, device) * random_signs(d, seed, device)[:, None]).contiguous()


def signed_hadamard(d: int, seed: int = 0, device=None) -> torch.Tensor:
    """``diag(random_signs(d, seed)) @ H`` (entries +-1), cached: the fused quantization
    kernel's rotation matrix before its 1/sqrt(d)."""
    return _signed(d, int(seed), torch.device(device or "cpu"))


def rotation_matrix(signs: torch.Tensor) -> torch.Tensor:
    """``diag(signs) @ H / sqrt(d)`` in float32: orthogonal, so ``R @ R.T == I``."""
    d = signs.shape[0]
    return signs[:, None].float() * hadamard_matrix(d, signs.device) / math.sqrt(d)


def pad_head_dim(x: torch.Tensor, d: int) -> torch.Tensor:
    """``x`` with zero channels appended up to head dim ``d`` (``x`` itself if already d)."""
    if x.shape[-1] == d:
        return x
    return torch.nn.functional.pad(x, (0, d - x.shape[-1]))


def rotate(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``x @ R`` in float32 along the last dim (zero-padded to ``len(signs)`` first).

    One matmul with the +-1 matrix is exact in float32 up to the accumulation's rounding and
    runs on tensor cores on GPUs (the Walsh-Hadamard butterflies would be log2(d) passes).
    """
    d = signs.shape[0]
    if x.shape[-1] > d:
        raise InputError(f"head dim {x.shape[-1]} is larger than the rotation's {d} signs")
    x = pad_head_dim(x.float(), d)
    h = hadamard_matrix(d, x.device) * signs[:, None].to(x.device)
    return (x @ h) * (1.0 / math.sqrt(d))


def unrotate(x: torch.Tensor, signs: torch.Tensor, head_dim: int | None = None) -> torch.Tensor:
    """The inverse of ``rotate`` (``x @ R.T``), cut back to ``head_dim`` channels."""
    d = signs.shape[0]
    if head_dim is not None:  # (a negative one sliced from the end: the wrong width)
        head_dim = check_int("unrotate", "head_dim", head_dim, 1)
        if head_dim > d:
            raise InputError(f"unrotate: head_dim={head_dim} is larger than the rotation's "
                             f"{d} signs")
    h = hadamard_matrix(d, x.device) * signs[:, None].to(x.device)
    out = (x.float() @ h.T) * (1.0 / math.sqrt(d))
    return out if head_dim is None else out[..., :head_dim]
