"""The decode family (``flexfa.runtime.families.decode``) and ``flexfa.flex_decode`` under the
interpreter against the float64 reference: GQA ratios 1, 3, 4, 5, 8 (the group's heads x rows
packed into one tile), L in {1, 3, 16}, splits 1..8, block masks per head and across q blocks
(the union walk and the per-member walk), per-sequence lengths and query offsets, paged
caches, fully masked rows, autograd through the family, bad inputs, and a call with a
workspace that allocates and synchronises nothing."""
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flexfa
from flexfa import mods
from flexfa.errors import InputError
from flexfa.reference import attention_reference
from flexfa.runtime import plans, registry
from flexfa.runtime.call import AttentionCall
from flexfa.runtime.families import decode
from flexfa.runtime.families.ampere import AMPERE
from flexfa.runtime.families.decode import DECODE
from flexfa.runtime.options import parse_kernel_options
from flexfa.runtime.target import INTERPRETER, Target
from backward_utils import check_backward
from forward_utils import check_forward, dense_block_mask, kept_plans, make_qkv
from specialization import specialization_spy
from strategies import mask_mods, score_mods



def shifted(mask_mod, lengths, L):
    """``mask_mod`` of sequence b's rows at positions lengths[b] - L + i (the reference sees
    rows from 0)."""
    def at_positions(b, h, q_idx, kv_idx):
        return mask_mod(b, h, q_idx + lengths[b] - L, kv_idx) & (kv_idx < lengths[b])
    return at_positions


