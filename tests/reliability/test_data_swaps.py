"""``t.data = other`` gives a tensor other memory without moving its version counter (torch
leaves it to the caller). Every flexfa cache of what it derived from a tensor's values keys
on the tensor's memory address as well (``flexfa.memo.contents_keys``), so such a swap is seen as an
edit: block-mask tables are checked again, captured index tensors' reads are checked again,
quantize's descales lose their "as written" standing, a paged cache reads its lengths back,
and a trace that read a captured tensor's value is made again (tests/frontend/
test_guard_edges.py). Before, each of these kept what it knew of the old memory."""
import dataclasses

import pytest
import torch

import flexfa
from flexfa.errors import InputError
from flexfa.fp8 import flex_attention_fp8, quantize
from flexfa.memo import contents_key, memory_of


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _qkv(L=32, S=32, E=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 1, n, E, generator=g) for n in (L, S, S)]


def test_contents_key_tells_a_data_swap_an_edit_and_a_view():
    t = torch.zeros(8)
    key, held = contents_key(t), memory_of(t)
    assert contents_key(t) == key
    t.data = torch.zeros(8)  # same values, other memory
    assert contents_key(t) != key
    key = contents_key(t)
    t.data = t.data[2:]  # same storage, another view of it at another address
    assert contents_key(t) != key
    key = contents_key(t)
    t.add_(1)
    assert contents_key(t) != key
    assert held is not None and held.data_ptr() != t.data_ptr()
    with torch.inference_mode():
        assert contents_key(torch.zeros(2)) is None


def test_block_mask_tables_given_other_memory_are_checked_again():
    q, k, v = _qkv()
    mask = flexfa.create_block_mask(_causal, 1, 1, 32, 32, BLOCK_SIZE=16, device="cpu")
    flexfa.flex_attention(q, k, v, block_mask=mask)  # checked once, remembered
    bad = mask.kv_indices.clone()
    bad[0, 0, 0, 0] = 99  # a kv tile past S
    mask.kv_indices.data = bad
    with pytest.raises(InputError, match="kv_indices"):
        flexfa.flex_attention(q, k, v, block_mask=mask)


def test_a_captured_index_tensor_given_other_memory_is_checked_again():
    q, k, v = _qkv()
    bias = torch.randn(8)
    slot = torch.arange(32) % 8

    def mod(score, b, h, q_idx, kv_idx):
        return score + bias[slot[kv_idx]]
    flexfa.flex_attention(q, k, v, score_mod=mod)  # its reads checked once, remembered
    slot.data = torch.full((32,), 40)  # same shape and dtype: the same trace, reads past bias
    with pytest.raises(InputError, match="at indices 40..40"):
        flexfa.flex_attention(q, k, v, score_mod=mod)


def test_quantized_descales_given_other_memory_are_checked_again():
    q, k, v = (x.to(torch.bfloat16) for x in _qkv(L=64, S=64, E=32))
    x = quantize(q, k, v, block_size=32)
    assert x.positive_scales and x.scales_as_written()
    zeros = x.k_scale.clone()
    zeros[0, 0, 0] = 0.0
    x.k_scale.data = zeros
    assert not x.scales_as_written()
    with pytest.raises(InputError, match="positive_scales is True but k_scale holds"):
        flex_attention_fp8(dataclasses.replace(x))


def test_a_paged_cache_reads_lengths_given_other_memory_back():
    cache = flexfa.PagedKVCache(num_pages=4, page_size=16, max_batch_size=2, num_kv_heads=1,
                                head_dim=16, device="cpu")
    cache.reserve(0, 32)
    cache.set_length(0, 20)
    assert cache.length(0) == 20
    cache.kv_lens.data = torch.tensor([7, 0], dtype=torch.int32)
    assert cache.length(0) == 7
