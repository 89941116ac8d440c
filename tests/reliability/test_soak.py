"""Soak: many calls with new mods per call stay within fixed memory and cache sizes.

CI runs a reduced count; ``pytest -m slow tests/reliability/test_soak.py`` runs the issue's
full one (10,000 calls with a new lambda each, 500 distinct captured-int mods).
"""
import gc
import os

import pytest
import torch

import flexfa
from flexfa.frontend.trace import TRACE_MEMO
from flexfa.memo import BoundedMemo, MaskedMemo, OwnedMemo, _ALL

# a leak of one captured tensor per call would cost this much per call: over the reduced
# run's calls, more than RSS_GROWTH_LIMIT
CAPTURED_BYTES = 2 << 20
RSS_GROWTH_LIMIT = 256 << 20  # bytes, over the whole loop after warm-up


def _rss() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _memo_sizes() -> dict:
    sizes = {}
    for memo in list(_ALL):
        if isinstance(memo, (BoundedMemo, MaskedMemo, OwnedMemo)):
            sizes[f"{memo.name or type(memo).__name__}#{id(memo):x}"] = len(memo)
    return sizes


def _soak(calls: int, distinct: int) -> None:
    q, k, v = (torch.randn(1, 1, 16, 16) for _ in range(3))
    for _ in range(3):  # warm-up: the first kernel, allocator pools
        bias = torch.randn(CAPTURED_BYTES // 4)
        flexfa.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + bias[j])
    gc.collect()
    start = _rss()
    # owners other tests of this process keep alive (their modules' mods) are not this loop's
    owners = TRACE_MEMO.owner_count()
    for step in range(calls):
        bias = torch.randn(CAPTURED_BYTES // 4)  # a new lambda and tensor each call
        flexfa.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + bias[j])
    for n in range(distinct):  # a new kernel each: the constant is part of the IR
        flexfa.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j, n=n: s + n)
    del bias
    gc.collect()
    growth = _rss() - start
    assert growth < RSS_GROWTH_LIMIT, f"RSS grew by {growth / 2**20:.0f} MiB over {calls} calls"
    assert TRACE_MEMO.owner_count() - owners <= 16, (owners, TRACE_MEMO.owner_count())
    for name, size in _memo_sizes().items():
        assert size <= 1024, f"memo {name} holds {size} entries"


def test_soak_reduced():
    calls = int(os.environ.get("FLEXFA_SOAK_CALLS", "150"))
    _soak(calls, distinct=max(1, calls // 20))


@pytest.mark.slow
def test_soak_full():
    _soak(10_000, distinct=500)
