"""flex_attention_fp8 takes what flex_attention takes (issue 23): key and value of batch 1
shared by the query's batch, and block masks whose blocks the kernels cannot tile (torch's
decoding masks with BLOCK_SIZE (1, 64)) through an equal coarser mask."""
import pytest
import torch

import flexfa
from flexfa import fp8


def _qkv(B, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(B, 2, 64, 64, generator=generator).to(torch.bfloat16) for _ in range(3)]


def test_batch_one_keys_are_shared_by_the_query_batch():
    q, _, _ = _qkv(3)
    _, k, v = _qkv(1, seed=1)
    shared = fp8.flex_attention_fp8(q, k, v)
    expanded = fp8.flex_attention_fp8(q, k.expand(3, -1, -1, -1).contiguous(),
                                      v.expand(3, -1, -1, -1).contiguous())
    assert torch.equal(shared, expanded)
    reference = flexfa.flex_attention(q.float(), k.float(), v.float()).to(shared.dtype)
    torch.testing.assert_close(shared, reference, atol=0.1, rtol=0.1)


def test_quantize_shares_batch_one_keys_as_flex_attention_fp8_does():
    """quantize accepts key and value of batch 1 (its shape check is flex_attention's): its
    FP8Inputs then holds them per query batch entry, which flex_attention_fp8 runs (its
    k_scale check refused them before)."""
    q, _, _ = _qkv(3)
    _, k, v = _qkv(1, seed=1)
    staged = fp8.flex_attention_fp8(fp8.quantize(q, k, v))
    assert torch.equal(staged, fp8.flex_attention_fp8(q, k, v))
    # the fused quantize kernel (the default on CUDA) reads the shared batch through stride 0
    expanded = [x.expand(3, -1, -1, -1).contiguous() for x in (k, v)]
    fused, copied = (fp8.quantize(q, *kv, fused=True) for kv in ((k, v), expanded))
    for name in ("q", "k", "v", "q_scale", "k_scale", "v_scale"):
        assert torch.equal(getattr(fused, name).float(), getattr(copied, name).float()), name


def test_a_key_batch_that_is_neither_one_nor_the_querys_is_named():
    q, _, _ = _qkv(3)
    _, k, v = _qkv(2)
    with pytest.raises(ValueError, match="key"):
        fp8.flex_attention_fp8(q, k, v)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def test_a_mask_of_untileable_blocks_runs_as_its_coarser_equal():
    q, k, v = _qkv(1)
    fine = flexfa.create_block_mask(causal, 1, None, 64, 64, device="cpu", BLOCK_SIZE=(1, 64))
    tileable = flexfa.create_block_mask(causal, 1, None, 64, 64, device="cpu")
    out = fp8.flex_attention_fp8(q, k, v, block_mask=fine)
    torch.testing.assert_close(out, fp8.flex_attention_fp8(q, k, v, block_mask=tileable),
                               atol=0, rtol=0)


def test_key_of_batch_one_with_a_full_batch_value_is_an_error():
    """Only a key and value both of batch 1 are shared (flex_attention's rule)."""
    q, _, v = _qkv(3)
    _, k, _ = _qkv(1)
    with pytest.raises(ValueError, match="value has batch size 3 but key has 1"):
        fp8.flex_attention_fp8(q, k, v)
