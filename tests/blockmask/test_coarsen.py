"""Block sizes the kernels cannot tile (not multiples of 16: torch's (1, 64) for decoding, 24,
100) run through an equivalent coarser mask (flexfa.blockmask.coarsen): the same attention
element by element, a full block skipping the mask_mod and an empty one skipped, as in torch.
The reference is the float64 dense attention over the elements the block tables keep."""
from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch
from hypothesis import given, settings, strategies as st

import flexfa
from flexfa import mods
from flexfa.blockmask import BlockMask, create_block_mask
from flexfa.blockmask.coarsen import block_classes, runnable_block_mask
from flexfa.blockmask.tables import dense_to_ordered
from flexfa.frontend import dense_mask, trace
from kernels.backward_utils import check_backward
from kernels.forward_utils import check_forward, make_qkv

from .test_vs_torch import TABLES


def every_third(b, h, q_idx, kv_idx):
    return (q_idx + 2 * kv_idx + h) % 3 != 0


def random_mask(B, H, L, S, block, mask_mod, seed) -> BlockMask:
    """A mask of random empty / partial / full blocks (from_kv_blocks, as a user builds one)."""
    rows, cols = -(-L // block[0]), -(-S // block[1])
    classes = torch.randint(0, 3, (B, H, rows, cols), generator=torch.Generator().manual_seed(seed))
    return BlockMask.from_kv_blocks(*dense_to_ordered(classes == 1),
                                    *dense_to_ordered(classes == 2), BLOCK_SIZE=block,
                                    mask_mod=mask_mod, seq_lengths=(L, S))


def kept_by_tables(block_mask, B, H, L, S):
    """The element mask a block mask means: full blocks kept, partial ones where mask_mod
    keeps, empty ones not; as a mask_mod reading a captured [B, H, L, S] tensor."""
    block_q, block_kv = block_mask.BLOCK_SIZE
    classes = block_classes(block_mask, -(-L // block_q), -(-S // block_kv))
    classes = classes.expand(B, H, *classes.shape[2:])
    per_element = classes.repeat_interleave(block_q, 2).repeat_interleave(block_kv, 3)
    per_element = per_element[..., :L, :S]
    keep = (per_element == 2) | ((per_element == 1) & dense_mask(
        trace(block_mask.mask_mod), B, H, L, S))

    def kept(b, h, q_idx, kv_idx):
        return keep[b, h, q_idx, kv_idx]
    return kept


@settings(max_examples=8)
@given(block=st.tuples(st.sampled_from([1, 3, 8, 24, 40, 100]),
                       st.sampled_from([1, 5, 16, 24, 64, 100])),
       lengths=st.tuples(st.integers(1, 80), st.integers(1, 80)),
       mask_batch=st.sampled_from([1, 2]), seed=st.integers(0, 2 ** 16))
def test_odd_block_sizes_run_as_their_tables_say(block, lengths, mask_batch, seed):
    L, S = lengths
    mask = random_mask(mask_batch, 2, L, S, block, every_third, seed)
    q, k, v = make_qkv(2, 2, 2, L, S, 16, seed=seed)
    check_forward(q, k, v, None, kept_by_tables(mask, 2, 2, L, S), mask)


@pytest.mark.parametrize("block,L,S", [((1, 64), 1, 200), ((1, 16), 5, 70), (24, 60, 90)])
def test_masks_of_torch_and_flexfa_with_odd_blocks_match_torch(block, L, S):
    """create_block_mask with any block size (decoding's (1, 64), 24) in flexfa and in torch:
    the same tables, and flex_attention runs either with torch's result."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask
    from test_drop_in import torch_flex_attention
    ours = create_block_mask(mods.causal, 1, 1, L, S, device="cpu", BLOCK_SIZE=block)
    theirs = torch_create_block_mask(mods.causal, 1, 1, L, S, device="cpu", BLOCK_SIZE=block)
    assert torch.equal(ours.to_dense(), theirs.to_dense())
    q, k, v = make_qkv(1, 2, 2, L, S, 16)
    expected = torch_flex_attention(q, k, v, block_mask=theirs)
    for mask in (ours, theirs):
        torch.testing.assert_close(flexfa.flex_attention(q, k, v, block_mask=mask), expected,
                                   atol=1e-5, rtol=1e-5)


def test_odd_block_sizes_backward():
    """Gradients through the coarser mask: q, k, v and a captured score_mod tensor."""
    L, S = 50, 70
    mask = random_mask(1, 2, L, S, (24, 40), every_third, seed=5)
    q, k, v = make_qkv(1, 2, 2, L, S, 16, seed=1)
    bias = (0.5 * torch.randn(S)).requires_grad_()

    def key_bias(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]
    check_backward(q, k, v, key_bias, kept_by_tables(mask, 1, 2, L, S), mask, buffers=(bias,),
                   with_lse=True)


def test_coarse_mask_is_kept_and_follows_the_tables():
    """The coarser mask is built once per mask (reused while its tables and mask_mod stay),
    again after an in-place edit of a table or a new mask_mod, and goes with the mask."""
    mask = create_block_mask(mods.causal, 1, 1, 40, 40, device="cpu", BLOCK_SIZE=8)
    q = torch.randn(1, 1, 40, 16)
    flexfa.flex_attention(q, q, q, block_mask=mask)
    coarse = mask._flexfa_coarse[2]
    assert coarse.BLOCK_SIZE == (16, 16) and coarse.seq_lengths == (40, 40)
    flexfa.flex_attention(q, q, q, block_mask=mask)
    assert mask._flexfa_coarse[2] is coarse
    window = create_block_mask(mods.sliding_window(10), 1, 1, 40, 40, device="cpu",
                               BLOCK_SIZE=8)
    for name in TABLES:  # in place: the same table objects, new contents
        getattr(mask, name).copy_(getattr(window, name))
    edited = flexfa.flex_attention(q, q, q, block_mask=mask)
    assert mask._flexfa_coarse[2] is not coarse
    expected = check_forward(q, q, q, None, kept_by_tables(mask, 1, 1, 40, 40), mask)[0]
    torch.testing.assert_close(edited, expected)
    mask.mask_mod = mods.sliding_window(3)
    flexfa.flex_attention(q, q, q, block_mask=mask)
    assert mask._flexfa_coarse[1].name == "sliding_window_3"
    dropped = weakref.ref(mask._flexfa_coarse[2])
    del mask
    gc.collect()
    assert dropped() is None


def test_blocks_the_kernels_tile_are_used_as_they_are():
    for block in (16, 48, 96, 512):
        mask = create_block_mask(mods.causal, 1, 1, 100, 100, device="cpu", BLOCK_SIZE=block)
        assert runnable_block_mask(mask, mask.traced_mask) is mask


def test_a_tile_error_names_the_block_size_the_user_gave():
    """Regression: a kernel tile that does not divide a coarsened mask's blocks was reported
    with the coarse BLOCK_SIZE ((48, 48) for a mask built with 24), which the user never
    gave; the error names both now, in the forward's and the decode kernel's checks."""
    q, k, v = make_qkv(1, 1, 1, 64, 64, 16, seed=1)
    mask = create_block_mask(mods.causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=24)
    with pytest.raises(flexfa.InputError,
                       match=r"BLOCK_SIZE \(24, 24\) \(run as \(48, 48\).*BLOCK_N=32 does not fit"):
        flexfa.flex_attention(q, k, v, block_mask=mask, kernel_options={"BLOCK_N": 32})
    with pytest.raises(flexfa.InputError, match=r"BLOCK_SIZE \(24, 24\) \(run as \(48, 48\)"):
        flexfa.flex_decode(q[:, :, :1], k, v, block_mask=mask, kernel_options={"BLOCK_N": 32},
                           kv_lens=torch.tensor([64], dtype=torch.int32))
    tiled = create_block_mask(mods.causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    with pytest.raises(flexfa.InputError, match=r"has BLOCK_SIZE \(32, 32\); the kernel tile"):
        flexfa.flex_attention(q, k, v, block_mask=tiled, kernel_options={"BLOCK_N": 64})


@pytest.mark.parametrize("block, L, S", [((16, 2**31 - 1), 40, 75), (2**28 + 1, 40, 75),
                                         (100, 150, 70), ((24, 100), 40, 230)])
def test_a_block_whose_lcm_passes_the_length_runs_as_one_block(block, L, S):
    """Blocks whose lcm with 16 passes the length run as one block covering it (the same
    single block): an odd block near 2**28 had an lcm past int32, and flex_attention refused
    a BLOCK_SIZE the user never gave ((4294967312, ...))."""
    def window(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() < 9

    q, k, v = make_qkv(1, 1, 1, L, S, 16, seed=3)
    mask = create_block_mask(window, None, None, L, S, device="cpu", BLOCK_SIZE=block)
    check_forward(q, k, v, mask_mod=window, block_mask=mask)
    run = runnable_block_mask(mask, trace(window, "mask_mod"))
    assert all(int(b) % 16 == 0 and int(b) <= min(math.lcm(int(g), 16), -(-n // 16) * 16)
               for b, g, n in zip(run.BLOCK_SIZE, mask.BLOCK_SIZE, (L, S)))
