"""flexfa's create_block_mask equals torch's, table for table, on the mask zoo."""
import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

import flexfa
from flexfa.blockmask import create_block_mask

from .zoo import ZOO

TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
          "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def assert_same_as_torch(mask_mod, B, H, L, S, block, **flags):
    ours = create_block_mask(mask_mod, B, H, L, S, device="cpu", BLOCK_SIZE=block, **flags)
    theirs = torch_create_block_mask(mask_mod, B, H, L, S, device="cpu", BLOCK_SIZE=block,
                                     **flags)
    for name in TABLES:
        mine, ref = getattr(ours, name), getattr(theirs, name)
        if ref is None:  # separate_full_blocks=False: no full tables
            assert mine is None, name
            continue
        assert mine.dtype == torch.int32 and mine.is_contiguous(), name
        assert torch.equal(mine, ref), f"{name} differs:\nflexfa {mine}\ntorch {ref}"
    assert ours.BLOCK_SIZE == theirs.BLOCK_SIZE and ours.seq_lengths == theirs.seq_lengths
    assert ours.mask_mod is mask_mod
    return ours


# (B, H, Q_LEN, KV_LEN, BLOCK_SIZE): lengths off tile multiples, L != S, pairs of block sizes
SHAPES = [
    (1, 1, 256, 256, 32),
    (2, 3, 232, 100, 16),
    (1, 2, 100, 232, (16, 64)),
    (2, 1, 200, 200, (64, 32)),
    (1, 1, 250, 250, 128),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:4])) + f"_bs{s[4]}")
@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_matches_torch(name, shape):
    B, H, L, S, block = shape
    assert_same_as_torch(ZOO[name](B, H, L, S), B, H, L, S, block)


@pytest.mark.parametrize("block", [16, 32, 64, 128, 256, (256, 16), (16, 256), (128, 64)])
def test_block_sizes(block):
    for name in ("causal", "document_causal", "natten_2d"):
        assert_same_as_torch(ZOO[name](1, 1, 240, 240), None, None, 240, 240, block)


def test_none_means_broadcast():
    mask = create_block_mask(flexfa.mods.causal, None, None, 100, 100, device="cpu",
                             BLOCK_SIZE=32)
    assert mask.kv_num_blocks.shape == (1, 1, 4)
    assert mask.kv_indices.shape == (1, 1, 4, 4)
    assert mask.q_indices.shape == (1, 1, 4, 4)


def test_batch_independent_mask_is_expanded_to_B_H():
    ours = assert_same_as_torch(flexfa.mods.causal, 3, 2, 64, 64, 16)
    assert ours.kv_indices.shape == (3, 2, 4, 4)


@pytest.mark.parametrize("name", ["document_long", "sliding_bidirectional", "natten_2d",
                                  "global_sliding", "dilated_window"])
def test_realistic_tiles(name):
    """128 x 128 tiles over 2000 tokens: the probes and the full evaluation at real tile sizes."""
    B, H, L, S = 1, 2, 2000, 1900
    assert_same_as_torch(ZOO[name](B, H, L, S), B, H, L, S, 128)


@pytest.mark.parametrize("name", ["causal", "document_causal", "natten_2d", "global_sliding"])
def test_without_separate_full_blocks(name):
    """separate_full_blocks=False: every non-empty block in the partial tables, no full tables,
    as torch builds it; torch's other flags are accepted and change nothing."""
    B, H, L, S = 2, 2, 300, 260
    mask_mod = ZOO[name](B, H, L, S)
    ours = assert_same_as_torch(mask_mod, B, H, L, S, 32, separate_full_blocks=False)
    assert ours.full_kv_num_blocks is None and ours.full_q_indices is None
    default = create_block_mask(mask_mod, B, H, L, S, device="cpu", BLOCK_SIZE=32)
    assert torch.equal(ours.to_dense(), default.to_dense())
    flagged = create_block_mask(mask_mod, B, H, L, S, device="cpu", BLOCK_SIZE=32,
                                _compile=True, compute_dq_write_order=True, dq_kv_order=False)
    for table in TABLES:
        assert torch.equal(getattr(flagged, table), getattr(default, table)), table


def test_nan_in_a_captured_tensor_is_not_clamped_away():
    """clamp(NaN, 0, 10) is NaN, so the comparison is False in the NaN column: those tiles are
    partial, not full (the interval of the clamp must not be [0, 10] there)."""
    weights = torch.ones(64)
    weights[5] = float("nan")

    def clamped(b, h, q_idx, kv_idx):
        return torch.clamp(weights[kv_idx] * q_idx.float(), 0.0, 10.0) > -1.0
    assert_same_as_torch(clamped, 1, 1, 64, 64, 16)


def test_torch_flags_must_be_bools():
    with pytest.raises(TypeError, match="separate_full_blocks must be a bool, got str"):
        create_block_mask(flexfa.mods.causal, None, None, 64, 64, device="cpu",
                          separate_full_blocks="no")
