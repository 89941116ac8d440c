"""Drop-in behaviour torch's FlexAttention users rely on: key/value of batch 1 shared by a
query batch, the output's memory layout, torch's types importable from flexfa.

References: torch's own eager ``flex_attention`` on the CPU where it runs (forward only: it
has no CPU backward), the float64 reference (``tests/reference.py``) for gradients.
"""
from __future__ import annotations

import itertools
import warnings

import pytest
import torch
import torch.nn.attention.flex_attention as torch_flex
from hypothesis import given, strategies as st

import flexfa
from flexfa import mods
from flexfa.runtime.layout import output_like
from reference import assert_close_to_reference, reference_pair


def torch_flex_attention(*args, **kwargs):
    with warnings.catch_warnings():  # "called without torch.compile": expected here
        warnings.simplefilter("ignore")
        return torch_flex.flex_attention(*args, **kwargs)


def torch_block_mask(mask_mod, B, H, L, S, block=16):
    return torch_flex.create_block_mask(mask_mod, B, H, L, S, device="cpu", BLOCK_SIZE=block)


def inputs(B, Hq, Bkv, Hkv, L, S, E=16, Ev=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = ((B, Hq, L, E), (Bkv, Hkv, S, E), (Bkv, Hkv, S, Ev))
    return [torch.randn(s, generator=generator) for s in shapes]


def expand_batch(B, *tensors):
    return [t.expand(B, *t.shape[1:]) for t in tensors]


# ---- key/value batch broadcasting ---------------------------------------------------------

@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("mask_batch", [None, 1, 3], ids=["no_mask", "mask_b1", "mask_bq"])
def test_shared_kv_forward_matches_torch(Hq, Hkv, mask_batch):
    """key/value of batch 1, query of batch 3: torch runs this with a block mask of the query's
    batch, flexfa also with a mask of batch 1 or none (each compared with torch's call that
    runs: its mask of batch 3, or key/value expanded)."""
    B, L, S = 3, 40, 50
    q, k, v = inputs(B, Hq, 1, Hkv, L, S)
    mask_mod = mods.causal if mask_batch else None
    if mask_mod is None:
        expected, expected_lse = torch_flex_attention(q, *expand_batch(B, k, v), enable_gqa=True,
                                                      return_lse=True)
    else:
        expected, expected_lse = torch_flex_attention(
            q, k, v, block_mask=torch_block_mask(mask_mod, B, 1, L, S), enable_gqa=True,
            return_lse=True)
    block_mask = None if mask_mod is None else \
        flexfa.create_block_mask(mask_mod, mask_batch, 1, L, S, device="cpu", BLOCK_SIZE=16)
    out, lse = flexfa.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True,
                                     return_lse=True)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, expected_lse, atol=1e-5, rtol=1e-5)


def test_shared_kv_gradients_are_summed_over_the_batch():
    """Gradients of a shared key/value (and of a captured bias) are the sums over the query
    batch, as autograd gives them for the expanded tensors; out and lse both carry gradient;
    GQA; a block mask of batch 1."""
    B, Hq, Hkv, L, S = 3, 4, 2, 40, 50
    q, k, v = (t.requires_grad_() for t in inputs(B, Hq, 1, Hkv, L, S, seed=1))
    bias = (0.5 * torch.randn(S, generator=torch.Generator().manual_seed(2))).requires_grad_()

    def key_bias(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]
    generator = torch.Generator().manual_seed(3)
    grad_out, grad_lse = torch.randn(B, Hq, L, 16, generator=generator), \
        torch.randn(B, Hq, L, generator=generator)
    block_mask = flexfa.create_block_mask(mods.causal, 1, 1, L, S, device="cpu", BLOCK_SIZE=16)
    out, lse = flexfa.flex_attention(q, k, v, key_bias, block_mask, enable_gqa=True,
                                     return_lse=True)
    grads = torch.autograd.grad((out * grad_out).sum() + (lse * grad_lse).sum(), (q, k, v, bias))
    assert [tuple(g.shape) for g in grads[1:3]] == [(1, Hkv, S, 16)] * 2
    exact, eager = reference_pair(q, *expand_batch(B, k, v), key_bias, mods.causal,
                                  enable_gqa=True)
    assert_close_to_reference(out, exact[0], eager[0])
    expected = [torch.autograd.grad((ref[0] * grad_out).sum() + (ref[1] * grad_lse).sum(),
                                    (q, k, v, bias)) for ref in (exact, eager)]
    for name, grad, ref64, ref32 in zip("q k v bias".split(), grads, *expected):
        assert_close_to_reference(grad, ref64, ref32, name=f"d{name}")


