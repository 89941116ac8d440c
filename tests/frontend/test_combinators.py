"""and_masks / or_masks / noop_mask: named, traceable, and correct on real tensors (also inside
torch's own create_block_mask)."""
import pytest
import torch
from hypothesis import given, settings

from flexfa import and_masks as exported_and
from flexfa.frontend import and_masks, dense_mask, evaluate, index_grids, noop_mask, or_masks, trace
from tests.strategies import mask_mods

B, H, L, S = 2, 3, 100, 232


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window_64(b, h, q_idx, kv_idx):
    return q_idx - kv_idx < 64


def even_heads(b, h, q_idx, kv_idx):
    return h % 2 == 0


def _direct(mod):
    return torch.as_tensor(mod(*index_grids(B, H, L, S))).expand(B, H, L, S)


def test_names_say_what_was_combined():
    assert and_masks(causal, sliding_window_64).__name__ == "and_masks(causal, sliding_window_64)"
    assert or_masks(causal, even_heads).__name__ == "or_masks(causal, even_heads)"
    nested = or_masks(and_masks(causal, sliding_window_64), even_heads)
    assert nested.__name__ == "or_masks(and_masks(causal, sliding_window_64), even_heads)"
    assert trace(nested).name == nested.__name__
    assert noop_mask.__name__ == "noop_mask" and exported_and is and_masks


def test_combined_masks_on_real_tensors():
    c, w, e = _direct(causal), _direct(sliding_window_64), _direct(even_heads)
    assert torch.equal(_direct(and_masks(causal, sliding_window_64)), c & w)
    assert torch.equal(_direct(or_masks(causal, sliding_window_64, even_heads)), c | w | e)
    noop = noop_mask(*index_grids(B, H, L, S))
    assert noop.dtype == torch.bool and noop.shape == () and bool(noop)
    assert torch.equal(_direct(and_masks()), torch.ones(B, H, L, S, dtype=torch.bool))
    assert torch.equal(_direct(or_masks()), torch.zeros(B, H, L, S, dtype=torch.bool))


def test_traced_combinations_simplify_to_plain_logic():
    assert trace(noop_mask).format() == "mask_mod noop_mask\nreturn True"
    assert trace(or_masks()).root.arg is False
    listing = trace(and_masks(causal, sliding_window_64)).format().splitlines()
    assert listing[1:] == ["%0: bool = le(kv_idx, q_idx)", "%1: int = sub(q_idx, kv_idx)",
                           "%2: bool = lt(%1, 64)", "%3: bool = and(%0, %2)", "return %3"]
    assert trace(and_masks(noop_mask, causal)).root is trace(causal).root


@given(mask_mods(B, H, L, S, max_depth=2), mask_mods(B, H, L, S, max_depth=2))
@settings(max_examples=6)
def test_random_combinations_trace_like_torch(first, second):
    for combined in (and_masks(first, second), or_masks(first, second, noop_mask)):
        assert torch.equal(dense_mask(trace(combined), B, H, L, S), _direct(combined))


def test_work_inside_torch_create_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    for mod in (noop_mask, and_masks(causal, sliding_window_64), or_masks(causal, even_heads)):
        block_mask = create_block_mask(mod, B, H, 256, 256, device="cpu", BLOCK_SIZE=128)
        dense = block_mask.to_dense()  # block-level: True where any element is kept
        expected = dense_mask(trace(mod), B, H, 256, 256).reshape(B, H, 2, 128, 2, 128)
        assert torch.equal(dense.bool(), expected.any(dim=(3, 5)))


def test_combined_mods_are_cached_and_keyed_like_others():
    combined = and_masks(causal, sliding_window_64)
    assert trace(combined) is trace(combined)
    assert trace(combined).key == trace(and_masks(causal, sliding_window_64)).key


def test_score_of_combined_masks_in_a_score_mod():
    keep = and_masks(causal, sliding_window_64)

    def masked_score(score, b, h, q_idx, kv_idx):
        return torch.where(keep(b, h, q_idx, kv_idx), score, -float("inf"))

    score = torch.randn(B, H, L, S)
    b, h, q, kv = index_grids(B, H, L, S)
    got = evaluate(trace(masked_score), score=score, b=b, h=h, q_idx=q, kv_idx=kv)
    assert torch.equal(got, masked_score(score, b, h, q, kv))


@pytest.mark.parametrize("combinator", [and_masks, or_masks])
def test_rejects_non_callables(combinator):
    with pytest.raises(TypeError, match=r"argument 0 must be a mask_mod \(a function\), got int"):
        combinator(1)
