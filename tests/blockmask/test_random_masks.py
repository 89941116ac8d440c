"""hypothesis: random mask IRs, sizes and block sizes; flexfa's tables equal the tables
derived from the dense mask (the mod called on real index tensors, L x S, small sizes)."""
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch.nn.attention.flex_attention import _dense_to_ordered

from flexfa.blockmask import create_block_mask
from tests.strategies import ALL_OPS, mask_mods


def reference_tables(mask_mod, B, H, L, S, q_block, kv_block):
    """(partial, full) 0/1 tile grids from the dense mask, padding counted as masked."""
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    q = torch.arange(L).view(1, 1, L, 1)
    kv = torch.arange(S).view(1, 1, 1, S)
    dense = torch.as_tensor(mask_mod(b, h, q, kv)).expand(B, H, L, S)
    dense = F.pad(dense, (0, -S % kv_block, 0, -L % q_block))
    tiles = dense.reshape(B, H, dense.shape[2] // q_block, q_block, -1, kv_block)
    kept = tiles.sum((3, 5))
    full = kept == q_block * kv_block
    return (kept > 0) & ~full, full


def assert_tables_match_dense(mask_mod, B, H, L, S, q_block, kv_block):
    ours = create_block_mask(mask_mod, B, H, L, S, device="cpu", BLOCK_SIZE=(q_block, kv_block))
    partial, full = reference_tables(mask_mod, B, H, L, S, q_block, kv_block)
    expected = {"kv": partial, "full_kv": full, "q": partial.transpose(-2, -1),
                "full_q": full.transpose(-2, -1)}
    for prefix, dense in expected.items():
        num_blocks, indices = _dense_to_ordered(dense)
        assert torch.equal(getattr(ours, f"{prefix}_num_blocks"), num_blocks), prefix
        assert torch.equal(getattr(ours, f"{prefix}_indices"), indices), prefix


block_sizes = st.sampled_from([16, 32, 64])


@settings(max_examples=40)
@given(st.data(), st.integers(1, 2), st.integers(1, 3), st.integers(1, 200),
       st.integers(1, 200), block_sizes, block_sizes)
def test_random_masks_match_dense(data, B, H, L, S, q_block, kv_block):
    mask_mod = data.draw(mask_mods(B, H, L, S, ops=ALL_OPS))
    assert_tables_match_dense(mask_mod, B, H, L, S, q_block, kv_block)


@settings(max_examples=10)
@given(st.data(), st.sampled_from([(100, 232), (232, 100), (256, 256)]))
def test_random_masks_match_dense_at_larger_sizes(data, lengths):
    L, S = lengths
    mask_mod = data.draw(mask_mods(2, 2, L, S, ops=ALL_OPS))
    assert_tables_match_dense(mask_mod, 2, 2, L, S, 32, 16)
