"""hypothesis: random mask IRs, lengths and block sizes; flexfa's tables equal the tables
derived from the dense mask (the mod called on real index tensors, L x S, small sizes)."""
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch.nn.attention.flex_attention import _dense_to_ordered

from flexfa.blockmask import create_block_mask

from .random_masks import mask_mods


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


block_sizes = st.sampled_from([16, 32, 64])
lengths = st.integers(1, 200)


@settings(max_examples=40)
@given(mask_mods(), st.integers(1, 2), st.integers(1, 3), lengths, lengths, block_sizes,
       block_sizes)
def test_random_masks_match_dense(mask_mod, B, H, L, S, q_block, kv_block):
    ours = create_block_mask(mask_mod, B, H, L, S, device="cpu", BLOCK_SIZE=(q_block, kv_block))
    partial, full = reference_tables(mask_mod, B, H, L, S, q_block, kv_block)
    for (num_blocks, indices), expected in (
            ((ours.kv_num_blocks, ours.kv_indices), partial),
            ((ours.full_kv_num_blocks, ours.full_kv_indices), full)):
        ref_num, ref_indices = _dense_to_ordered(expected)
        assert torch.equal(num_blocks, ref_num)
        assert torch.equal(indices, ref_indices)
    ref_q = _dense_to_ordered(full.transpose(-2, -1))
    assert torch.equal(ours.full_q_num_blocks, ref_q[0])
    assert torch.equal(ours.full_q_indices, ref_q[1])
