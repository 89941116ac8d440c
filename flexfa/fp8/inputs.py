"""``FP8Inputs``: Q, K, V in float8_e4m3fn with their per-block descales."""
from __future__ import annotations

import dataclasses
import weakref

import torch

from ..codegen import fp8 as fp8_codegen
from ..errors import check_bool
from ..memo import contents_key, contents_of
from .hadamard import unrotate as hadamard_unrotate

FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0
DESCALE_MIN = fp8_codegen.DESCALE_MIN


@dataclasses.dataclass(frozen=True)
class FP8Inputs:
    """Q, K, V in float8_e4m3fn with their float32 descales, as ``quantize`` returns them."""

    q: torch.Tensor  # [B, Hq, L, Ep] (Ep: head dim, padded to a power of two when rotated)
    k: torch.Tensor  # [B, Hkv, S, Ep]
    v: torch.Tensor  # [B, Hkv, S, Ev], stride 1 along S
    q_scale: torch.Tensor  # [B, Hq, ceil(L / block_q)] float32
    k_scale: torch.Tensor  # [B, Hkv, ceil(S / block_kv)] float32
    v_scale: torch.Tensor  # [B, Hkv, ceil(S / block_kv)] float32
    block_q: int
    block_kv: int
    head_dim: int  # E before padding: the default softmax scale is 1/sqrt(head_dim)
    dtype: torch.dtype  # dtype of the original inputs, and of the attention output
    signs: torch.Tensor | None = None  # the rotation's +-1 signs (None: not rotated)
    # every descale is finite and >= DESCALE_MIN, as ``quantize`` writes them (amax / 448, at
    # least DESCALE_MIN, or 1 for an all-zero block): without a score_mod the kernel then scales q.k inside exp2's FMA (2-3% faster
    # on the H200). False (the default for inputs built by hand) keeps a separate multiply,
    # exact for descales of any sign. Replacing the scales of quantize's output by others
    # that are not all > 0 needs ``positive_scales=False`` too.
    positive_scales: bool = False
    # (weak reference, ``memo.contents_key``, ``memo.memory_of``) of each descale as
    # ``quantize`` wrote it: while the three are those tensors, unedited and in the same
    # memory, ``positive_scales`` needs no check (``scales_as_written``);
    # replaced or edited ones are checked once per call (a host synchronisation)
    written: tuple = dataclasses.field(default=(), repr=False, compare=False)

    def scales_as_written(self) -> bool:
        """Whether q_scale, k_scale and v_scale are the tensors ``quantize`` wrote, unedited."""
        scales = (self.q_scale, self.k_scale, self.v_scale)
        return len(self.written) == 3 and all(
            ref() is t and contents_key(t) == key for (ref, key, _), t in zip(self.written, scales))

    def dequantize(self, unrotate: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """float32 (q, k, v): descaled, and with ``unrotate`` back in the original basis with
        the padding removed; without it, q and k stay rotated and padded, the basis the kernel
        computes q.k in (quantization error leaks into padded channels, so only there is
        q.k exactly the kernel's)."""
        unrotate = check_bool("FP8Inputs.dequantize: unrotate", unrotate)
        q = descale(self.q, self.q_scale, self.block_q)
        k = descale(self.k, self.k_scale, self.block_kv)
        v = descale(self.v, self.v_scale, self.block_kv)
        if self.signs is not None and unrotate:
            q, k = (hadamard_unrotate(x, self.signs, self.head_dim) for x in (q, k))
        return q, k, v


def written(scales) -> tuple:
    """``FP8Inputs.written`` of the descales ``quantize`` just wrote; none for inference
    tensors (no version counter to tell an edit: such descales are checked on every call)."""
    found = contents_of(scales)
    return () if found is None else tuple(zip(map(weakref.ref, scales), *found))


def expand_scales(scale: torch.Tensor, block: int, rows: int) -> torch.Tensor:
    """Per-block scales ``[B, H, nb]`` -> per-row ``[B, H, rows, 1]``."""
    return scale.repeat_interleave(block, dim=-1)[..., :rows, None]


def descale(x8: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    return x8.float() * expand_scales(scale, block, x8.shape[2])
