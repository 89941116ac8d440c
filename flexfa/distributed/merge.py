"""Merging partial attention results by their log-sum-exp.

A ring step gives (out_i, lse_i) over one kv shard; the whole row is
``out = sum_i exp(lse_i - lse) out_i`` with ``lse = logsumexp_i lse_i``. A row that attends
to nothing in a step has lse_i = -inf and out_i = 0; a row empty in every step keeps lse
-inf and out 0 (never NaN: the weights are taken against a finite stand-in for -inf).
"""
from __future__ import annotations

import torch


def finite_lse(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf replaced by 0, to subtract from: exp(-inf - 0) = 0 for empty rows."""
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def weight(lse_part: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(lse_part - lse): the share of a partial result in the merged row (0 if empty)."""
    return torch.exp(lse_part - finite_lse(lse))


def merge_into(out: torch.Tensor, lse: torch.Tensor, out_part: torch.Tensor,
               lse_part: torch.Tensor) -> None:
    """Fold (out_part, lse_part) into the running float32 (out, lse), in place."""
    merged = torch.logaddexp(lse, lse_part)
    keep, add = weight(lse, merged), weight(lse_part.float(), merged)
    out.mul_(keep.unsqueeze(-1)).add_(out_part.float() * add.unsqueeze(-1))
    lse.copy_(merged)


def fold_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> None:
    """Fold the attention sinks ``[Hq]`` into the merged float32 (out, lse), in place: each
    row's sink joins its denominator as a term without a value (docs/sinks.md), so lse
    becomes logaddexp(lse, sink) and out shrinks by exp(lse - that). A row empty in every step
    gets the sink alone (out 0, lse = sink); a sink of -inf changes nothing (a weight of
    exactly 1); one of +inf gives the limit (out 0, lse +inf)."""
    sink = sinks.detach().float().view(1, -1, 1).expand_as(lse)
    merged = torch.logaddexp(lse, sink)
    out.mul_(weight(lse, merged).unsqueeze(-1))
    lse.copy_(merged)
