"""The ring's view of the user's mods: the same mods at global positions, and per ring step
the block mask of (this rank's q shard, the kv shard it holds), or None for a step whose
pairs are all masked, which is skipped.

The wrappers read the global positions from two captured int64 tensors, ``q_pos`` and
``kv_pos``. Captured tensors' values are not part of the trace or the kernel key
(docs/caching.md), so one wrapper serves every step: ``kv_pos`` is rewritten in place before
each step (``at_step``) and every step reuses one trace and one kernel. A kernel reads
``kv_pos`` when it runs, so a step's kernels (forward and the backward's recompute) must run
while ``kv_pos`` holds that step's positions: the ring runs its steps one after another.
"""
from __future__ import annotations

import torch

from ..blockmask import create_block_mask
from ..frontend.trace import mod_name


def _global_score(score_mod, q_pos: torch.Tensor, kv_pos: torch.Tensor):
    def global_score(score, b, h, q_idx, kv_idx):
        return score_mod(score, b, h, q_pos[q_idx], kv_pos[kv_idx])
    global_score.__name__ = f"global_{mod_name(score_mod)}"
    return global_score


def _global_mask(mask_mod, q_pos: torch.Tensor, kv_pos: torch.Tensor):
    def global_mask(b, h, q_idx, kv_idx):
        return mask_mod(b, h, q_pos[q_idx], kv_pos[kv_idx])
    global_mask.__name__ = f"global_{mod_name(mask_mod)}"
    return global_mask


class RingMods:
    """The user's mods at global positions for one rank's q shard; ``at_step`` points them at
    a kv shard's positions and returns that step's block mask (None: fully masked, skip)."""

    def __init__(self, score_mod, mask_mod, q_pos: torch.Tensor, kv_length: int,
                 batch: int, heads: int, block_size):
        self.q_pos = q_pos
        self.kv_pos = torch.zeros(kv_length, dtype=torch.long, device=q_pos.device)
        self.score_mod = None if score_mod is None else _global_score(score_mod, q_pos,
                                                                      self.kv_pos)
        self.mask_mod = None if mask_mod is None else _global_mask(mask_mod, q_pos, self.kv_pos)
        self.shape = (batch, heads, len(q_pos), kv_length)
        self.block_size = block_size

    def at_step(self, kv_pos: torch.Tensor):
        """Set the kv positions; (runs, block mask): ``runs`` False when every (q, kv) pair of
        the step is masked (no partial and no full kv block in any row of tiles)."""
        self.kv_pos.copy_(kv_pos)
        if self.mask_mod is None:
            return True, None
        batch, heads, q_length, kv_length = self.shape
        if not (batch and q_length and kv_length):  # nothing to score (and create_block_mask
            return False, None  # refuses sizes of 0): flex_attention's empty results
        mask = create_block_mask(self.mask_mod, batch, heads, q_length, kv_length,
                                 device=self.q_pos.device, BLOCK_SIZE=self.block_size)
        return has_blocks(mask), mask


def has_blocks(mask) -> bool:
    """Whether a block mask visits any kv block (partial or full)."""
    full = mask.full_kv_num_blocks
    return bool(mask.kv_num_blocks.any()) or (full is not None and bool(full.any()))
