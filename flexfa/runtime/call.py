"""``AttentionCall``: everything about a flex_attention call besides q, k and v."""
from __future__ import annotations

import torch

from ..codegen.spec import DTYPE_NAMES
from ..frontend.trace import TracedMod
from .options import KernelOptions

_NO_FEATURES = frozenset()
SEED_LIMIT = 2 ** 63  # seeds are int64 values in [0, SEED_LIMIT)
OFFSET_LIMIT = 2 ** 32  # offsets are the fourth 32-bit counter
SINKS_GRAD = "sinks"  # the sinks' gradient's key among run_backward's buffer gradients


def seed_tensor(seed: int | None, offset: int, device) -> torch.Tensor:
    """int64 [seed, offset] on ``device``: as given, or (``seed`` None) both drawn from torch's
    default generator of that device (``torch.manual_seed`` makes them reproducible)."""
    if seed is None:
        return torch.randint(0, SEED_LIMIT - 1, (2,), dtype=torch.int64, device=device)
    return torch.tensor([seed, offset], dtype=torch.int64, device=device)


class Dropout:
    """A call's dropout: the probability ``p`` of dropping an attention probability and
    ``seed``, an int64 tensor [seed, offset] on the call's device (the backward draws the
    same keep mask from it: ``flexfa.runtime.dropout``)."""

    __slots__ = ("p", "seed")

    def __init__(self, p: float, seed):
        self.p, self.seed = p, seed

    def __repr__(self) -> str:
        return f"Dropout(p={self.p})"


class AttentionCall:
    """The traced mods, the block mask, scale, options and GQA group of one call, and its
    optional features: ``sinks`` (a contiguous [Hq] tensor of per-head sink logits) and
    ``dropout`` (a ``Dropout``). Made per call (a few attribute stores); nothing caches it,
    so it keeps nothing alive. ``plans``: where a prepared call (``flexfa.prepared``) keeps
    the forward plans it ran, or None."""

    __slots__ = ("score", "mask", "block_mask", "scale", "options", "gqa_group", "sinks",
                 "dropout", "plans")

    def __init__(self, score: TracedMod | None, mask: TracedMod | None, block_mask,
                 scale: float, options: KernelOptions, gqa_group: int, sinks=None,
                 dropout: Dropout | None = None):
        self.score = score  # traced, simplified score_mod (None: none)
        self.mask = mask  # traced mask_mod of the block mask
        self.block_mask = block_mask  # flexfa or torch BlockMask (None: dense)
        self.scale = scale
        self.options = options
        self.gqa_group = gqa_group  # query heads per kv head
        self.sinks = sinks
        self.dropout = dropout
        self.plans: dict | None = None

    @property
    def scores_first(self) -> bool:
        """HAS_SCORE_MOD of the forward kernels: score = q.k * scale is formed before the
        softmax. Without a score_mod the kernels fold the scale into the softmax's FMA and take
        the row max of the raw q.k, which needs scale > 0."""
        return self.score is not None or self.scale <= 0

    @property
    def features(self) -> frozenset:
        """The optional features this call uses ("sinks", "dropout"): a kernel family runs
        the call only if it has them all (``registry.choose``)."""
        if self.sinks is None and self.dropout is None:
            return _NO_FEATURES
        return frozenset(name for name, value in (("sinks", self.sinks),
                                                  ("dropout", self.dropout))
                         if value is not None)

    def replaced(self, score: TracedMod | None, dropout: Dropout | None,
                 mask: TracedMod | None = None) -> AttentionCall:
        """This call with another score_mod trace and dropout (the backward's: its saved
        captured tensors and seed, flexfa.autograd), and mask_mod trace where given."""
        call = AttentionCall(score, self.mask if mask is None else mask, self.block_mask,
                             self.scale, self.options, self.gqa_group, self.sinks, dropout)
        call.plans = self.plans
        return call

    @property
    def sinks_dtype(self) -> str:
        """The sinks' element type as kernels name it ("fp32", "bf16", "fp16"; "" without)."""
        return "" if self.sinks is None else DTYPE_NAMES[self.sinks.dtype]

    @property
    def mods_key(self) -> tuple:
        """What of the call selects a kernel besides the tensors' layout: the mods' structure,
        the options, the GQA group and the score-first mode; with sinks their dtype and
        alignment, with dropout its probability (the kernels' threshold and scale)."""
        key = (self.score.key if self.score else None, self.mask.key if self.mask else None,
               self.options, self.gqa_group, self.scores_first)
        if self.sinks is not None:
            key += ("sinks", self.sinks.dtype, self.sinks.data_ptr() % 16 == 0)
        if self.dropout is not None:
            key += ("dropout", self.dropout.p)
        return key

    def __repr__(self) -> str:
        return (f"AttentionCall(score={self.score!r}, mask={self.mask!r}, scale={self.scale}, "
                f"gqa_group={self.gqa_group})")
