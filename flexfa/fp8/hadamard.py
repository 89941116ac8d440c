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

from ..blockmask.checks import indexed, resolve_device
from ..errors import InputError, InputTypeError, check_int, dims


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
    return _on_device(d, _device("hadamard_matrix", device), dtype)


def _device(func: str, device) -> torch.device:
    """``device`` as a torch.device (None: the CPU; 0 is cuda:0, not a falsy None), "cuda"
    with the current device's index: the caches key on it, and a tensor made for "cuda" lives
    on the device current at the first call (another device's call got that one's)."""
    try:
        device = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise InputError(f"{func}: device={device!r} is not a torch device ({exc})") from None
    if device.type != "meta":  # (meta: the device tests record the ops a device would run on)
        resolve_device(func, device)  # CUDA without CUDA, another kind: InputErrors
    return indexed(device)


def _host_signs(d: int, seed: int) -> torch.Tensor:
    bits = torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(seed))
    return 1.0 - 2.0 * bits.to(torch.float32)


@functools.lru_cache(maxsize=64)
def _signs(d: int, seed: int, device: torch.device) -> torch.Tensor:
    return _host_signs(d, seed).to(device)


def check_seed(seed, func: str = "fp8.quantize") -> int:
    """The rotation's ``seed``: an int torch's generator takes (-2**63 .. 2**64 - 1)."""
    seed = check_int(func, "seed", seed, minimum=None)
    if not -2 ** 63 <= seed < 2 ** 64:
        raise InputError(f"{func}: seed must be in -2**63 .. 2**64 - 1 (torch's generator "
                         f"seeds), got {seed}")
    return seed


MAX_ROTATION = 1 << 16  # a rotation's size (head dims stop far below; 2**40 asked for 8 TB)


def random_signs(d: int, seed: int = 0, device=None) -> torch.Tensor:
    """A reproducible +-1 float32 vector of length d, a power of two (the rotation's size;
    the same for Q and K of one call); cached per (d, seed, device): treat it as read-only."""
    d = check_int("random_signs", "d", d)
    if not is_power_of_two(d) or d > MAX_ROTATION:  # (rotate takes no other length)
        raise InputError(f"random_signs: d must be a power of two up to {MAX_ROTATION} (the "
                         f"Hadamard rotation's size; pad the head dim with padded_dim), got "
                         f"d={d}")
    return _signs(d, check_seed(seed, "random_signs"), _device("random_signs", device))


@functools.lru_cache(maxsize=64)
def _signed(d: int, seed: int, device: torch.device) -> torch.Tensor:
    # made on the host and copied, as every cached tensor here: computed on the GPU from the
    # cached matrix and signs inside a CUDA graph capture, it would be a recorded kernel's
    # output, unwritten until a replay, and cached so for every later call
    return (_sylvester(d) * _host_signs(d, seed)[:, None]).to(device)


def signed_hadamard(d: int, seed: int = 0, device=None) -> torch.Tensor:
    """``diag(random_signs(d, seed)) @ H`` (entries +-1), cached: the fused quantization
    kernel's rotation matrix before its 1/sqrt(d)."""
    return _signed(d, int(seed), _device("signed_hadamard", device))


def rotation_matrix(signs: torch.Tensor) -> torch.Tensor:
    """``diag(signs) @ H / sqrt(d)`` in float32: orthogonal, so ``R @ R.T == I``."""
    d = signs.shape[0]
    return signs[:, None].float() * hadamard_matrix(d, signs.device) / math.sqrt(d)


def pad_head_dim(x: torch.Tensor, d: int) -> torch.Tensor:
    """``x`` with zero channels appended up to head dim ``d`` (``x`` itself if already d)."""
    if x.shape[-1] == d:
        return x
    return torch.nn.functional.pad(x, (0, d - x.shape[-1]))


def _check_rotation(func: str, x, signs) -> int:
    """The rotation's size d: ``x`` a real floating-point tensor of at least one dim,
    ``signs`` a 1-D floating-point tensor of d = a power of two entries, each +1 or -1
    (other values make R no rotation: unrotate would not invert rotate). Reading the signs
    syncs a GPU: the public helpers check, quantize's own calls (random_signs') do not."""
    for name, value in (("x", x), ("signs", signs)):
        if not isinstance(value, torch.Tensor):
            raise InputTypeError(f"{func}: {name} must be a torch.Tensor, got "
                                 f"{type(value).__name__}")
        if not value.dtype.is_floating_point:  # (complex: x.float() dropped the imaginary part)
            raise InputTypeError(f"{func}: {name} must be a floating-point tensor, got dtype "
                                 f"{value.dtype}")
    if x.dim() == 0:
        raise InputError(f"{func}: x must have at least one dim (the head dim, last), got a "
                         "0-d tensor")
    if signs.dim() != 1 or not is_power_of_two(signs.numel()):
        raise InputError(f"{func}: signs must be 1-D with a power-of-two length (from "
                         f"random_signs), got shape {dims(signs)}")
    if signs.device.type == "meta" and x.device.type != "meta":
        raise InputError(f"{func}: signs is a meta tensor (no values) but x is on {x.device}")
    if signs.device.type != "meta" and not bool(((signs == 1) | (signs == -1)).all()):
        raise InputError(f"{func}: signs must all be +1 or -1 (from random_signs), got "
                         f"{signs.tolist()[:8]}{'...' if signs.numel() > 8 else ''}")
    return signs.shape[0]


def rotate(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``x @ R`` in float32 along the last dim (zero-padded to ``len(signs)`` first)."""
    _check_rotation("rotate", x, signs)
    return rotate_unchecked(x, signs)


def rotate_unchecked(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``rotate`` of arguments known good (quantize's: random_signs' signs).

    One matmul with the +-1 matrix is exact in float32 up to the accumulation's rounding and
    runs on tensor cores on GPUs (the Walsh-Hadamard butterflies would be log2(d) passes).
    """
    d = signs.shape[0]
    if x.shape[-1] > d:
        raise InputError(f"rotate: head dim {x.shape[-1]} is larger than the rotation's {d} "
                         "signs")
    x = pad_head_dim(x.float(), d)
    h = hadamard_matrix(d, x.device) * signs[:, None].to(x.device)
    return (x @ h) * (1.0 / math.sqrt(d))


def unrotate(x: torch.Tensor, signs: torch.Tensor, head_dim: int | None = None) -> torch.Tensor:
    """The inverse of ``rotate`` (``x @ R.T``), cut back to ``head_dim`` channels."""
    d = _check_rotation("unrotate", x, signs)
    if x.shape[-1] != d:
        raise InputError(f"unrotate: x has head dim {x.shape[-1]} but the rotation has {d} "
                         "signs; unrotate takes rotate's output (padded to the signs' length)")
    if head_dim is not None:  # (a negative one sliced from the end: the wrong width)
        head_dim = check_int("unrotate", "head_dim", head_dim, 1)
        if head_dim > d:
            raise InputError(f"unrotate: head_dim={head_dim} is larger than the rotation's "
                             f"{d} signs")
    h = hadamard_matrix(d, x.device) * signs[:, None].to(x.device)
    out = (x.float() @ h.T) * (1.0 / math.sqrt(d))
    return out if head_dim is None else out[..., :head_dim]
