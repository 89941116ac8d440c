"""Quantizing Q, K, V to float8_e4m3fn with per-block scales (and an optional rotation).

A block is ``block_q`` query rows (or ``block_kv`` key/value rows) of one head; its scale is
``amax / 448`` (448: the largest finite e4m3 value), so the block's largest entry lands on
448. ``amax`` is over the block's finite entries; NaN and +-inf entries become e4m3's NaN, so
they do not change the block's other values. The kernel multiplies the scales back (they are *descales*): ``q = q_fp8 * q_scale``.
V is stored with the sequence dim contiguous (a transposed layout seen through a
``[B, H, S, Ev]`` view), the K-major operand layout Hopper's FP8 wgmma wants for ``P @ V``.
"""
from __future__ import annotations

import torch

from ..inputs import broadcast_batch
from .hadamard import check_seed, padded_dim, random_signs, signed_hadamard
from .hadamard import rotate_unchecked as hadamard_rotate
from .inputs import DESCALE_MIN, E4M3_MAX, FP8_DTYPE, FP8Inputs, expand_scales, written

__all__ = ["E4M3_MAX", "FP8_DTYPE", "FP8Inputs", "output_dtype", "quantize"]

def output_dtype(input_dtype: torch.dtype) -> torch.dtype:
    """The attention output's dtype: the inputs' for bf16/fp16, else bf16."""
    return input_dtype if input_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def _block_amax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Max finite |x| per block of ``block`` rows: ``[B, H, N, E] -> [B, H, ceil(N / block)]``.
    A NaN or inf entry does not count: an inf scale would zero the block's other values and a
    NaN one (``NaN > 0`` is False) gave scale 1, clamping them to +-448."""
    B, H, N, E = x.shape
    blocks = -(-N // block)
    magnitude = torch.where(torch.isfinite(x), x.abs(), 0.0)
    padded = torch.nn.functional.pad(magnitude, (0, 0, 0, blocks * block - N))
    # (reshape: a [B, L, H, E] input seen as [B, H, L, E] keeps its strides through where
    # and a zero-width pad, which view cannot regroup)
    return padded.reshape(B, H, blocks, block * E).amax(dim=-1)


def _scales(amax: torch.Tensor) -> torch.Tensor:
    # an all-zero block gets scale 1 (any scale represents zeros; 0 would divide by zero);
    # others at least DESCALE_MIN (a float32 block of amax below 448 * 2**-149 divided to 0)
    scale = (amax / E4M3_MAX).clamp_min(DESCALE_MIN)
    return torch.where(amax > 0, scale, torch.ones_like(amax)).float()


def _to_fp8(x: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    scaled = x.float() / expand_scales(scale, block, x.shape[2])
    # NaN and +-inf become e4m3's NaN (it has no inf) rather than +-448
    saturated = torch.where(torch.isfinite(scaled), scaled.clamp(-E4M3_MAX, E4M3_MAX), torch.nan)
    return saturated.to(FP8_DTYPE)


def seq_contiguous_storage(v: torch.Tensor) -> torch.Tensor:
    """An e4m3 ``[B, H, S, Ev]`` view of S-contiguous storage (S padded to 16: aligned rows)."""
    B, H, S, Ev = v.shape
    storage = torch.zeros(B, H, Ev, -(-S // 16) * 16, dtype=FP8_DTYPE, device=v.device)
    return storage.transpose(-1, -2)[:, :, :S, :]


def _seq_contiguous(v8: torch.Tensor) -> torch.Tensor:
    """``v8`` [B, H, S, Ev] copied into S-contiguous storage."""
    out = seq_contiguous_storage(v8)
    out.copy_(v8)
    return out


def _block_sizes(block_size) -> tuple[int, int]:
    from .checks import check_block_size  # validation lives with the other checks
    return check_block_size(block_size)


def quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size=128,
             rotate: bool = True, seed: int = 0, per_tensor: bool = False,
             fused: bool | None = None) -> FP8Inputs:
    """Quantize bf16/fp16/fp32 ``q [B,Hq,L,E]``, ``k [B,Hkv,S,E]``, ``v [B,Hkv,S,Ev]`` to e4m3.

    ``block_size``: rows per scale block, an int or ``(block_q, block_kv)``; a power of two
    >= 16 (the kernel's tiles must divide it). ``rotate``: apply one random-sign Hadamard
    rotation (signs from ``seed``) to Q and K first; head dims that are not powers of two are
    zero-padded. ``per_tensor``: one scale per tensor instead of per block (the plain FP8
    baseline; the scale tables keep their per-block shape, filled with that one value).
    ``fused``: quantize with one Triton kernel per tensor (rotation, amax, cast in one pass;
    the default on CUDA, not available with ``per_tensor``) instead of torch operations
    (the default on CPU; ``fused=True`` runs the kernel under the interpreter).
    """
    from .checks import check_quantize_inputs
    check_quantize_inputs(q, k, v, rotate, per_tensor, fused)
    seed = check_seed(seed)
    if k.shape[0] == 1 < q.shape[0]:  # key/value shared by the query's batch, as
        k, v = broadcast_batch(q, k, v)  # flex_attention takes them: scales per batch entry
    block_q, block_kv = _block_sizes(block_size)
    signs = random_signs(padded_dim(q.shape[-1]), seed, q.device) if rotate else None
    if fused is None:
        fused = q.device.type == "cuda" and not per_tensor
    if fused:
        return _quantize_fused(q, k, v, block_q, block_kv, signs, seed)
    return _quantize_torch(q, k, v, block_q, block_kv, signs, per_tensor)


def _quantize_fused(q, k, v, block_q, block_kv, signs, seed) -> FP8Inputs:
    from ..runtime.families.fp8 import quantize_rows
    width = q.shape[-1] if signs is None else signs.shape[0]
    rotation = None if signs is None else signed_hadamard(width, seed, q.device)
    q8, k8 = (torch.empty(*x.shape[:3], width, dtype=FP8_DTYPE, device=x.device) for x in (q, k))
    v8 = seq_contiguous_storage(v)
    scales = [quantize_rows(x, block, matrix, out) for x, block, matrix, out in
              ((q, block_q, rotation, q8), (k, block_kv, rotation, k8), (v, block_kv, None, v8))]
    return FP8Inputs(q8, k8, v8, *scales, block_q=block_q, block_kv=block_kv,
                     head_dim=q.shape[-1], dtype=output_dtype(v.dtype), signs=signs,
                     positive_scales=True, written=written(scales))


def _quantize_torch(q, k, v, block_q, block_kv, signs, per_tensor) -> FP8Inputs:
    head_dim = q.shape[-1]
    if signs is not None:
        q, k = hadamard_rotate(q, signs), hadamard_rotate(k, signs)
    scales = []
    for x, block in ((q, block_q), (k, block_kv), (v, block_kv)):
        amax = _block_amax(x.float(), block)
        if per_tensor:
            amax = torch.full_like(amax, float(amax.max()) if amax.numel() else 0.0)
        scales.append(_scales(amax))
    q8, k8, v8 = (_to_fp8(x, s, b) for x, s, b in zip((q, k, v), scales,
                                                       (block_q, block_kv, block_kv)))
    return FP8Inputs(q8, k8, _seq_contiguous(v8), *scales, block_q=block_q, block_kv=block_kv,
                     head_dim=head_dim, dtype=output_dtype(v.dtype), signs=signs,
                     positive_scales=True, written=written(scales))

