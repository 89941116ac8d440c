"""``AttentionCall``: everything about a flex_attention call besides q, k and v."""
from __future__ import annotations

from ..frontend.trace import TracedMod
from .options import KernelOptions


class AttentionCall:
    """The traced mods, the block mask, scale, options and GQA group of one call. Made per
    call (a few attribute stores); nothing caches it, so it keeps nothing alive."""

    __slots__ = ("score", "mask", "block_mask", "scale", "options", "gqa_group")

    def __init__(self, score: TracedMod | None, mask: TracedMod | None, block_mask,
                 scale: float, options: KernelOptions, gqa_group: int):
        self.score = score  # traced, simplified score_mod (None: none)
        self.mask = mask  # traced mask_mod of the block mask
        self.block_mask = block_mask  # flexfa or torch BlockMask (None: dense)
        self.scale = scale
        self.options = options
        self.gqa_group = gqa_group  # query heads per kv head

    @property
    def scores_first(self) -> bool:
        """HAS_SCORE_MOD of the forward kernels: score = q.k * scale is formed before the
        softmax. Without a score_mod the kernels fold the scale into the softmax's FMA and take
        the row max of the raw q.k, which needs scale > 0."""
        return self.score is not None or self.scale <= 0

    @property
    def mods_key(self) -> tuple:
        """What of the call selects a kernel besides the tensors' layout: the mods' structure,
        the options, the GQA group and the score-first mode."""
        return (self.score.key if self.score else None, self.mask.key if self.mask else None,
                self.options, self.gqa_group, self.scores_first)

    def __repr__(self) -> str:
        return (f"AttentionCall(score={self.score!r}, mask={self.mask!r}, scale={self.scale}, "
                f"gqa_group={self.gqa_group})")
