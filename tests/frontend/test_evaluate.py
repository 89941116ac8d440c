"""Random mods from tests/strategies.py: traced-then-evaluated equals calling the Python function
on broadcast torch tensors; the dense-mask path chunked by rows equals the unchunked one; and
the strategies keep their promises (indices in range, moderate finite values)."""
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexfa.frontend import dense_mask, evaluate, evaluate_node, index_grids, trace
from flexfa.frontend.ir import DType, Op
from tests.strategies import ALL_OPS, SMOOTH_OPS, mask_mods, score_mods

B, H, L, S = 2, 3, 37, 100
GRIDS = index_grids(B, H, L, S)


def _score(seed, bound=8.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, L, S, generator=gen) * 3).clamp(-bound, bound)


def _assert_same(got, direct):
    got, direct = got.expand(B, H, L, S), torch.as_tensor(direct).expand(B, H, L, S)
    if direct.dtype == torch.bool:
        assert got.dtype == torch.bool and torch.equal(got, direct)
        return
    direct = direct.to(got.dtype)
    assert torch.equal(got.isnan(), direct.isnan())
    assert torch.allclose(got, direct, rtol=1e-5, atol=1e-5, equal_nan=True), \
        (got - direct).abs().max()


@given(score_mods(B, H, L, S, ops=ALL_OPS), st.integers(0, 2**16))
@settings(max_examples=60)
def test_random_score_mods_trace_like_torch(mod, seed):
    score = _score(seed)
    b, h, q, kv = GRIDS
    traced = trace(mod)
    got = evaluate(traced, score=score, b=b, h=h, q_idx=q, kv_idx=kv)
    _assert_same(got, mod(score, b, h, q, kv))


@given(mask_mods(B, H, L, S, ops=ALL_OPS))
@settings(max_examples=60)
def test_random_mask_mods_trace_like_torch(mod):
    b, h, q, kv = GRIDS
    got = evaluate(trace(mod), b=b, h=h, q_idx=q, kv_idx=kv)
    _assert_same(got, mod(b, h, q, kv))


@given(mask_mods(B, H, L, S), st.sampled_from([1, 7, 16, 36, 37, 64]))
@settings(max_examples=20)
def test_dense_mask_chunked_by_rows_equals_unchunked(mod, rows):
    traced = trace(mod)
    whole = dense_mask(traced, B, H, L, S)
    assert torch.equal(dense_mask(traced, B, H, L, S, rows_per_chunk=rows), whole)
    b, h, q, kv = GRIDS
    assert torch.equal(whole, torch.as_tensor(mod(b, h, q, kv)).expand(B, H, L, S))


def _load_indices_in_range(traced):
    b, h, q, kv = GRIDS
    for node in traced.root.toposort():
        if node.op is not Op.LOAD:
            continue
        shape = traced.buffers[node.arg].shape
        for dim, index in enumerate(node.src):
            value = evaluate_node(index, score=_score(0), b=b, h=h, q_idx=q, kv_idx=kv,
                                  buffers=traced.buffers)
            assert 0 <= value.min() and value.max() < shape[dim], (dim, traced.format())


@given(score_mods(B, H, L, S, ops=ALL_OPS, max_depth=5), mask_mods(B, H, L, S, ops=ALL_OPS))
@settings(max_examples=25)
def test_strategies_index_captured_tensors_in_range(score_mod, mask_mod):
    _load_indices_in_range(trace(score_mod))
    _load_indices_in_range(trace(mask_mod))


@given(st.sampled_from(["smooth", "continuous"]).flatmap(
    lambda kind: score_mods(B, H, L, S, smooth=kind == "smooth", max_depth=5)),
    st.integers(0, 2**16))
@settings(max_examples=25)
def test_strategies_keep_scores_finite_and_moderate(mod, seed):
    out = mod(_score(seed), *GRIDS)
    assert torch.isfinite(out).all() and out.abs().max() <= 80.0, mod.source
    assert "score" in mod.source and mod.__name__.startswith("random_score_mod_")


@given(score_mods(B, H, L, S, smooth=True, max_depth=5))
@settings(max_examples=25)
def test_smooth_mods_use_only_smooth_ops(mod):
    ops = {node.op for node in trace(mod).root.toposort() if node.dtype is DType.FLOAT}
    assert not ops & {Op.ABS, Op.MAX, Op.MIN, Op.FLOOR, Op.CEIL, Op.SIGN}, mod.source
    assert SMOOTH_OPS < ALL_OPS


def test_mask_strategy_gives_empty_partial_and_full_tiles():
    """Across a few dozen drawn masks, 16x16 tiles of every kind turn up."""
    kinds = set()

    @given(mask_mods(B, H, L, S))
    @settings(max_examples=30, database=None)
    def collect(mod):
        mask = dense_mask(trace(mod), B, H, L, S)[..., :32, :96]
        tiles = mask.reshape(B, H, 2, 16, 6, 16).float().mean(dim=(3, 5))
        kinds.update({"empty" if t == 0 else "full" if t == 1 else "partial"
                       for t in tiles.flatten().tolist()})

    collect()
    assert kinds == {"empty", "partial", "full"}


@given(st.data())
@settings(max_examples=15)
def test_strategy_knobs(data):
    plain = data.draw(score_mods(B, H, L, S, max_buffers=0, ops={"add", "mul", "tanh"}))
    assert plain.captured == {} and trace(plain).buffers == ()
    assert plain.sizes == (B, H, L, S) and plain.__doc__ == plain.source
    learnable = data.draw(score_mods(B, H, L, S, grad_buffers=True, ops={"float_load", "add"},
                                     max_rank=1, max_depth=2))
    floats = [t for t in learnable.captured.values() if t.dtype.is_floating_point]
    assert all(t.requires_grad and t.dim() <= 1 for t in floats)
    mask = data.draw(mask_mods(B, H, L, S, max_depth=1, int_dtypes=(torch.int16,)))
    assert all(t.dtype in (torch.int16, torch.bool) or t.dtype.is_floating_point
               for t in mask.captured.values())


def test_half_powers_are_torchs_sqrt_and_rsqrt():
    """A tensor to the Python float 0.5 or -0.5 is sqrt / rsqrt in torch ((-inf) ** 0.5 is NaN,
    (-0.0) ** 0.5 is -0.0); the evaluator's constant exponent is a tensor, whose pow is not."""
    score = torch.tensor([-math.inf, -0.0, 0.0, -1.0, 4.0, math.inf, math.nan],
                         dtype=torch.float64)
    for exponent in (0.5, -0.5):
        def mod(s, b, h, q_idx, kv_idx):
            return s ** exponent
        got = evaluate_node(trace(mod).root, score=score, b=0, h=0, q_idx=0, kv_idx=0,
                            float_dtype=torch.float64)
        want = mod(score, 0, 0, 0, 0)
        assert torch.equal(torch.signbit(got), torch.signbit(want))
        torch.testing.assert_close(got, want, equal_nan=True, atol=0, rtol=0)
