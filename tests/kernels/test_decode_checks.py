"""flex_decode's host side: every input check refuses before any kernel runs, and the decode
plan and workspace are keyed on what they bind (page-table width and strides, shapes, a
block mask's table contents). Each test here was a mutant of flexfa/decode.py,
runtime/decode_inputs.py or runtime/families/decode.py that the suite let through (the
forty-sixth session's mutation audit): removing the check or the key part gave garbage, a read
past the cache or a torch error instead of an InputError, or a stale plan's result."""
import pytest
import torch

import flexfa
from flexfa import mods
from flexfa.errors import InputError
from flexfa.reference import attention_reference
from flexfa.runtime.families.decode import DECODE

B, H, E, PAGE = 2, 2, 16, 16


def _qkv(B=B, Hq=H, Hkv=H, L=1, S=32, E=E, Ev=E):
    return torch.randn(B, Hq, L, E), torch.randn(B, Hkv, S, E), torch.randn(B, Hkv, S, Ev)


def _pages(num_pages=4, Hkv=H, E=E, value_pages=None):
    return (torch.randn(num_pages, PAGE, Hkv, E),
            torch.randn(value_pages or num_pages, PAGE, Hkv, E))


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


def _bad_calls():
    """name: (arguments of flex_decode, keyword arguments, message pattern)."""
    q, k, v = _qkv()
    q1 = q[:1]
    kc, vc = _pages()
    causal = mods.causal
    mask_64 = flexfa.create_block_mask(causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=16)
    mask_56 = flexfa.create_block_mask(causal, None, None, 1, 56, device="cpu", BLOCK_SIZE=16)
    k64, v64 = torch.randn(1, H, 64, E), torch.randn(1, H, 64, E)
    return {
        "kv_lens_2d": ((q, k, v), dict(kv_lens=_i32([[20, 0], [32, 0]])),
                       r"kv_lens must be int32 of shape \(2,\), got torch.int32 of shape "
                       r"\(2, 2\)"),
        "kv_lens_strided": ((q, k, v), dict(kv_lens=_i32([[20, 0], [32, 0]])[:, 0]),
                            "kv_lens must be contiguous, got stride 2"),
        "kv_lens_negative": ((q, k, v), dict(kv_lens=_i32([-5, 32])),
                             r"kv_lens\[0\] = -5 is outside the cache's 0..32 keys"),
        "q_offsets_int64": ((q, k, v), dict(q_offsets=torch.tensor([3, 20])),
                            r"q_offsets must be int32 of shape \(2,\), got torch.int64"),
        "q_offsets_2d": ((q, k, v), dict(q_offsets=_i32([[3, 0], [20, 0]])),
                         r"q_offsets must be int32 of shape \(2,\), got torch.int32 of shape "
                         r"\(2, 2\)"),
        "q_offsets_past_the_cache": ((q1[:, :, :1].expand(1, H, 2, E), k64, v64, None, mask_64),
                                     dict(q_offsets=_i32([63])),
                                     r"q_offsets\[0\] = 63 puts the 2 query rows at positions "
                                     r"past the sequence's 64 keys"),
        "no_rows": ((q[:, :, :0], k, v), {}, "query has 0 rows per head"),
        "heads_not_a_multiple": ((torch.randn(1, 3, 1, E), k[:1], v[:1]), {},
                                 "query has 3 heads but the cache has 2"),
        "key_head_dim": ((q, torch.randn(B, H, 32, 32), v), {},
                         "key has head_dim 32 but query has 16"),
        "value_shorter": ((q1, k64, torch.randn(1, H, 16, E)), {},
                          r"value has shape \(1, 2, 16, 16\) but key \(1, 2, 64, 16\)"),
        "mask_other_lengths": ((q1, k64, v64, None, mask_56), {},
                               r"block_mask was built for .*lengths=\(1, 56\).* needs .*"
                               r"lengths=\(1, 64\)"),
        "page_table_rows": ((q, kc, vc), dict(page_table=_i32([[0, 1]]), kv_lens=_i32([20, 20])),
                            r"page_table must be int32 of shape \(2, 2\), got torch.int32 of "
                            r"shape \(1, 2\)"),
        "page_table_1d": ((q1, kc, vc), dict(page_table=_i32([0, 1])),
                          r"page_table must be a 2-D int32 tensor \[B, max_pages\], got shape "
                          r"\(2,\)"),
        "value_pages": ((q1, kc, _pages(value_pages=2)[1]), dict(page_table=_i32([[3, 2]])),
                        r"value cache has shape \(2, 16, 2, 16\) but key cache "
                        r"\(4, 16, 2, 16\)"),
        "page_past_the_cache_without_lens": ((q1, kc, vc), dict(page_table=_i32([[0, 7]])),
                                             r"page_table\[0, 1\] = 7 is not a page of the "
                                             r"cache \(0..3\)"),
        "page_equal_to_num_pages": ((q1, kc, vc), dict(page_table=_i32([[0, 4]]),
                                                       kv_lens=_i32([32])),
                                    r"page_table\[0, 1\] = 4 is not a page of the cache"),
        "negative_page_in_use": ((q1, kc, vc), dict(page_table=_i32([[0, -1]]),
                                                    kv_lens=_i32([20])),
                                 r"page_table\[0, 1\] = -1 is not a page of the cache"),
        "other_backend": ((q, k, v), dict(kernel_options={"BACKEND": "AMPERE"}),
                          "flex_decode runs the decode family; kernel_options "
                          "BACKEND='AMPERE' names another"),
    }


