"""Attention sinks and dropout compiled on the GPU: forward and gradients against the float64
reference (the interpreter tests in tests/kernels/test_sinks.py and test_dropout.py cover the
same code under TRITON_INTERPRET)."""
import pytest
import torch

import flexfa
from flexfa.blockmask import BlockMask
from flexfa.reference import attention_reference

pytestmark = pytest.mark.gpu


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sinks_and_dropout_match_the_reference(dtype):
    B, Hq, Hkv, L, E = 2, 8, 2, 1000, 128
    q = torch.randn(B, Hq, L, E, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(B, Hkv, L, E, device="cuda", dtype=dtype, requires_grad=True)
            for _ in range(2))
    sinks = torch.randn(Hq, device="cuda", requires_grad=True)
    mask = flexfa.create_block_mask(causal, None, None, L, L, device="cuda")
    out, lse = flexfa.flex_attention(q, k, v, block_mask=mask, enable_gqa=True, return_lse=True,
                                     sinks=sinks, dropout_p=0.2, dropout_seed=11)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, sinks), grad)
    keep = flexfa.dropout_mask(11, B, Hq, L, L, 0.2, device="cuda")
    inputs = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    want_out, want_lse = attention_reference(*inputs[:3], mask_mod=causal, enable_gqa=True,
                                             return_lse=True, sinks=inputs[3],
                                             dropout_mask=keep, dropout_p=0.2)
    want = torch.autograd.grad(want_out, inputs, grad.double())
    tolerance = 3e-2 if dtype == torch.bfloat16 else 5e-3
    torch.testing.assert_close(out.double(), want_out, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-3, rtol=1e-3)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        scale = w.abs().max().item()
        assert (g.double() - w).abs().max().item() <= 4 * tolerance * max(scale, 1.0), name


def _band(width):
    def band(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= width
    return band


@pytest.mark.parametrize("width,block,lengths", [(70, 32, (100, 130)), (70, 32, (130, 100)),
                                                 (140, 64, (200, 260)), (30, 24, (100, 130))])
def test_torchs_cropped_masks_listing_tiles_past_the_lengths(width, block, lengths):
    """A mask torch's ``_adjust`` cropped lists a kv tile past the new length (its kernels mask
    that tile's positions): flexfa runs it without that tile, on the GPU as in the interpreter
    (tests/blockmask/test_torch_compat.py): outputs and gradients equal the float64 reference
    of the mask_mod, at tiled blocks (32, 64) and a coarsened one (24)."""
    from torch.nn.attention import flex_attention as torch_flex
    L, S = lengths
    full = torch_flex.create_block_mask(_band(width), 1, 1, 512, 512, device="cuda",
                                        BLOCK_SIZE=block)
    cropped = full._adjust(L, S)
    listed = torch.arange(cropped.kv_indices.shape[-1], device="cuda") < \
        cropped.kv_num_blocks[..., None]
    assert int(cropped.kv_indices[listed].max()) >= -(-S // block)  # a tile past S is listed
    q, k, v = (torch.randn(2, 4, n, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for n in (L, S, S))
    # torch 2.13's _adjust keeps the new lengths, 2.11's the tiles' (128, 160 for 100, 130),
    # which flexfa refuses for inputs of other lengths: the tables with the lengths given
    mask = BlockMask.from_kv_blocks(cropped.kv_num_blocks, cropped.kv_indices,
                                    cropped.full_kv_num_blocks, cropped.full_kv_indices,
                                    BLOCK_SIZE=block, mask_mod=cropped.mask_mod,
                                    seq_lengths=lengths)
    out = flexfa.flex_attention(q, k, v, block_mask=mask)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want_out = attention_reference(*inputs, mask_mod=_band(width))
    want = torch.autograd.grad(want_out, inputs, grad.double())
    torch.testing.assert_close(out.double(), want_out, atol=3e-2, rtol=3e-2)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert (g.double() - w).abs().max().item() <= 0.12 * max(w.abs().max().item(), 1.0), name
