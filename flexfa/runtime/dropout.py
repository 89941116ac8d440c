"""Dropout's host side: the seed tensor a call's kernels draw from, the threshold and scale
of a probability, and the kernel that writes the keep mask of a seed (for references).

An element (b, h, q, k) of a call is kept when its 16-bit half of a Philox4x32-10 word is at
least ``round(p * 2**16)``: of the output words of key ``seed`` and counters
(4 * (k // 32) + (k % 8) // 2, q, b * H + h, offset mod 2**32), word (k % 32) // 8, the low
half for even k (``flexfa_dropout_keep`` in helpers.tmpl: the halves a thread of an
accumulator tile holds come from its own Philox calls). A pure function of the seed and the indices,
drawn again by the backward, nothing of size L x S stored; one Philox call covers eight
keys (FlashAttention-2 takes 8 bits an element, sixteen keys a call).
"""
from __future__ import annotations

import torch

from ..codegen.dropout import dropout_mask_kernel
from .kernels import ModeSpec, generated_module
from .launch import Step, cdiv

THRESHOLD_BITS = 16  # the random bits an element is decided by


def threshold(p: float) -> int:
    """The 16-bit threshold of drop probability ``p`` in [0, 1): an element is dropped when
    its random half-word is below it, so with probability ``threshold(p) / 2**16`` (within
    2**-17 of p; at most 1 - 2**-16)."""
    return min(round(p * 2 ** THRESHOLD_BITS), 2 ** THRESHOLD_BITS - 1)


def scale(p: float) -> float:
    """What kept probabilities are multiplied by: the inverse of the keep rate the threshold
    gives, ``2**16 / (2**16 - threshold(p))`` (1 / (1 - p) within 2**-16 relative at p = 0.1,
    but 1.53 x too large at p = 1 - 1e-5 whose keep rate rounds to 2**-16), so the output's
    expectation is the output without dropout at every p."""
    return 2 ** THRESHOLD_BITS / (2 ** THRESHOLD_BITS - threshold(p))


def kernel_values(p: float, seed: torch.Tensor) -> dict:
    """The dropout arguments of an attention kernel (params.feature_params)."""
    return {"DROPOUT_SEED": seed, "dropout_threshold": threshold(p),
            "dropout_scale": scale(p)}


def _generate(spec: ModeSpec):
    return dropout_mask_kernel()


def keep_mask(seed: torch.Tensor, B: int, H: int, L: int, S: int, p: float) -> torch.Tensor:
    """bool [B, H, L, S]: True where an attention kernel with dropout probability ``p`` and
    this seed tensor keeps the probability of (batch, query head, query, key)."""
    device = seed.device
    keep = torch.empty(B, H, L, S, dtype=torch.uint8, device=device)
    if keep.numel():
        loaded = generated_module(_generate, ModeSpec("dropout_mask", device.type != "cuda"))
        values = {"KEEP": keep, "SEED": seed, "L": L, "S": S, "threshold": threshold(p)}
        args = [values[name] for name in loaded.names()]
        block = 32 if device.type != "cuda" else 64
        Step(loaded.kernel(), (cdiv(L, block), B * H), {"BLOCK_M": block, "BLOCK_N": block},
             {"num_warps": 4}).launch(args, device)
    return keep.bool()
