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


@pytest.mark.parametrize("backend", ["AMPERE", "HOPPER", "GLUON", "DECODE", "FP8"])
def test_a_sink_of_plus_infinity_takes_its_heads_rows_on_the_gpu(backend):
    """Every forward that folds a sink in its epilogue gave NaN rows for a sink of +inf
    (exp2(inf - inf)); the limit is out 0 and lse +inf in that head, the other heads as
    without it (tests/kernels/test_sinks.py in the interpreter and the Gluon emulator)."""
    rows = 8 if backend == "DECODE" else 256
    q = torch.randn(1, 2, rows, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, 512, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    sinks = torch.tensor([float("inf"), 0.5], device="cuda")
    if backend == "FP8":
        x = flexfa.fp8.quantize(q, k, v)
        out, lse = flexfa.fp8.flex_attention_fp8(x, return_lse=True, sinks=sinks)
        _, plain = flexfa.fp8.flex_attention_fp8(x, return_lse=True)
    else:
        options = {"BACKEND": backend}
        out, lse = flexfa.flex_attention(q, k, v, return_lse=True, sinks=sinks,
                                         kernel_options=options)
        _, plain = flexfa.flex_attention(q, k, v, return_lse=True, kernel_options=options)
    assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0])), backend
    assert (lse[:, 0] == float("inf")).all(), backend
    torch.testing.assert_close(lse[:, 1], torch.logaddexp(plain[:, 1], sinks[1]))


def test_gradients_with_a_sink_of_plus_infinity_on_the_gpu():
    """The backward of a +inf sink's head gives the limit's gradients (those at a sink of 1e4,
    where exp(score - lse) is 0 in float32): nothing into q, k, v or a learnable bias from
    that head (dq and the bias gradient were NaN), d sink = the sum of its rows' dlse."""
    L, E = 300, 64
    q, k, v = (torch.randn(1, 2, L, E, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    bias = torch.randn(2, L, device="cuda", requires_grad=True)

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx]
    grad = torch.randn(1, 2, L, E, device="cuda", dtype=torch.bfloat16)
    results = []
    for sink in (float("inf"), 1e4):
        sinks = torch.tensor([sink, 0.5], device="cuda", requires_grad=True)
        out, lse = flexfa.flex_attention(q, k, v, biased, return_lse=True, sinks=sinks)
        results.append(torch.autograd.grad((out.float() * grad).sum() + lse.sum(),
                                           (q, k, v, sinks, bias)))
    for name, a, b in zip(("dq", "dk", "dv", "dsinks", "dbias"), *results):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2, msg=name)
    assert (results[0][0][:, 0] == 0).all() and (results[0][4][0] == 0).all()
