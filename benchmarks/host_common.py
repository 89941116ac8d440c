"""Shared by the host-time scripts (host_costs.py, host_profile.py, step_timeline.py): host
time per call with the GPU kept busy, and the flexfa / FlexAttention pair of one variant."""
from __future__ import annotations

import time

import torch

import flexfa
from flexfa.bench import _variants


def host_us(fn, calls: int, sleep_cycles: int = 400_000_000) -> float:
    """Host microseconds per call of ``fn`` (median of 5 rounds of ``calls`` calls) while a
    ``torch.cuda._sleep(sleep_cycles)`` keeps the GPU busy, so the queue never drains and only
    the host is timed (400M cycles: about 0.2 s on the H200)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        torch.cuda._sleep(sleep_cycles)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return sorted(rounds)[2]


def variant_pair(name: str, q, k, v, compiled_flex) -> tuple[dict, object, object]:
    """({"flexfa": fn, "flex": fn}, score_mod, flexfa's block mask) for benchmark variant
    ``name`` on ``[B, H, S, E]`` inputs; each fn() runs the forward on q, k, v
    (``compiled_flex``: ``torch.compile(flex_attention)``)."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask

    B, H, S = q.shape[:3]
    score_mod, mask_mod = _variants(S, H, "cuda")[name]
    fbm = flexfa.create_block_mask(mask_mod, B, None, S, S, device="cuda") if mask_mod else None
    tbm = torch_block_mask(mask_mod, B, None, S, S, device="cuda") if mask_mod else None
    impls = {"flexfa": lambda: flexfa.flex_attention(q, k, v, score_mod, fbm),
             "flex": lambda: compiled_flex(q, k, v, score_mod=score_mod, block_mask=tbm)}
    return impls, score_mod, fbm