@pytest.mark.parametrize("Bq,Bk,Bv,match", [
    (4, 2, 2, "key has batch size 2 but query has 4; key and value need the query's batch "
              "size, or 1"),
    (1, 3, 3, "key has batch size 3 but query has 1"),
    (3, 1, 3, "value has batch size 3 but key has 1"),
    (3, 3, 1, "value has batch size 1 but key has 3"),
])
def test_other_batch_mismatches_are_errors(Bq, Bk, Bv, match):
    q = torch.randn(Bq, 2, 16, 16)
    k, v = torch.randn(Bk, 2, 16, 16), torch.randn(Bv, 2, 16, 16)
    with pytest.raises(flexfa.InputError, match=match):
        flexfa.flex_attention(q, k, v)


def test_shared_kv_is_read_in_place_through_strided_descriptors():
    """The shared key/value reach the kernels expanded (batch stride 0, no copy): they are no
    [B * H * len, dim] matrix (the flat descriptor layout), but the Hopper family's strided
    layout reads them in place (every batch at the same rows), as the default family does,
    with torch's result."""
    from flexfa.runtime.families.hopper import descriptor_layout_ok, strided_ok
    q, k, v = (t.half() for t in inputs(3, 2, 1, 2, 64, 64))
    shared_k, shared_v = expand_batch(3, k, v)
    assert shared_k.stride(0) == 0 and descriptor_layout_ok(q, q, q)
    assert not descriptor_layout_ok(q, shared_k, shared_v) and strided_ok(q, shared_k, shared_v)
    expected = torch_flex_attention(q.float(), *expand_batch(3, k.float(), v.float()))
    for options in (None, {"BACKEND": "HOPPER"}):
        torch.testing.assert_close(flexfa.flex_attention(q, k, v, kernel_options=options).float(),
                                   expected, atol=2e-3, rtol=2e-3)


