"""Attention sinks in the decode family (flex_decode(sinks=) and flex_attention's decode
calls) under the interpreter against the float64 reference: GQA ratios 1 and 4, 1 and 3 rows,
1 and 3 splits (the sink in the epilogue, or added once by the combine kernel), a fully masked
row (out 0, lse = its sink), contiguous and paged caches."""
import pytest
import torch

import flexfa
from flexfa.errors import InputError, InputTypeError
from flexfa.reference import attention_reference
from forward_utils import make_qkv



def even_heads_skip_row_0(b, h, q_idx, kv_idx):
    """Row 0 of every even head keeps no key (with L = 1 those heads are fully masked)."""
    return (h % 2 == 1) | (q_idx > 0)


def paged(t, page):
    """[B, Hkv, S, E] as a paged cache [B * S / page, page, Hkv, E] (pages in reverse order)
    and its page table."""
    B, Hkv, S, E = t.shape
    per_seq = S // page
    order = torch.arange(B * per_seq).flip(0)
    cache = torch.empty(B * per_seq, page, Hkv, E, dtype=t.dtype)
    cache[order] = t.view(B, Hkv, per_seq, page, E).permute(0, 2, 3, 1, 4).reshape(
        -1, page, Hkv, E)
    return cache, order.view(B, per_seq).to(torch.int32)


# (G, L, splits, paged)
CASES = [(1, 1, 1, False), (4, 3, 3, True), (4, 1, 3, False), (1, 3, 1, True)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "g{}_l{}_s{}_{}".format(
    *c[:3], "paged" if c[3] else "contig"))
def test_decode_sinks_match_reference(case, launched):
    G, L, splits, is_paged = case
    B, Hkv, S, E = 2, 2, 128, 16
    Hq = G * Hkv
    q, k, v = make_qkv(B, Hq, Hkv, L, S, E, seed=G * 10 + L)
    sinks = torch.linspace(-1.0, 2.0, Hq)
    mask = flexfa.create_block_mask(even_heads_skip_row_0, None, Hq, L, S, device="cpu",
                                    BLOCK_SIZE=32)
    kk, vv, table = k, v, None
    if is_paged:
        (kk, table), (vv, _) = paged(k, 32), paged(v, 32)
    out, lse = flexfa.flex_decode(q, kk, vv, None, mask, page_table=table, sinks=sinks,
                                  return_lse=True, kernel_options={"SPLIT_KV": splits})
    assert launched == [("decode", splits)]
    ref_out, ref_lse = attention_reference(q, k, v, mask_mod=even_heads_skip_row_0,
                                           enable_gqa=G > 1, sinks=sinks, return_lse=True)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=2e-5)
    # the fully masked rows: out 0 and lse = the head's sink
    assert torch.equal(out[:, 0::2, 0], torch.zeros_like(out[:, 0::2, 0]))
    torch.testing.assert_close(lse[:, 0::2, 0], sinks[0::2].expand(B, -1))


def test_sinks_of_minus_inf_change_nothing():
    """A sink of -inf leaves out and lse as without sinks (splits: the combine kernel)."""
    q, k, v = make_qkv(1, 4, 1, 2, 96, 16, seed=5)
    options = {"SPLIT_KV": 3}
    want = flexfa.flex_decode(q, k, v, return_lse=True, kernel_options=options)
    got = flexfa.flex_decode(q, k, v, return_lse=True, kernel_options=options,
                             sinks=torch.full((4,), float("-inf")))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_gradients_through_decode_plans_with_sinks(launched):
    """flex_attention with sinks and L <= 16 runs the decode family forward (with splits);
    the backward reads its lse: q, k, v and sinks gradients match the reference's."""
    q, k, v = make_qkv(1, 4, 2, 2, 64, 16, seed=9)
    sinks = torch.tensor([0.5, -1.0, 1.5, 0.0])
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out = flexfa.flex_attention(*leaves[:3], sinks=leaves[3], enable_gqa=True,
                                kernel_options={"SPLIT_KV": 2})
    assert launched[0] == ("decode", 2)
    grad = torch.randn_like(out)
    out.backward(grad)
    refs = [t.double().requires_grad_() for t in (q, k, v, sinks)]
    ref = attention_reference(*refs[:3], enable_gqa=True, sinks=refs[3])
    ref.backward(grad.double())
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    for got, want in zip(leaves, refs):
        torch.testing.assert_close(got.grad.double(), want.grad, atol=1e-4, rtol=1e-4)


def test_bad_sinks_fail_before_launch():
    q, k, v = make_qkv(1, 4, 2, 1, 32, 16)
    with pytest.raises(InputError, match=r"sinks has shape \(2,\) but query has 4 heads"):
        flexfa.flex_decode(q, k, v, sinks=torch.zeros(2))
    with pytest.raises(InputTypeError, match="sinks has dtype torch.float64"):
        flexfa.flex_decode(q, k, v, sinks=torch.zeros(4, dtype=torch.float64))
    with pytest.raises(InputTypeError, match="sinks must be a torch.Tensor"):
        flexfa.flex_decode(q, k, v, sinks=[0.0] * 4)