@pytest.mark.parametrize("name", sorted(_bad_calls()))
def test_bad_input_is_an_input_error_before_launch(monkeypatch, name):
    args, kwargs, message = _bad_calls()[name]
    monkeypatch.setattr(DECODE, "first_call", lambda *a, **k: pytest.fail("launched"))
    monkeypatch.setattr(DECODE, "run", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(InputError, match=message):
        flexfa.flex_decode(*args, **kwargs)


def test_q_offsets_without_kv_lens_take_a_mask_of_the_cache_length():
    """With q_offsets and no kv_lens the block mask covers (S, S) (the positions of the
    whole cache), as documented; rows at an offset attend causally from there."""
    q, k, v = _qkv(B=1, L=2, S=64)
    mask = flexfa.create_block_mask(mods.causal, None, None, 64, 64, device="cpu",
                                    BLOCK_SIZE=16)
    out = flexfa.flex_decode(q, k, v, None, mask, q_offsets=_i32([30]))
    want = attention_reference(q, k, v, None, lambda b, h, i, j: j <= i + 30)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


def _paged_reference(q, k_cache, v_cache, table):
    """flex_decode's result over each sequence's listed pages, in float64."""
    outs = []
    for b in range(q.shape[0]):
        pages = table[b].long()
        k, v = (c[pages].reshape(1, -1, *c.shape[2:]).transpose(1, 2) for c in (k_cache, v_cache))
        outs.append(attention_reference(q[b:b + 1], k, v, None))
    return torch.cat(outs)


def test_a_narrower_page_table_gets_its_own_plan():
    """A page table of fewer columns with the same strides (a slice of a wider one): the
    plan binds S = max_pages * page_size, so reusing the wider table's read 32 keys past
    this call's (0.46 off)."""
    q = torch.randn(1, H, 1, E)
    kc, vc = _pages(8)
    table = _i32([[0, 1, 2, 3]])
    flexfa.flex_decode(q, kc, vc, page_table=table)
    out = flexfa.flex_decode(q, kc, vc, page_table=table[:, :2])
    torch.testing.assert_close(out.double(), _paged_reference(q, kc, vc, table[:, :2]),
                               atol=2e-5, rtol=2e-5)


def test_a_page_table_of_other_strides_gets_its_own_plan():
    """A page table of the same shape and another row stride (columns of a wider table):
    the plan binds the strides, so reusing the contiguous table's plan read other pages for
    the second sequence (1.64 off)."""
    q = torch.randn(2, H, 1, E)
    kc, vc = _pages(8)
    flexfa.flex_decode(q, kc, vc, page_table=_i32([[0, 1], [2, 3]]))
    wide = _i32([[4, 5, 0, 0], [6, 7, 0, 0]])
    out = flexfa.flex_decode(q, kc, vc, page_table=wide[:, :2])
    torch.testing.assert_close(out.double(), _paged_reference(q, kc, vc, wide[:, :2]),
                               atol=2e-5, rtol=2e-5)


def test_a_workspace_reused_by_another_shape_gets_new_buffers():
    """A DecodeWorkspace used by a call of another plan (batch and value head dim) returns
    that call's result, not the first plan's buffers."""
    workspace = flexfa.DecodeWorkspace()
    flexfa.flex_decode(*_qkv(), workspace=workspace)
    q, k, v = _qkv(B=1, Ev=32)
    out = flexfa.flex_decode(q, k, v, workspace=workspace)
    want = flexfa.flex_decode(q, k, v)
    assert out.shape == want.shape == (1, H, 1, 32)
    torch.testing.assert_close(out, want, atol=0, rtol=0)


def test_inference_tables_edited_in_place_are_read_again_by_the_union_walk():
    """Block-mask tables made under inference_mode have no version counter, so their
    contents cannot be proven unchanged: a GQA call taking the union walk (4 query heads
    per kv head) must not keep its union tables for the next call, which after an in-place
    edit of the counts gave the first mask's result (0.54 off)."""
    Hq, S = 4, 64
    with torch.inference_mode():
        q, k, v = torch.randn(1, Hq, 1, E), torch.randn(1, 1, S, E), torch.randn(1, 1, S, E)
        counts = torch.full((1, Hq, 1), 4, dtype=torch.int32)
        indices = torch.arange(4, dtype=torch.int32).expand(1, Hq, 1, 4).contiguous()
        mask = flexfa.BlockMask.from_kv_blocks(counts, indices, BLOCK_SIZE=16,
                                               seq_lengths=(1, S), compute_q_blocks=False)
        for edit in (None, [1, 2, 3, 4]):
            if edit is not None:
                counts[0, :, 0] = torch.tensor(edit, dtype=torch.int32)
            blocks = counts[0, :, 0].clone()
            out = flexfa.flex_decode(q, k, v, block_mask=mask)
            want = attention_reference(q, k, v, None,
                                       lambda b, h, i, j: j // 16 < blocks[h], enable_gqa=True)
            torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5,
                                       msg=lambda m: f"blocks {blocks.tolist()}: {m}")


def test_lse_after_a_call_without_it_on_the_same_plan():
    """A call without return_lse and then one with it on the same shapes: the second gets its
    own plan, whose lse is the reference's (the plan's key names return_lse; without it in
    the key the suite noticed only through a torch.compile test)."""
    q, k, v = _qkv(S=40)
    flexfa.flex_decode(q, k, v, kernel_options={"SPLIT_KV": 2})
    out, lse = flexfa.flex_decode(q, k, v, kernel_options={"SPLIT_KV": 2}, return_lse=True)
    want, want_lse = attention_reference(q, k, v, None, return_lse=True)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-5, rtol=2e-5)


def test_split_parts_of_every_split_are_combined():
    """With SPLIT_KV = 4 each split's partial rows land in their own slice of the parts
    buffer (one split fewer overran it: the suite saw only a heap-corruption abort): out and
    lse against the reference, at B * H * rows larger than one split's."""
    q, k, v = _qkv(B=3, Hq=4, Hkv=2, L=3, S=130)
    out, lse = flexfa.flex_decode(q, k, v, kernel_options={"SPLIT_KV": 4}, return_lse=True)
    want, want_lse = attention_reference(q, k, v, None, return_lse=True, enable_gqa=True)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-5, rtol=2e-5)