def reference_rows(q, k, v, score_mod, mask_mod, lengths, offsets):
    """(out, lse) of each sequence b with keys 0..lengths[b]-1 and rows at offsets[b] + i.
    The mods see batch index b as the index tensor bb + b (bb is 0 for the one sequence
    sliced out), not as a Python int: a mod may call tensor methods on it."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        n, o = int(lengths[b]), int(offsets[b])

        def score(s, bb, h, qi, ki, o=o, b=b):
            return s if score_mod is None else score_mod(s, bb + b, h, qi + o, ki)

        def mask(bb, h, qi, ki, o=o, b=b):
            return mask_mod(bb + b, h, qi + o, ki) if mask_mod is not None else ki >= 0
        out, lse = attention_reference(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], score,
                                       mask, enable_gqa=True, return_lse=True)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def assert_matches(out, lse, ref_out, ref_lse, atol=2e-5):
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], atol=atol, rtol=atol)
    torch.testing.assert_close(out.double(), ref_out.double(), atol=atol, rtol=atol)


# (Hq, Hkv, L): GQA ratios 1, 3, 4, 5, 8 and rows 1, 3, 16 (8 x 16 = 128 packed rows)
SHAPES = [(2, 2, 16), (6, 2, 3), (4, 1, 1), (5, 1, 3), (10, 2, 16), (8, 1, 16)]
MODS = [(mods.softcap(5.0), mods.causal), (mods.alibi(10), mods.sliding_window(40)),
        (None, None)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"hq{s[0]}_hkv{s[1]}_l{s[2]}")
def test_gqa_groups_are_packed(shape, launched):
    """flex_attention takes the decode family for L <= 16; any group size, a mod of
    flexfa.mods each, bf16 where the rows are few."""
    Hq, Hkv, L = shape
    index = SHAPES.index(shape)
    score_mod, mask_mod = MODS[index % len(MODS)]
    S = 150 + 37 * index
    dtype = torch.bfloat16 if index % 2 else torch.float32
    q, k, v = make_qkv(1 + index % 2, Hq, Hkv, L, S, 32, dtype=dtype, seed=index)
    block_mask = flexfa.create_block_mask(mask_mod, None, None, L, S, device="cpu",
                                          BLOCK_SIZE=32) if mask_mod is not None else None
    check_forward(q, k, v, score_mod, mask_mod, block_mask, enable_gqa=Hq != Hkv)
    assert launched and launched[0][0] == "decode"


@pytest.mark.parametrize("splits", range(1, 9))
def test_split_counts(splits, launched):
    """SPLIT_KV = n gives n splits over the live blocks, combined by one kernel: a window
    mask (splits that see no keys of a row) with a row that keeps nothing."""
    def tail_window(b, h, q_idx, kv_idx):
        pos = q_idx + 280
        return (kv_idx <= pos) & (kv_idx > pos - 150) & (q_idx > 0)
    q, k, v = make_qkv(1, 4, 2, 3, 300, 16, seed=splits)
    mask = flexfa.create_block_mask(tail_window, None, None, 3, 300, device="cpu",
                                    BLOCK_SIZE=16)
    out, lse = check_forward(q, k, v, mods.softcap(4.0), tail_window, mask, enable_gqa=True,
                             kernel_options={"SPLIT_KV": splits})
    assert launched == [("decode", splits)]
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))
    assert bool((lse[:, :, 0] == float("-inf")).all())


def test_per_head_masks_and_small_q_blocks():
    """Tables with one row per query head (each head of a group walks its own blocks) and q
    blocks of 4 rows (a program's rows span 4 blocks), with and without full tables."""
    def per_head(b, h, q_idx, kv_idx):
        return ((kv_idx + q_idx) % (h + 2) == 0) | (kv_idx < 20 * h)
    q, k, v = make_qkv(1, 6, 2, 16, 100, 16, seed=3)
    for full in (True, False):
        mask = dense_block_mask(per_head, 1, 6, 16, 100, 4, 16, full=full)
        check_forward(q, k, v, mods.alibi(6), per_head, mask, enable_gqa=True,
                      kernel_options={"BACKEND": "DECODE", "SPLIT_KV": 3})


def test_lengths_offsets_and_paged_cache():
    """flex_decode with kv_lens (rows at the end of each sequence) and with q_offsets (a
    chunk in the middle), contiguous and paged through a shuffled page table, a block mask in
    positions; the paged result equals the contiguous one."""
    B, Hq, Hkv, L, S, E = 3, 6, 2, 3, 192, 16
    q, k, v = make_qkv(B, Hq, Hkv, L, S, E, seed=7)
    lens = torch.tensor([192, 57, 130], dtype=torch.int32)
    window = mods.sliding_window(40)
    mask = flexfa.create_block_mask(window, None, None, S, S, device="cpu", BLOCK_SIZE=32)
    score = mods.softcap(5.0)
    out, lse = flexfa.flex_decode(q, k, v, score, mask, kv_lens=lens, return_lse=True,
                                  kernel_options={"SPLIT_KV": 2})
    assert_matches(out, lse, *reference_rows(q, k, v, score, window, lens, lens - L))
    offsets = torch.tensor([5, 40, 0], dtype=torch.int32)
    out, lse = flexfa.flex_decode(q, k, v, score, mask, kv_lens=lens, q_offsets=offsets,
                                  return_lse=True)
    assert_matches(out, lse, *reference_rows(q, k, v, score, window, lens, offsets))
    # the same cache paged: 16-key pages in a shuffled order
    page, per_seq = 16, S // 16
    order = torch.randperm(B * per_seq, generator=torch.Generator().manual_seed(0))
    table = order.view(B, per_seq).to(torch.int32)
    k_cache = torch.empty(B * per_seq, page, Hkv, E)
    v_cache = torch.empty_like(k_cache)
    k_cache[order] = k.view(B, Hkv, per_seq, page, E).permute(0, 2, 3, 1, 4).reshape(-1, page, Hkv, E)
    v_cache[order] = v.view(B, Hkv, per_seq, page, E).permute(0, 2, 3, 1, 4).reshape(-1, page, Hkv, E)
    paged_out, paged_lse = flexfa.flex_decode(q, k_cache, v_cache, score, mask, kv_lens=lens,
                                              q_offsets=offsets, page_table=table,
                                              return_lse=True)
    torch.testing.assert_close(paged_out, out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(paged_lse, lse, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_one_cache_shared_by_the_batch(device):
    """key / value of batch 1 serve every query of the batch (parallel samples of one
    prompt), as flex_attention broadcasts them: read through a batch stride of 0, no copy;
    the result equals the call on the expanded cache, with per-sequence lengths too. Mixed
    batches stay an error naming both sizes."""
    B, Hq, Hkv, L, S, E = 3, 4, 2, 2, 96, 16
    q, k, v = make_qkv(B, Hq, Hkv, L, S, E, seed=11, device=device)
    k1, v1 = k[:1], v[:1]
    lens = torch.tensor([96, 40, 71], dtype=torch.int32, device=device)
    score = mods.softcap(5.0)
    out, lse = flexfa.flex_decode(q, k1, v1, score, kv_lens=lens, return_lse=True)
    wide = flexfa.flex_decode(q, k1.expand(B, -1, -1, -1).contiguous(),
                              v1.expand(B, -1, -1, -1).contiguous(), score, kv_lens=lens,
                              return_lse=True)
    torch.testing.assert_close(out, wide[0], atol=0, rtol=0)
    torch.testing.assert_close(lse, wide[1], atol=0, rtol=0)
    shared = k1.expand(B, -1, -1, -1), v1.expand(B, -1, -1, -1)
    assert_matches(out.cpu(), lse.cpu(), *reference_rows(q.cpu(), *(t.cpu() for t in shared),
                                                         score, None, lens.cpu(), lens.cpu() - L),
                   atol=2e-5 if device == "cpu" else 2e-3)
    with pytest.raises(InputError, match=r"batch sizes 1, 3 but query has 3; give both"):
        flexfa.flex_decode(q, k1, v, score)

def test_paged_kv_cache_generation():
    """PagedKVCache: append token by token to sequences of different lengths, attend, erase
    and reuse pages; against the contiguous reference."""
    torch.manual_seed(0)
    B, Hq, Hkv, E = 2, 4, 2, 16
    cache = flexfa.PagedKVCache(12, 16, B, Hkv, E, dtype=torch.float32)
    keys = [torch.randn(1, Hkv, n, E) for n in (40, 21)]
    values = [torch.randn(1, Hkv, n, E) for n in (40, 21)]
    for b in range(B):
        cache.reserve(b, keys[b].shape[2])
        cache.assign(torch.tensor([b]), torch.arange(keys[b].shape[2])[None], keys[b],
                     values[b])
        cache.set_length(b, keys[b].shape[2])
    new_k, new_v = torch.randn(B, Hkv, 1, E), torch.randn(B, Hkv, 1, E)
    cache.append(new_k, new_v)
    assert [cache.length(b) for b in range(B)] == [41, 22]
    q = torch.randn(B, Hq, 1, E)
    out = cache.attend(q, mods.softcap(3.0), cache.convert_logical_block_mask(None))
    for b in range(B):
        k = torch.cat([keys[b], new_k[b:b + 1]], 2)
        v = torch.cat([values[b], new_v[b:b + 1]], 2)
        ref = attention_reference(q[b:b + 1], k, v, mods.softcap(3.0), enable_gqa=True)
        torch.testing.assert_close(out[b:b + 1].double(), ref, atol=2e-5, rtol=2e-5)
    cache.erase(0)
    assert cache.length(0) == 0 and bool((cache.page_table[0] == -1).all())
    cache.reserve(1, 22 + 16 * 9)  # the freed pages serve sequence 1 now
    with pytest.raises(InputError, match="more pages but only"):
        cache.reserve(0, 16 * 3)


def test_paged_lengths_advanced_on_the_device_are_seen_by_append_and_length(monkeypatch):
    """Regression: a decode step as examples/decode_paged.py takes it (``assign`` at
    ``kv_lens``, then ``kv_lens += 1`` on the device) left the host's copy of the lengths
    stale: a later ``append`` wrote over the step's token and shrank kv_lens (7 for 8),
    ``length`` said 5. Each is read back from the device once kv_lens changed there; a
    capture's replays change it unseen, so a call of the cache inside a capture does the
    same; ``sync_lengths`` for writes the version counter misses."""
    import flexfa.paged as paged_api
    Hkv, E = 1, 16
    cache = flexfa.PagedKVCache(4, 16, 2, Hkv, E, dtype=torch.float32)
    first = torch.randn(2, Hkv, 5, E)
    cache.append(first, first)
    cache.reserve(0, 16)
    step = torch.randn(1, Hkv, 1, E)
    cache.assign(torch.tensor([0]), cache.kv_lens[:1, None].long(), step, step, validate=False)
    cache.kv_lens[:1] += 1
    assert cache.length(0) == 6 and cache.length(1) == 5
    more = torch.randn(2, Hkv, 2, E)
    cache.append(more, more)
    assert cache.kv_lens.tolist() == [8, 7]
    page = int(cache.page_table[0, 0])
    assert torch.equal(cache.k_cache[page, 5], step[0, :, 0])
    assert torch.equal(cache.k_cache[page, 6:8], more[0].transpose(0, 1))
    # a fresh cache whose device step is a (simulated) CUDA graph: the capture runs the
    # cache's calls once; each replay advances kv_lens without a version change
    cache = flexfa.PagedKVCache(4, 16, 1, Hkv, E, dtype=torch.float32)
    cache.append(first[:1], first[:1])
    cache.reserve(0, 32)
    monkeypatch.setattr(paged_api, "capturing", lambda: True)
    cache.assign(torch.tensor([0]), cache.kv_lens[:1, None].long(), step, step, validate=False)
    monkeypatch.setattr(paged_api, "capturing", lambda: False)
    version = cache.kv_lens._version
    cache.kv_lens.data += 3  # three replays: no version change
    assert cache.kv_lens._version == version and cache.length(0) == 8
    # a write the version counter misses, on a cache no capture saw: sync_lengths
    other = flexfa.PagedKVCache(4, 16, 1, Hkv, E, dtype=torch.float32)
    other.append(first[:1], first[:1])
    other.reserve(0, 16)
    other.kv_lens.data += 2
    other.sync_lengths()
    assert other.length(0) == 7
    other.append(more[:1], more[:1])
    assert other.kv_lens.tolist() == [9]
    # a cache made under inference_mode (as a server makes it): kv_lens has no version
    # counter, so the lengths are read back from the start
    with torch.inference_mode():
        served = flexfa.PagedKVCache(4, 16, 1, Hkv, E, dtype=torch.float32)
        served.append(first[:1], first[:1])
        served.kv_lens[:1] += 1
        assert served.length(0) == 6
        served.append(more[:1], more[:1])
        assert served.kv_lens.tolist() == [8]


def test_value_checks_inside_a_capture(monkeypatch):
    """Inside a CUDA graph capture (simulated: the modules' ``capturing``) the value checks'
    host reads would break the capture: flex_decode with kv_lens and PagedKVCache.assign
    refuse validate=True with an error saying so (assign failed deep in torch), and a call
    with no values to check runs (it was refused too, unlike torch's in a capture)."""
    import flexfa.decode as decode_api
    import flexfa.paged as paged_api

    monkeypatch.setattr(decode_api, "capturing", lambda: True, raising=False)
    monkeypatch.setattr(paged_api, "capturing", lambda: True, raising=False)
    B, Hq, Hkv, S, E = 2, 2, 1, 32, 16
    q, k, v = make_qkv(B, Hq, Hkv, 1, S, E, seed=3)
    plain = flexfa.flex_decode(q, k, v)
    torch.testing.assert_close(plain.double(), attention_reference(q, k, v, None,
                                                                   enable_gqa=True),
                               atol=2e-5, rtol=2e-5)
    lens = torch.tensor([S, 7], dtype=torch.int32)
    with pytest.raises(InputError, match="CUDA graph is being captured; pass validate=False"):
        flexfa.flex_decode(q, k, v, kv_lens=lens)
    flexfa.flex_decode(q, k, v, kv_lens=lens, validate=False)
    cache = flexfa.PagedKVCache(4, 16, B, Hkv, E, dtype=torch.float32)
    cache.reserve(0, 16)
    rows, pos, kv = torch.tensor([0]), torch.arange(3)[None], torch.randn(1, Hkv, 3, E)
    with pytest.raises(InputError, match="CUDA graph is being captured; pass validate=False"):
        cache.assign(rows, pos, kv, kv)
    cache.assign(rows, pos, kv, kv, validate=False)
    assert torch.equal(cache.k_cache[cache.page_table[0, 0], :3], kv[0].transpose(0, 1))


def test_paged_kv_cache_bad_arguments_are_input_errors():
    """PagedKVCache's arguments are checked before anything is indexed or reserved: a
    sequence or position past the page table (an index past it would fail on the device),
    values of another head dim, non-int sizes and lengths; an append that fails its shape
    check reserves nothing."""
    from flexfa.errors import InputTypeError
    with pytest.raises(InputTypeError, match="page_size must be an int, got float 16.0"):
        flexfa.PagedKVCache(4, 16.0, 2, 2, 16)
    with pytest.raises(InputError, match="max_pages_per_seq must be positive, got "
                                         "max_pages_per_seq=0"):
        flexfa.PagedKVCache(4, 16, 2, 2, 16, max_pages_per_seq=0)
    cache = flexfa.PagedKVCache(4, 16, 2, 2, 16, dtype=torch.float32)
    with pytest.raises(InputError, match="seq_len must be >= 0, got -5"):
        cache.reserve(0, -5)
    with pytest.raises(InputTypeError, match="seq_len must be an int, got float 10.5"):
        cache.reserve(0, 10.5)
    cache.reserve(0, 20)
    k = torch.randn(1, 2, 1, 16)
    with pytest.raises(InputError, match=r"batch_idx \[5\] has entries outside the cache's "
                                         r"sequences 0..1"):
        cache.assign(torch.tensor([5]), torch.tensor([[0]]), k, k)
    with pytest.raises(InputError, match=r"input_pos has positions outside 0..63 .* got 70..70"):
        cache.assign(torch.tensor([0]), torch.tensor([[70]]), k, k)
    with pytest.raises(InputError, match=r"k_val \(1, 2, 1, 8\) .* must be \[B=1, Hkv=2, L=1, "
                                         r"E=16\]"):
        cache.assign(torch.tensor([0]), torch.tensor([[3]]), k[..., :8], k[..., :8])
    with pytest.raises(InputTypeError, match="batch_idx must be a 1-D integer tensor"):
        cache.assign([0], torch.tensor([[3]]), k, k)
    with pytest.raises(InputTypeError, match="validate must be a bool, got NoneType"):
        cache.assign(torch.tensor([5]), torch.tensor([[0]]), k, k, validate=None)  # skipped
    free = len(cache._free)
    with pytest.raises(InputError, match=r"must be \[B=2, Hkv=2, L=1, E=16\]"):
        cache.append(torch.randn(2, 3, 1, 16), torch.randn(2, 3, 1, 16))
    assert len(cache._free) == free and cache.length(1) == 0
    # an append that runs out of pages for a later sequence reserves none for the earlier
    with pytest.raises(InputError, match="needs 4 more pages but only 2 of 4 are free"):
        cache.append(torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16))
    assert len(cache._free) == free and cache.length(0) == 0
    cache.append(torch.randn(2, 2, 0, 16), torch.randn(2, 2, 0, 16))  # nothing to append
    assert len(cache._free) == free and cache.length(0) == 0
    # pages a sequence holds beyond its need do not count as free for the others
    spare = flexfa.PagedKVCache(5, 16, 3, 2, 16, dtype=torch.float32)
    spare.reserve(0, 64)
    with pytest.raises(InputError, match="needs 2 more pages but only 1 of 5 are free"):
        spare.append(torch.randn(3, 2, 1, 16), torch.randn(3, 2, 1, 16))
    assert len(spare._free) == 1 and spare.page_table[1, 0] == -1
    with pytest.raises(InputTypeError, match="set_length: seq_len must be an int, got float 3.5"):
        cache.set_length(0, 3.5)
    with pytest.raises(InputTypeError, match="batch_idx must be an int, got bool True"):
        cache.reserve(True, 3)
    with pytest.raises(InputTypeError, match="block_mask must be a BlockMask"):
        cache.convert_logical_block_mask(3)
    with pytest.raises(InputError, match="dtype must be torch.float16, torch.bfloat16 or "
                                         "torch.float32"):
        flexfa.PagedKVCache(4, 16, 2, 2, 16, dtype=torch.float64)
    with pytest.raises(InputError, match="head_dim is 1000; flexfa supports 1..256"):
        flexfa.PagedKVCache(4, 16, 2, 2, 1000)


def test_decode_edge_inputs():
    """An empty batch gives empty results (as flex_attention does), a head dim of 0, a paged
    cache of 0-key pages and offsets near 2**31 (whose ends wrapped in int32 and passed the
    check: the kernel then read past the tables) are InputErrors, not a ZeroDivisionError or
    a crash."""
    q, k, v = torch.randn(0, 4, 1, 16), torch.randn(0, 2, 64, 16), torch.randn(0, 2, 64, 8)
    out, lse = flexfa.flex_decode(q, k, v, return_lse=True)
    assert out.shape == (0, 4, 1, 8) and lse.shape == (0, 4, 1) and lse.dtype == torch.float32
    with pytest.raises(InputError, match="query/key head_dim is 0; flexfa supports 1..256"):
        flexfa.flex_decode(torch.randn(1, 4, 1, 0), torch.randn(1, 2, 64, 0),
                           torch.randn(1, 2, 64, 0))
    with pytest.raises(InputError, match="page_size 0; the decode kernel needs a positive"):
        flexfa.flex_decode(torch.randn(2, 4, 1, 16), torch.randn(8, 0, 2, 16),
                           torch.randn(8, 0, 2, 16), page_table=torch.zeros(2, 4, dtype=torch.int32))
    q, k, v = make_qkv(1, 2, 2, 1, 64, 16)
    mask = flexfa.create_block_mask(mods.causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=16)
    with pytest.raises(InputError, match=r"q_offsets\[0\] = 2147483647 puts the 1 query rows"):
        flexfa.flex_decode(q, k, v, None, mask, kv_lens=torch.tensor([10], dtype=torch.int32),
                           q_offsets=torch.tensor([2 ** 31 - 1], dtype=torch.int32))


@st.composite
def decode_problems(draw):
    Hkv = draw(st.integers(1, 2))
    G, L = draw(st.sampled_from((1, 3, 4, 5))), draw(st.sampled_from((1, 2, 5)))
    B, page = draw(st.integers(1, 2)), draw(st.sampled_from((16, 32)))
    pages = draw(st.integers(1, 4))
    lens = draw(st.lists(st.integers(L, pages * page), min_size=B, max_size=B))
    return B, Hkv * G, Hkv, L, page, pages, lens


@settings(max_examples=8)
@given(problem=decode_problems(), data=st.data())
def test_random_mods_and_page_tables(problem, data):
    """Random score_mods and mask_mods (as mods of the positions) over random page tables
    and lengths, against each sequence's float64 reference."""
    B, Hq, Hkv, L, page, per_seq, lens = problem
    S = page * per_seq
    score_mod = data.draw(st.none() | score_mods(B, Hq, S, S, max_depth=2), label="score_mod")
    mask_mod = data.draw(st.none() | mask_mods(B, Hq, S, S, max_depth=2), label="mask_mod")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    q, k, v = make_qkv(B, Hq, Hkv, L, S, 16, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(B * per_seq + 3, generator=generator)[:B * per_seq]
    table = order.view(B, per_seq).to(torch.int32)
    k_cache = torch.randn(B * per_seq + 3, page, Hkv, 16, generator=generator)
    v_cache = torch.randn_like(k_cache)
    k_cache[order] = k.view(B, Hkv, per_seq, page, 16).permute(0, 2, 3, 1, 4).reshape(-1, page, Hkv, 16)
    v_cache[order] = v.view(B, Hkv, per_seq, page, 16).permute(0, 2, 3, 1, 4).reshape(-1, page, Hkv, 16)
    lengths = torch.tensor(lens, dtype=torch.int32)
    block_mask = dense_block_mask(mask_mod, B, Hq, S, S, 16, 16) if mask_mod else None
    out, lse = flexfa.flex_decode(q, k_cache, v_cache, score_mod, block_mask, kv_lens=lengths,
                                  page_table=table, return_lse=True,
                                  kernel_options={"SPLIT_KV": data.draw(st.integers(1, 4))})
    assert_matches(out, lse, *reference_rows(q, k, v, score_mod, mask_mod, lengths,
                                             lengths - L), atol=1e-4)


def test_gradients_through_the_decode_family(launched):
    q, k, v = make_qkv(1, 6, 2, 3, 100, 16, seed=11)
    check_backward(q, k, v, mods.softcap(5.0), mods.causal,
                   flexfa.create_block_mask(mods.causal, None, None, 3, 100, device="cpu",
                                            BLOCK_SIZE=32), with_lse=True, enable_gqa=True,
                   kernel_options={"SPLIT_KV": 2})
    assert launched[0] == ("decode", 2)


def test_family_choice_and_split_rule(monkeypatch):
    """Decode for L <= 16 and G * L <= 128 (else the other families; forcing it names the
    reason); the default split count fills about WAVES programs per SM and keeps
    MIN_SPLIT_TILES tiles per split, fires for B = 1 long contexts, not for full grids."""
    def call(options, group=1):
        return AttentionCall(None, None, None, 0.1, parse_kernel_options(options), group)
    q16, q17 = torch.zeros(1, 8, 16, 32), torch.zeros(1, 8, 17, 32)
    k = torch.zeros(1, 1, 100, 32)
    assert registry.choose("forward", INTERPRETER, call({}, 8), q16, k, k) is DECODE
    assert registry.choose("forward", INTERPRETER, call({}, 8), q17, k, k) is AMPERE
    with pytest.raises(InputError, match="BACKEND='DECODE' cannot run this call: .*17"):
        registry.choose("forward", INTERPRETER, call({"BACKEND": "DECODE"}, 8), q17, k, k)
    assert registry.choose("forward", INTERPRETER, call({"BACKEND": "AMPERE"}, 8), q16, k,
                           k) is AMPERE
    monkeypatch.setattr(decode, "sm_count", lambda device: 132)
    sm90 = Target("cuda", 9, 0)

    def splits(programs, S, options=None):
        return decode.split_count(call(options or {}), sm90, programs, S // 64, None)
    assert splits(16 * 8, 8192) == 3  # B=16, Hkv=8: 128 programs, two waves of 132 SMs
    assert splits(8, 131072) == 33  # B=1 long context
    assert splits(64 * 8, 8192) == 1  # four waves already
    assert splits(8, 512) == 2  # each split keeps 4 tiles
    assert splits(8, 131072, {"SPLIT_KV": 5}) == 5
    assert splits(8, 131072, {"SPLIT_KV": 0}) == 1
    assert decode.split_count(call({}), INTERPRETER, 2, 64, None) == 4  # notional 4 SMs


def test_bad_inputs_fail_before_launch(monkeypatch):
    """A page outside the cache, offsets past a sequence's length, lengths past the cache,
    a page size that is no multiple of 16 or that differs between K and V: InputErrors
    naming the values, raised before any kernel runs."""
    monkeypatch.setattr(DECODE, "first_call", lambda *a, **k: pytest.fail("launched"))
    q = torch.zeros(2, 4, 1, 16)
    k_cache, v_cache = torch.zeros(6, 16, 2, 16), torch.zeros(6, 16, 2, 16)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([20, 17], dtype=torch.int32)
    with pytest.raises(InputError, match=r"page_table\[1, 1\] = 9 is not a page of the cache "
                                         r"\(0..5\)"):
        flexfa.flex_decode(q, k_cache, v_cache, page_table=torch.tensor(
            [[0, 1], [2, 9]], dtype=torch.int32), kv_lens=lens)
    with pytest.raises(InputError, match=r"q_offsets\[0\] = 20 puts the 1 query rows at "
                                         r"positions past the sequence's 20 keys"):
        flexfa.flex_decode(q, k_cache, v_cache, page_table=table, kv_lens=lens,
                           q_offsets=torch.tensor([20, 0], dtype=torch.int32))
    with pytest.raises(InputError, match=r"q_offsets\[1\] = -2 is negative"):
        flexfa.flex_decode(q, k_cache, v_cache, page_table=table, kv_lens=lens,
                           q_offsets=torch.tensor([0, -2], dtype=torch.int32))
    with pytest.raises(InputError, match=r"kv_lens\[1\] = 33 is outside the cache's 0..32"):
        flexfa.flex_decode(q, k_cache, v_cache, page_table=table,
                           kv_lens=torch.tensor([3, 33], dtype=torch.int32))
    with pytest.raises(InputError, match="value cache has shape .* but key cache"):
        flexfa.flex_decode(q, k_cache, torch.zeros(12, 8, 2, 16), page_table=table)
    with pytest.raises(InputError, match="page_size 8; the decode kernel needs a positive multiple of 16"):
        flexfa.flex_decode(q, torch.zeros(6, 8, 2, 16), torch.zeros(6, 8, 2, 16),
                           page_table=table)
    with pytest.raises(InputError, match="kv_lens must be int32 of shape"):
        flexfa.flex_decode(q, k_cache, v_cache, page_table=table, kv_lens=lens.long())
    with pytest.raises(InputError, match="query has 17 rows per head"):
        flexfa.flex_decode(torch.zeros(2, 4, 17, 16), k_cache, v_cache, page_table=table)
    with pytest.raises(InputError, match=r"the cache has 0 heads \(query 0\)"):
        flexfa.flex_decode(torch.zeros(2, 0, 1, 16), torch.zeros(2, 0, 8, 16),
                           torch.zeros(2, 0, 8, 16))
    # a page entry past the sequence's length is never read: -1 is fine there
    monkeypatch.undo()
    out = flexfa.flex_decode(q, k_cache, v_cache, kv_lens=torch.tensor([16, 3], dtype=torch.int32),
                             page_table=torch.tensor([[0, -1], [2, -1]], dtype=torch.int32))
    assert out.shape == (2, 4, 1, 16)


def test_workspace_call_allocates_and_syncs_nothing(monkeypatch):
    """With a DecodeWorkspace, a repeated call (the step a CUDA graph captures) creates no
    tensor and reads no tensor value on the host in flexfa's code, and returns the
    workspace's output."""
    B, Hq, Hkv, page = 2, 8, 2, 16
    cache = flexfa.PagedKVCache(8, page, B, Hkv, 16, dtype=torch.float32)
    cache.append(torch.randn(B, Hkv, 40, 16), torch.randn(B, Hkv, 40, 16))
    q = torch.randn(B, Hq, 1, 16)
    workspace = flexfa.DecodeWorkspace()
    kwargs = dict(workspace=workspace, validate=False, kernel_options={"SPLIT_KV": 3})
    first = cache.attend(q, mods.softcap(5.0), **kwargs).clone()
    flexfa_calls = []

    def spy(name, real):
        def wrapper(*args, **kw):
            caller = sys._getframe(1).f_code.co_filename
            if "/flexfa/" in caller and "/tests/" not in caller:
                flexfa_calls.append(f"{name} from {caller}")
            return real(*args, **kw)
        return wrapper
    for name in ("empty", "empty_like", "empty_strided", "zeros", "zeros_like", "full",
                 "tensor", "arange", "ones"):
        monkeypatch.setattr(torch, name, spy(name, getattr(torch, name)))
    for name in ("item", "cpu", "tolist", "__bool__", "__int__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, spy(name, getattr(torch.Tensor, name)))
    again = cache.attend(q, mods.softcap(5.0), **kwargs)
    assert flexfa_calls == []
    cache.attend(q, mods.softcap(5.0), kernel_options={"SPLIT_KV": 3})  # the spies see these
    monkeypatch.undo()
    assert any(call.startswith("empty") for call in flexfa_calls)
    assert any(call.startswith("nonzero") for call in flexfa_calls)  # the value checks
    assert again is workspace.out
    torch.testing.assert_close(again, first)


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    """A decode step (append a token to the paged cache, attend) captured with
    torch.cuda.graph replays with new inputs and matches an uncaptured call."""
    device = "cuda"
    B, Hq, Hkv, E = 4, 32, 8, 128
    cache = flexfa.PagedKVCache(256, 64, B, Hkv, E, dtype=torch.bfloat16, device=device)
    cache.append(*(torch.randn(B, Hkv, 1000, E, device=device, dtype=torch.bfloat16)
                   for _ in range(2)))
    for b in range(B):
        cache.reserve(b, 1100)
    q = torch.randn(B, Hq, 1, E, device=device, dtype=torch.bfloat16)
    new_k, new_v = (torch.randn(B, Hkv, 1, E, device=device, dtype=torch.bfloat16)
                    for _ in range(2))
    batch = torch.arange(B, device=device)
    workspace = flexfa.DecodeWorkspace()

    def step():
        cache.assign(batch, cache.kv_lens[:B, None].long(), new_k, new_v, validate=False)
        cache.kv_lens[:B] += 1
        return cache.attend(q, mods.softcap(30.0), workspace=workspace, validate=False)
    step()  # compiles, allocates the workspace
    cache.kv_lens[:B] -= 1
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # records the step without running it
        out = step()
    for _ in range(3):
        q.copy_(torch.randn_like(q))
        graph.replay()
        expected = cache.attend(q, mods.softcap(30.0))
        torch.testing.assert_close(out, expected)
    # the replays advanced kv_lens on the device: append and length read it back (the host's
    # copy said 1000, and append wrote over the replays' tokens)
    assert [cache.length(b) for b in range(B)] == [1003] * B
    extra = torch.randn(B, Hkv, 1, E, device=device, dtype=torch.bfloat16)
    cache.append(extra, extra.clone())
    assert cache.kv_lens[:B].tolist() == [1004] * B
    page = int(cache.page_table[0, 1003 // 64])
    assert torch.equal(cache.k_cache[page, 1003 % 64], extra[0, :, 0])
    assert torch.equal(cache.k_cache[int(cache.page_table[0, 1002 // 64]), 1002 % 64],
                       new_k[0, :, 0])


def to_pages(k, v, page, seed):
    """(k_cache, v_cache, page_table): contiguous [B, Hkv, S, E] keys and values in
    ``page``-key pages of a vLLM-layout cache, in a shuffled order."""
    B, Hkv, S, E = k.shape
    per_seq = S // page
    order = torch.randperm(B * per_seq, generator=torch.Generator().manual_seed(seed))

    def cache(t):
        paged = torch.empty(B * per_seq, page, Hkv, t.shape[-1], dtype=t.dtype)
        paged[order] = t.view(B, Hkv, per_seq, page, -1).permute(0, 2, 3, 1, 4).reshape(
            -1, page, Hkv, t.shape[-1])
        return paged
    return cache(k), cache(v), order.view(B, per_seq).to(torch.int32)


def reversed_rows(num_blocks, indices):
    """The tables with each row's listed blocks in descending order."""
    at = torch.arange(indices.shape[-1])
    source = torch.where(at < num_blocks[..., None], num_blocks[..., None] - 1 - at, at)
    return indices.gather(-1, source.long())


@pytest.fixture
def union_walks():
    """spec.union_walk of each decode plan a call makes."""
    with kept_plans(lambda plan: plan.spec.union_walk) as made:
        yield made


def editable_mask_call():
    """(q, k, v, counts, mask): one query row over 128 keys, 4 query heads on one kv head,
    and a mask of 8 16-key blocks per head whose counts a test edits in place."""
    Hq, S = 4, 128
    q, k, v = make_qkv(1, Hq, 1, 1, S, 16, seed=5)
    counts = torch.full((1, Hq, 1), 8, dtype=torch.int32)
    indices = torch.arange(8, dtype=torch.int32).expand(1, Hq, 1, 8).contiguous()
    mask = flexfa.BlockMask.from_kv_blocks(counts, indices, BLOCK_SIZE=16, seq_lengths=(1, S),
                                           compute_q_blocks=False)
    return q, k, v, counts, mask


def test_union_walk_follows_an_in_place_edit_of_the_mask(union_walks):
    """The union walk's tables are computed from the mask's contents and kept with the plan:
    an in-place edit of the mask's tables builds them again (the old union was reused: an
    output 0.78 off), as the members' walk reads the edited tables itself."""
    q, k, v, counts, mask = editable_mask_call()
    lens = torch.full((1,), 128, dtype=torch.int32)
    for edit in (None, [1, 2, 3, 4], [8, 3, 1, 6]):
        if edit is not None:
            counts[0, :, 0] = torch.tensor(edit, dtype=torch.int32)
        blocks = counts[0, :, 0].clone()

        def kept(b, h, q_idx, kv_idx, blocks=blocks):
            return kv_idx // 16 < blocks[h]
        out, lse = flexfa.flex_decode(q, k, v, block_mask=mask, return_lse=True)
        assert_matches(out, lse, *reference_rows(q, k, v, None, kept, lens, torch.zeros_like(lens)))
    assert union_walks and all(union_walks)


def test_flex_attention_union_walk_follows_an_in_place_edit(union_walks):
    """flex_attention's calls the decode family runs take the union walk too, through the
    generic forward plan key (which has no contents generation) and prepared calls: an
    in-place edit of the mask's tables builds the union tables again (the old ones were
    reused: an output 0.74 off)."""
    q, k, v, counts, mask = editable_mask_call()
    for edit in (None, None, [1, 2, 3, 4], None, [8, 3, 1, 6]):
        if edit is not None:
            counts[0, :, 0] = torch.tensor(edit, dtype=torch.int32)
        blocks = counts[0, :, 0].clone()

        def kept(b, h, q_idx, kv_idx, blocks=blocks):
            return kv_idx // 16 < blocks[h]
        out, lse = flexfa.flex_attention(q, k, v, block_mask=mask, enable_gqa=True,
                                         return_lse=True)
        assert_matches(out, lse, *attention_reference(q, k, v, None, kept, enable_gqa=True,
                                                      return_lse=True))
    assert union_walks == [True, True, True]  # one plan per contents, reused while unedited


def test_a_capture_of_flex_attention_walks_the_members(monkeypatch, union_walks):
    """A union-walk plan made outside a capture is not reused inside one, neither from the plan
    memo nor from a prepared call's plans (its tables would replay stale after an edit of the
    mask): flex_attention's capture walks the members, and the eager call after it takes the
    union walk again."""
    B, Hq, Hkv, L, S, E = 1, 4, 1, 1, 64, 16
    q, k, v = make_qkv(B, Hq, Hkv, L, S, E, seed=6)
    mask = flexfa.create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx < 10 + 12 * h, None, Hq,
                                    L, S, device="cpu", BLOCK_SIZE=16)
    plain = flexfa.flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
    flexfa.flex_attention(q, k, v, block_mask=mask, enable_gqa=True)  # the prepared call's plan
    for module in (decode, plans):
        monkeypatch.setattr(module, "capturing", lambda: True)
    captured = flexfa.flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
    monkeypatch.undo()
    again = flexfa.flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
    assert union_walks == [True, False]  # the eager call after takes the kept union plan
    torch.testing.assert_close(captured, plain, atol=1e-6, rtol=1e-6)
    assert torch.equal(again, plain)


def test_union_walk_reads_only_the_rows_of_the_call(union_walks):
    """A mask's tables may have more q rows than the call's positions need (never read, not
    checked): the union tables are built from the rows the call reads, as the members' walk
    reads them (they were built from every row: a torch RuntimeError from scatter_ on an
    unchecked entry past the kv blocks)."""
    B, Hq, Hkv, L, S, E = 1, 4, 1, 1, 64, 16
    q, k, v = make_qkv(B, Hq, Hkv, L, S, E, seed=5)
    counts = torch.tensor([[2 + h % 2, 4] for h in range(Hq)], dtype=torch.int32)[None]
    indices = torch.tensor([[0, 1, 2, 0], [7, 9, 100, -5]], dtype=torch.int32).expand(
        1, Hq, 2, 4).contiguous()
    mask = flexfa.BlockMask.from_kv_blocks(counts, indices, BLOCK_SIZE=16, seq_lengths=(L, S),
                                           compute_q_blocks=False)

    def kept(b, h, q_idx, kv_idx):
        return kv_idx // 16 < 2 + h % 2
    union = flexfa.flex_attention(q, k, v, block_mask=mask, enable_gqa=True, return_lse=True)
    assert union_walks == [True]
    assert_matches(*union, *attention_reference(q, k, v, None, kept, enable_gqa=True,
                                                return_lse=True))


def test_a_capture_walks_the_members(monkeypatch, union_walks):
    """Inside a CUDA graph capture the union tables (computed on the host from the mask's
    contents) would replay stale after an edit: 'AUTO' walks the members' blocks there, and
    DECODE_WALK='UNION' is an error saying so."""
    B, Hq, Hkv, L, S, E = 1, 4, 1, 1, 64, 16
    q, k, v = make_qkv(B, Hq, Hkv, L, S, E, seed=6)
    mask = flexfa.create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx < 10 + 12 * h, None, Hq,
                                    L, S, device="cpu", BLOCK_SIZE=16)
    plain = flexfa.flex_decode(q, k, v, block_mask=mask)
    assert union_walks == [True]
    for module in (decode, plans):
        monkeypatch.setattr(module, "capturing", lambda: True)
    captured = flexfa.flex_decode(q, k, v, block_mask=mask)
    assert union_walks == [True, False]
    torch.testing.assert_close(captured, plain, atol=1e-6, rtol=1e-6)
    with pytest.raises(InputError, match="DECODE_WALK='UNION' cannot run inside a CUDA graph"):
        flexfa.flex_decode(q, k, v, block_mask=mask, kernel_options={"DECODE_WALK": "UNION"})

# (G, L, splits, paged): GQA ratios 3 and 4, L in {1, 3}, splits 1..4, paged and contiguous
UNION_CASES = [(3, 1, 1, False), (3, 3, 2, True), (4, 1, 3, True), (4, 3, 4, False)]


@pytest.mark.parametrize("case", UNION_CASES, ids=lambda c: "g{}_l{}_s{}_{}".format(
    *c[:3], "paged" if c[3] else "contiguous"))
def test_union_walk_of_per_head_windows(case, union_walks):
    """Per-head masks (a different window per query head, so each head of a group lists other
    blocks; with L = 3 the rows also cross q blocks) take the union walk: against the float64
    reference, close to the per-member walk (DECODE_WALK='MEMBERS'; the order of the tiles
    differs where full blocks sit between partial ones), bit for bit equal to it without full
    tables and splits (each row then sees the same tiles in the same order), and the same
    with each row's blocks listed in descending order (the union does not assume order)."""
    G, L, splits, paged = case
    B, Hkv, S, E = 2, 2, 192, 16
    Hq = G * Hkv

    def windows(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < 12 + 21 * h)
    q, k, v = make_qkv(B, Hq, Hkv, L, S, E, seed=G * 10 + L)
    lens = torch.tensor([S, 101], dtype=torch.int32)
    score = mods.softcap(6.0)
    kwargs = dict(kv_lens=lens, return_lse=True)
    if paged:
        k, v, kwargs["page_table"] = to_pages(k, v, 32, seed=G)
    ref_k, ref_v = make_qkv(B, Hq, Hkv, L, S, E, seed=G * 10 + L)[1:]

    def run(mask, walk, n=splits):
        return flexfa.flex_decode(q, k, v, score, mask, **kwargs, kernel_options={
            "SPLIT_KV": n, "DECODE_WALK": walk})
    mask = flexfa.create_block_mask(windows, None, Hq, S, S, device="cpu", BLOCK_SIZE=16)
    out, lse = run(mask, "AUTO")
    assert_matches(out, lse, *reference_rows(q, ref_k, ref_v, score, windows, lens, lens - L))
    members = run(mask, "MEMBERS")
    torch.testing.assert_close(members, (out, lse), atol=1e-5, rtol=1e-5)
    partial_only = dense_block_mask(windows, 1, Hq, S, S, 16, 16, full=False)
    union = run(partial_only, "UNION", 1)
    assert all(torch.equal(a, b) for a, b in zip(union, run(partial_only, "MEMBERS", 1)))
    partial_only.kv_indices = reversed_rows(partial_only.kv_num_blocks, partial_only.kv_indices)
    torch.testing.assert_close(run(partial_only, "AUTO", 1), union, atol=1e-5, rtol=1e-5)
    assert union_walks == [True, False, True, False, True]


@pytest.mark.parametrize("walk", ["UNION", "MEMBERS"])
def test_empty_sequence_with_a_whole_q_block_of_rows(walk):
    """kv_lens[b] = 0 with L = 16 rows and 16-row mask blocks puts the rows at -16..-1: the
    first q block was -16 // 16 = -1, so the walks read table row -1 (the previous head's
    last row, or memory before the table; the interpreter cannot see it, a GPU may fault).
    Rows at negative positions take q block 0 now, as rows -15..-1 did."""
    B, Hq, Hkv, L, S = 2, 4, 2, 16, 64
    q, k, v = make_qkv(B, Hq, Hkv, L, S, 16, seed=11)
    lens = torch.tensor([0, 40], dtype=torch.int32)
    mask = flexfa.create_block_mask(mods.causal, None, Hq, S, S, device="cpu", BLOCK_SIZE=16)
    out, lse = flexfa.flex_decode(q, k, v, None, mask, kv_lens=lens, return_lse=True,
                                  kernel_options={"DECODE_WALK": walk})
    assert_matches(out, lse, *reference_rows(q, k, v, None, mods.causal, lens, lens - L))
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()


def _chunks_of_16(b, h, q_idx, kv_idx):
    return (q_idx // 16) == (kv_idx // 16)  # bidirectional chunks: q block 0's is full


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("walk", ["UNION", "MEMBERS"])
def test_rows_at_negative_positions_apply_the_mask_in_full_blocks(walk, device):
    """Rows at negative positions (kv_lens[b] < L, no q_offsets) read q block 0's tables,
    whose full blocks are full for rows 0.. only: the walks skipped the mask_mod there, so
    rows -2 and -1 attended keys their mask refuses (out 1.17 off, lse finite, an audit's
    probe); the mask_mod decides for them now."""
    B, Hq, Hkv, L, S = 2, 2, 1, 4, 48
    q, k, v = make_qkv(B, Hq, Hkv, L, S, 16, seed=12, device=device)
    lens = torch.tensor([2, 30], dtype=torch.int32, device=device)
    mask = flexfa.create_block_mask(_chunks_of_16, None, None, S, S, device=device,
                                    BLOCK_SIZE=16)
    assert int(mask.full_kv_num_blocks[0, 0, 0]) == 1
    out, lse = flexfa.flex_decode(q, k, v, None, mask, kv_lens=lens, return_lse=True,
                                  kernel_options={"DECODE_WALK": walk})
    out, lse, lens = out.cpu(), lse.cpu(), lens.cpu()
    assert_matches(out, lse, *reference_rows(*(t.cpu() for t in (q, k, v)), None,
                                             _chunks_of_16, lens, lens - L),
                   atol=2e-5 if device == "cpu" else 2e-3)
    assert torch.isneginf(lse[0, :, :2]).all() and (out[0, :, :2] == 0).all()


@pytest.mark.parametrize("block", [16, 24])
def test_rows_at_negative_positions_under_a_coarsened_mask(block):
    """Regression: a mask of blocks the kernels cannot tile (24) runs as a coarser mask whose
    mask_mod reads the original blocks' classes at q_idx // 24: -1 for a row at a negative
    position, the last q block's classes (empty here), so rows -2 and -1 lost every key (out
    0, lse -inf) where the 16-block mask gave the reference. They read q block 0's classes
    now, as the kernels read its tables."""
    window = mods.sliding_window(5, causal=False)
    q, k, v = make_qkv(1, 1, 1, 4, 64, 16, seed=13)
    lens = torch.tensor([2], dtype=torch.int32)
    mask = flexfa.create_block_mask(window, None, None, 64, 64, device="cpu", BLOCK_SIZE=block)
    out, lse = flexfa.flex_decode(q, k, v, None, mask, kv_lens=lens, return_lse=True)
    assert torch.isfinite(lse).all()
    assert_matches(out, lse, *reference_rows(q, k, v, None, window, lens, lens - 4))


def test_per_call_tensors_at_other_alignments_get_their_own_plan(monkeypatch):
    """kv_lens, q_offsets and the page table are a call's own tensors: one at an address that
    is not 16-byte aligned (a view into a larger buffer) must not reuse a plan whose GPU
    kernel was compiled for aligned ones (``tests/specialization.py``)."""
    launched, changed = specialization_spy(monkeypatch)
    B, Hq, Hkv, L, S, E = 2, 2, 2, 1, 64, 16
    q, k, v = make_qkv(B, Hq, Hkv, L, S, E, seed=9)
    lens = torch.tensor([40, 64], dtype=torch.int32)
    offsets = torch.tensor([3, 20], dtype=torch.int32)

    def unaligned(t):
        buffer = torch.zeros(t.numel() + 1, dtype=t.dtype)
        buffer[1:] = t
        return buffer[1:]
    for kv_lens, q_offsets in ((lens, offsets), (lens, offsets), (unaligned(lens), offsets),
                               (lens, unaligned(offsets))):
        out, lse = flexfa.flex_decode(q, k, v, kv_lens=kv_lens, q_offsets=q_offsets,
                                      return_lse=True)
        assert_matches(out, lse, *reference_rows(q, k, v, None, None, lens, offsets))
    assert launched and not changed, f"specialized otherwise than at first: {changed}"


# ---- edges from the fiftieth session's audit of the decode family: each test fails under a
# rule changed with the rest of the suite passing (value checks off by one, the members' walk
# of the q block holding only the last row, bounds under mask blocks wider than the key tile,
# a cache with a strided head dim, a sink far above the scores, split lse / row-max workspaces)

def _i32(*values):
    return torch.tensor(values, dtype=torch.int32)


def test_value_checks_are_exact_at_the_boundaries():
    """kv_lens = S and q_offsets + L = kv_lens are the last accepted values; one more is an
    InputError (the checks off by one accept a read past the cache)."""
    q, k, v = make_qkv(1, 2, 1, 3, 32, 16)
    flexfa.flex_decode(q, k, v, kv_lens=_i32(32))
    flexfa.flex_decode(q, k, v, kv_lens=_i32(10), q_offsets=_i32(7))
    flexfa.flex_decode(q, k, v, q_offsets=_i32(29))
    with pytest.raises(InputError, match=r"kv_lens\[0\] = 33 is outside the cache's 0..32"):
        flexfa.flex_decode(q, k, v, kv_lens=_i32(33))
    with pytest.raises(InputError, match=r"q_offsets\[0\] = 8 puts the 3 query rows"):
        flexfa.flex_decode(q, k, v, kv_lens=_i32(10), q_offsets=_i32(8))
    with pytest.raises(InputError, match=r"q_offsets\[0\] = 30 puts the 3 query rows"):
        flexfa.flex_decode(q, k, v, q_offsets=_i32(30))


@pytest.mark.parametrize("walk", ["UNION", "MEMBERS"])
def test_last_row_alone_in_the_next_q_block(walk):
    """Rows at offsets 15, 16 with 16-row q blocks: only the last row is in q block 1, whose
    blocks the walk must visit (last_block one row short skips q block 1 in the
    members' walk; with two members the other member's row 15 must be masked in q block
    1's full blocks)."""
    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx
    B, Hq, Hkv, L, S = 2, 4, 2, 2, 64
    q, k, v = make_qkv(B, Hq, Hkv, L, S, 16, seed=22)
    offs = _i32(15, 31)
    mask = flexfa.create_block_mask(causal, None, None, S, S, device="cpu", BLOCK_SIZE=16)
    out, lse = flexfa.flex_decode(q, k, v, None, mask, q_offsets=offs, return_lse=True,
                                  kernel_options={"DECODE_WALK": walk, "SPLIT_KV": 2})
    assert_matches(out, lse, *reference_rows(q, k, v, None, causal, _i32(S, S), offs))


def test_a_ragged_last_mask_block_is_bounds_checked():
    """S = 192 under 128-key mask blocks, walked as 64-key tiles: S is a multiple of the tile,
    not of the mask block, so the last block's second tile (keys 192..255) lies past the cache
    and must be masked. The cache is a slice of a wider one whose keys past 192 would win the
    softmax (EVEN_S from S % BLOCK_N reads them unchecked)."""
    def everything(b, h, q_idx, kv_idx):
        return kv_idx >= 0
    B, Hq, Hkv, L, S = 1, 2, 1, 1, 192
    q, k, v = make_qkv(B, Hq, Hkv, L, 256, 16, seed=23)
    k[:, :, S:] = 50.0 * q[:, :1, :1]  # huge scores past S
    v[:, :, S:] = 1e3
    k, v = k[:, :, :S], v[:, :, :S]
    mask = flexfa.create_block_mask(everything, None, None, L, S, device="cpu", BLOCK_SIZE=128)
    out, lse = flexfa.flex_decode(q, k, v, None, mask, return_lse=True,
                                  kernel_options={"BLOCK_N": 64})
    assert_matches(out, lse, *reference_rows(q, k, v, None, everything, _i32(S), _i32(0)))


def test_cache_with_a_strided_head_dim():
    """K and V whose head dim is not the innermost (stride S): the kernel reads all four
    strides (a unit head-dim stride assumed for a contiguous-layout cache)."""
    B, Hq, Hkv, L, S = 2, 4, 2, 2, 40
    q = make_qkv(B, Hq, Hkv, L, S, 16, seed=24)[0]
    g = torch.Generator().manual_seed(25)
    k = torch.randn(B, Hkv, 16, S, generator=g).transpose(2, 3)
    v = torch.randn(B, Hkv, 8, S, generator=g).transpose(2, 3)
    lens = _i32(40, 17)
    out, lse = flexfa.flex_decode(q, k, v, kv_lens=lens, return_lse=True,
                                  kernel_options={"SPLIT_KV": 2})
    assert_matches(out, lse, *reference_rows(q, k, v, None, None, lens, lens - L))


@pytest.mark.parametrize("splits", [1, 3])
def test_a_sink_far_above_the_scores(splits):
    """A sink 100 above every score: lse = the sink (about 100), out about 0. The combine of
    the splits takes the sink into its max before exponentiating (exp(sink - max
    of the splits' lse) overflows float32 to inf, lse inf)."""
    B, Hq, Hkv, L, S = 1, 2, 1, 2, 64
    q, k, v = make_qkv(B, Hq, Hkv, L, S, 16, seed=26)
    sinks = torch.tensor([100.0, -3.0])
    out, lse = flexfa.flex_decode(q, k, v, sinks=sinks, return_lse=True,
                                  kernel_options={"SPLIT_KV": splits})
    ref_out, ref_lse = attention_reference(q, k, v, enable_gqa=True, sinks=sinks,
                                           return_lse=True)
    assert torch.isfinite(lse).all()
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)


def test_split_lse_and_row_max_through_flex_attention():
    """flex_attention's decode calls (L <= 16) with lse and max_scores over 3 splits: the
    splits' lse and row max are separate workspaces (PART_MAX aliasing PART_LSE,
    the row max overwrote each split's lse)."""
    B, Hq, Hkv, L, S = 1, 4, 2, 3, 96
    q, k, v = make_qkv(B, Hq, Hkv, L, S, 16, seed=27)
    out, aux = flexfa.flex_attention(q, k, v, enable_gqa=True,
                                     return_aux=flexfa.AuxRequest(lse=True, max_scores=True),
                                     kernel_options={"SPLIT_KV": 3, "BACKEND": "DECODE"})
    ref_out, ref_lse, ref_max = attention_reference(q, k, v, enable_gqa=True, return_lse=True,
                                                    return_max=True)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(aux.lse.double(), ref_lse, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(aux.max_scores.double(), ref_max, atol=2e-5, rtol=2e-5)
