"""flex_attention's optional features: attention sinks and dropout. Their input checks (run
before any kernel, each error naming the argument and the values) and ``dropout_mask``, the
keep mask a seed gives, for references and tests.

Attention sinks (GPT-OSS): ``sinks`` [Hq] holds one learnable logit per query head that joins
every row's softmax denominator as a term without a value:
``out = sum_j exp(s_j - m) v_j / (exp(sink_h - m) + sum_j exp(s_j - m))``; lse includes it.
Dropout: each attention probability is dropped with probability ``dropout_p`` and the kept
ones are scaled by the inverse of the keep rate (``1 / (1 - dropout_p)`` with 1 - p rounded
to a multiple of 2**-16: ``flexfa.runtime.dropout.scale``) before ``P @ V``; lse is
unaffected. The keep mask is a pure function of (seed, offset, b, h, q, k)
(``flexfa.runtime.dropout``).
"""
from __future__ import annotations

import math
import numbers

import torch

from .blockmask.checks import resolve_device
from .errors import InputError, InputTypeError, check_int, dims
from .inputs import MAX_CUDA_PROGRAM_ROWS, check_readable, shown
from .lazy import lazy_function
from .runtime.call import OFFSET_LIMIT, SEED_LIMIT, Dropout, seed_tensor

keep_mask = lazy_function("flexfa.runtime.dropout", "keep_mask")  # loads Triton


def check_sinks(sinks, heads: int, dtype: torch.dtype, device) -> torch.Tensor | None:
    """``sinks`` as the kernels read it (contiguous; differentiable), after checking that it
    is a tensor of shape [heads] (the query's heads) in float32 or ``dtype`` (the query's)
    on ``device``."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise InputTypeError(f"sinks must be a torch.Tensor or None, got {type(sinks).__name__}")
    if tuple(sinks.shape) != (heads,):
        raise InputError(f"sinks has shape {dims(sinks)} but query has {heads} heads; "
                         f"sinks must be [{heads}]: one logit per query head")
    if sinks.dtype not in (torch.float32, dtype):
        raise InputTypeError(f"sinks has dtype {sinks.dtype}; it must be float32 or the "
                             f"query's dtype {dtype}")
    if sinks.device != device:
        raise InputError(f"sinks is on {sinks.device} but query is on {device}")
    check_readable("sinks", sinks)
    return sinks.contiguous()


def check_no_dropout(dropout_p, where: str) -> None:
    """Refuse dropout where there is none (the forward-only FP8 path)."""
    if check_dropout_p(dropout_p) != 0.0:
        raise InputError(f"{where} has no dropout (it is forward-only inference), got "
                         f"dropout_p={dropout_p!r}; use flexfa.flex_attention for training")


def check_dropout_p(dropout_p, name: str = "dropout_p") -> float:
    """``dropout_p`` as a float in [0, 1); ``name``: the argument as the caller calls it."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise InputTypeError(f"{name} must be a float in [0, 1), got "
                             f"{shown(dropout_p, typed=True)}")
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:  # also refuses NaN
        raise InputError(f"{name} must be in [0, 1), got {shown(dropout_p)}")
    return p


def _seed_and_offset(dropout_seed, name: str = "dropout_seed") -> tuple[int | None, int]:
    """(seed, offset) from ``dropout_seed``: None, an int seed, or a (seed, offset) pair;
    ``name``: the argument as the caller calls it."""
    if dropout_seed is None:
        return None, 0
    pair = dropout_seed if isinstance(dropout_seed, tuple) else (dropout_seed, 0)
    if len(pair) != 2 or not all(isinstance(x, numbers.Integral) and not isinstance(x, bool)
                                 for x in pair):
        raise InputTypeError(f"{name} must be None, an int or a (seed, offset) pair of "
                             f"ints, got {shown(dropout_seed)}")
    seed, offset = (int(x) for x in pair)
    if not 0 <= seed < SEED_LIMIT:
        raise InputError(f"{name}'s seed must be in [0, 2**63), got {seed}")
    if not 0 <= offset < OFFSET_LIMIT:
        raise InputError(f"{name}'s offset must be in [0, 2**32), got {offset}")
    return seed, offset


def prepare_dropout(dropout_p, dropout_seed, device) -> Dropout | None:
    """The call's ``Dropout`` (None for p = 0: today's kernels), its seed tensor on
    ``device`` (drawn from torch's generator of that device when ``dropout_seed`` is None)."""
    p = check_dropout_p(dropout_p)
    seed, offset = _seed_and_offset(dropout_seed)
    if p == 0.0:
        return None
    return Dropout(p, seed_tensor(seed, offset, device))


def dropout_mask(seed, B: int, H: int, L: int, S: int, p: float, device="cpu") -> torch.Tensor:
    """bool [B, H, L, S]: True where ``flex_attention(..., dropout_p=p, dropout_seed=seed)``
    keeps the probability of (batch, query head, query, key), drawn by the same kernel
    helpers. ``seed``: an int or a (seed, offset) pair. Writes L x S bytes: for references
    and tests at small sizes."""
    p = check_dropout_p(p, "dropout_mask: p")
    seed_, offset = _seed_and_offset(seed, "dropout_mask: seed")
    if seed_ is None:
        raise InputError("dropout_mask needs a seed: an int or a (seed, offset) pair")
    B, H, L, S = (check_int("dropout_mask", name, value, 0)
                  for name, value in (("B", B), ("H", H), ("L", L), ("S", S)))
    device = resolve_device("dropout_mask", device)
    _check_mask_sizes(B, H, L, S, device)
    return keep_mask(seed_tensor(seed_, offset, device), B, H, L, S, p)


# the mask kernel's query and key indices are int32 and run a tile (up to 64) past the last
# one: a length within this many of 2**31 wraps them negative, past the bounds check, and the
# kernel writes before the mask's memory
MAX_MASK_LENGTH = 2 ** 31 - 64


def _check_mask_sizes(B: int, H: int, L: int, S: int, device: torch.device) -> None:
    """Sizes the mask kernel can index and torch can allocate (errors that were torch's
    overflow, or a kernel writing out of bounds), before anything is allocated."""
    for name, value in (("L", L), ("S", S)):
        if value > MAX_MASK_LENGTH:
            raise InputError(f"dropout_mask: {name} must be at most {MAX_MASK_LENGTH} (2**31 - "
                             f"64: the kernel's indices are int32), got {name}={value}")
    if math.prod(n for n in (B, H, L, S) if n) >= 2 ** 63:  # (torch's check skips no 0)
        raise InputError(f"dropout_mask: the mask [B={B}, H={H}, L={L}, S={S}] has sizes whose "
                         "product is past int64 (torch's largest tensor)")
    if device.type == "cuda" and L * S and B * H > MAX_CUDA_PROGRAM_ROWS:
        raise InputError(f"dropout_mask: B * H = {B * H} (batch, head) pairs; the CUDA kernel "
                         f"runs them on a grid axis of at most {MAX_CUDA_PROGRAM_ROWS}, as "
                         "flex_attention does")
