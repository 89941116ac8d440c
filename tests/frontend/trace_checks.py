"""What the trace-memo tests share: a mod's values on a small grid, and the check that a
traced mod follows a change of the state it reads (test_trace_guards.py,
test_guard_edges.py)."""
import torch

from flexfa.frontend import evaluate, index_grids
from flexfa.frontend.trace import TRACE_MEMO, trace

GRID = index_grids(1, 1, 8, 8)


def values_of(traced) -> torch.Tensor:
    """``traced``'s values on GRID (a score_mod at score 1), float64."""
    b, h, q, k = GRID
    if traced.kind == "mask_mod":
        return evaluate(traced, b=b, h=h, q_idx=q, kv_idx=k)
    return evaluate(traced, score=torch.ones(1, 1, 8, 8, dtype=torch.float64), b=b, h=h,
                    q_idx=q, kv_idx=k)


def assert_follows(fn, change):
    """Trace ``fn``, apply ``change()``, trace again: the result must be the new behaviour
    (a fresh trace's) and differ from the first."""
    TRACE_MEMO.clear()
    first = values_of(trace(fn))
    change()
    second = values_of(trace(fn))
    TRACE_MEMO.clear()
    fresh = values_of(trace(fn))
    assert torch.equal(second, fresh), "the memo returned the trace of the old state"
    assert not torch.equal(first, second), "the change should change the mod's values"
