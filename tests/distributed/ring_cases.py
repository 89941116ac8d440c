"""The mods and inputs the ring-attention tests share between the spawned ranks and the
single-process check: every case is built from its name and the global length alone, so each
process makes the same tensors."""
from __future__ import annotations

import torch

BATCH, HEADS, HEAD_DIM = 1, 2, 16
WINDOW = 20
# the global length: 24 rows per rank on 2 ranks, 16 on 3; chunks of 12 and 8 rows with load
# balancing, none a multiple of the 16-row blocks
LENGTH = 48
CASES = ("full", "causal", "document", "sliding_window", "learned_bias", "sinks")
# grouped-query attention: "gqa_<case>" is <case> with GQA_GROUP x HEADS query heads sharing
# HEADS key/value heads (two kv heads, so a wrong head-to-group map shows)
GQA_GROUP = 2
GQA_PREFIX = "gqa_"
# the mask of the sinks cases: "sinks" with learnable ones, "limit_sinks" with +inf and -inf
# (two heads), "gaps" the same mask without sinks
SINK_CASES = ("sinks", "limit_sinks", "gaps")


def heads(case: str) -> tuple[int, int]:
    """(query heads, key/value heads) of ``case``."""
    return (GQA_GROUP * HEADS, HEADS) if case.startswith(GQA_PREFIX) else (HEADS, HEADS)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def inputs(length: int, case: str = "full", seed: int = 0):
    """Full-sequence (q, k, v, grad_out, grad_lse) of ``case``, float32 [B, H, length, E]
    (k and v with the case's key/value heads)."""
    generator = torch.Generator().manual_seed(seed)
    q_heads, kv_heads = heads(case)
    q_shape, kv_shape = ((BATCH, h, length, HEAD_DIM) for h in (q_heads, kv_heads))
    q, k, v, grad_out = (torch.randn(shape, generator=generator)
                         for shape in (q_shape, kv_shape, kv_shape, q_shape))
    grad_lse = torch.randn(q_shape[:3], generator=generator)
    return q, k, v, grad_out, grad_lse


def mods(case: str, length: int):
    """(score_mod, mask_mod, learnable tensors) of ``case`` over a sequence of ``length``."""
    q_heads = heads(case)[0]
    case = case.removeprefix(GQA_PREFIX)
    if case == "full":
        return None, None, ()
    if case == "causal":
        return None, causal, ()
    if case == "document":
        # documents of uneven lengths that straddle the shard and chunk boundaries
        ends = torch.tensor([7, 20, 21, 35, length])
        document = torch.bucketize(torch.arange(length), ends, right=True)

        def same_document_causal(b, h, q_idx, kv_idx):
            return (document[q_idx] == document[kv_idx]) & (q_idx >= kv_idx)
        return None, same_document_causal, ()
    if case == "sliding_window":
        def sliding_window(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)
        return None, sliding_window, ()
    if case in SINK_CASES:  # (with rows that attend to nothing: out 0, lse the sink)
        def causal_gaps(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx % 7 != 3)
        return None, causal_gaps, ()
    if case == "learned_bias":
        bias = (0.1 * torch.arange(q_heads * (2 * length - 1), dtype=torch.float32).sin()
                ).reshape(q_heads, 2 * length - 1).requires_grad_()

        def relative_bias(score, b, h, q_idx, kv_idx):
            return score + bias[h, q_idx - kv_idx + length - 1]
        return relative_bias, causal, (bias,)
    raise ValueError(f"unknown case {case!r}")


def sinks(case: str):
    """The learnable attention sinks [Hq] of ``case`` (a new tensor on each call), or None."""
    q_heads, case = heads(case)[0], case.removeprefix(GQA_PREFIX)
    if case == "limit_sinks":
        values = [float("inf"), float("-inf")]
    elif case == "sinks":
        values = [0.5 - 0.6 * h for h in range(q_heads)]
    else:
        return None
    return torch.tensor(values, dtype=torch.float32).requires_grad_()