def test_torchs_paged_attention_workflow():
    """torch's PagedAttention helper: one batch-1 key/value cache for every sequence, a mask
    converted to physical pages (-1 past each row's count where pages are not reserved), the
    query batch of the sequences: flexfa gives torch's result."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    B, H, E, page, pages, L = 3, 2, 16, 16, 12, 64
    lengths = [40, 23, 64]
    paged = PagedAttention(pages, page, B, device="cpu")
    k_cache, v_cache = torch.zeros(2, 1, H, pages * page, E).unbind()
    generator = torch.Generator().manual_seed(4)
    for b, length in enumerate(lengths):
        paged.reserve(torch.tensor([b]), torch.tensor(length))
        k, v = torch.randn(2, 1, H, length, E, generator=generator).unbind()
        paged.assign(torch.tensor([b]), torch.arange(length)[None], k, v, k_cache, v_cache)
    kv_lengths = torch.tensor(lengths)

    def causal_in_sequence(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (kv_idx < kv_lengths[b])
    logical = flexfa.create_block_mask(causal_in_sequence, B, 1, L, L, device="cpu",
                                       BLOCK_SIZE=page)
    physical = paged.convert_logical_block_mask(logical, kv_len=kv_lengths)
    assert bool((physical.kv_indices == -1).any())
    q = torch.randn(B, H, L, E, generator=generator)
    torch.testing.assert_close(flexfa.flex_attention(q, k_cache, v_cache, block_mask=physical),
                               torch_flex_attention(q, k_cache, v_cache, block_mask=physical),
                               atol=1e-5, rtol=1e-5)


# ---- output layout ------------------------------------------------------------------------

def permuted(shape, order, seed=0):
    """A tensor of ``shape`` whose memory holds its dims in ``order`` (outermost first)."""
    base = torch.randn([shape[d] for d in order], generator=torch.Generator().manual_seed(seed))
    return base.permute([order.index(d) for d in range(len(shape))])


@given(order=st.permutations(range(4)), sizes=st.tuples(*[st.sampled_from([1, 2, 3])] * 2),
       lengths=st.tuples(st.sampled_from([1, 5, 8]), st.sampled_from([4, 8])),
       head_dim_v=st.sampled_from([1, 4, 8]))
def test_output_like_has_torchs_strides(order, sizes, lengths, head_dim_v):
    """``output_like`` gives the strides torch's flex_attention gives its output, for every
    memory order of the query (size-1 dims included)."""
    B, H = sizes
    L, E = lengths
    q = permuted((B, H, L, E), order)
    k, v = torch.randn(B, H, 6, E), torch.randn(B, H, 6, head_dim_v)
    expected = torch_flex_attention(q, k, v)
    out = output_like(q, head_dim_v)
    assert out.shape == expected.shape and out.stride() == expected.stride()
    assert out.dtype == q.dtype and out.device == q.device


def test_output_like_examples():
    """A few orders written out: [B, L, H, E] memory (q from x.transpose(1, 2)) gives an
    output whose transpose is a [B, L, H * Ev] view; the last dim is always innermost; a
    contiguous query gives a contiguous output; dtype and device can be given."""
    B, H, L, E, Ev = 2, 3, 5, 8, 4
    q = torch.randn(B, L, H, E).transpose(1, 2)
    out = output_like(q, Ev)
    assert out.stride() == (L * H * Ev, Ev, H * Ev, 1)
    assert out.transpose(1, 2).view(B, L, H * Ev).data_ptr() == out.data_ptr()
    head_last = torch.randn(B, E, L, H).permute(0, 3, 2, 1)  # E outermost in memory
    assert output_like(head_last, Ev).stride() == (L * H * Ev, Ev, H * Ev, 1)
    assert output_like(torch.randn(B, H, L, E), Ev).is_contiguous()
    assert output_like(q, Ev, dtype=torch.bfloat16).dtype == torch.bfloat16
    actual = torch_flex_attention(q, *torch.randn(2, B, H, 7, E).unbind())
    assert actual.stride() == (L * H * E, E, H * E, 1)  # torch's, for this Ev = E


# ---- exports ------------------------------------------------------------------------------

def test_torch_types_import_from_flexfa():
    assert flexfa.AuxRequest is torch_flex.AuxRequest
    assert flexfa.AuxOutput is torch_flex.AuxOutput
    assert flexfa.FlexKernelOptions is torch_flex.FlexKernelOptions
    for name in ("AuxRequest", "AuxOutput", "FlexKernelOptions"):
        assert name in flexfa.__all__
    q = torch.randn(1, 1, 16, 16)
    out, aux = flexfa.flex_attention(q, q, q, return_aux=flexfa.AuxRequest(lse=True))
    assert isinstance(aux, flexfa.AuxOutput) and aux.lse.shape == (1, 1, 16)
    assert aux.max_scores is None and out.shape == q.shape


def test_flexfa_block_mask_is_a_torch_block_mask():
    """Code that checks ``isinstance(mask, torch's BlockMask)`` (Hugging Face-style) accepts
    flexfa's masks."""
    mask = flexfa.create_block_mask(mods.causal, 1, 1, 32, 32, device="cpu", BLOCK_SIZE=16)
    assert isinstance(mask, torch_flex.BlockMask)
    assert isinstance(mask[0], torch_flex.BlockMask) and isinstance(mask.to("cpu"),
                                                                     torch_flex.BlockMask)


ORDERS = [(0, 1, 2, 3), (0, 2, 1, 3), (0, 1, 3, 2), (2, 0, 1, 3), (3, 2, 1, 0), (1, 3, 0, 2)]


@pytest.mark.parametrize("order", ORDERS)
def test_permuted_inputs_give_torchs_numbers(order):
    B, H, L, E = 2, 2, 8, 16
    q, k, v = (permuted((B, H, L, E), list(order), seed) for seed in range(3))
    torch.testing.assert_close(flexfa.flex_attention(q, k, v), torch_flex_attention(q, k, v),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("order", ORDERS[3:] + [(0, 2, 1, 3)])  # torch's out is not contiguous
def test_output_has_the_querys_memory_order(order):
    """flex_attention's output has torch's strides (the query's dimension order)."""
    B, H, L, E = 2, 2, 8, 16
    q = permuted((B, H, L, E), list(order))
    k, v = torch.randn(B, H, 8, E), torch.randn(B, H, 8, 8)
    assert flexfa.flex_attention(q, k, v).stride() == torch_flex_attention(q, k, v).stride()
