"""varlen_block_mask: the tables equal create_block_mask's of the same documents' mask_mod
(written here independently, from document ids), the Triton kernels' tables equal the torch
path's, its mask_mod is that mask, new lengths keep the trace's key, and bad offsets fail
before anything is built."""
import dataclasses

import pytest
import torch
from hypothesis import given, strategies as st

import flexfa
from flexfa.blockmask import varlen_tables
from flexfa.blockmask.offsets import TokenTensors, check_offsets
from flexfa.blockmask.validate import TABLES
from flexfa.blockmask.varlen import document_block_mask
from flexfa.frontend import dense_mask

BLOCKS = [16, 32, (16, 32), (32, 16), 64, (48, 80)]


def offsets(lengths):
    return torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)


def reference_mod(q_lengths, k_lengths, causal, window):
    """Keep iff same document and, at in-document positions aligned at the documents' ends
    (query i of lq sits at key i + lk - lq), the causal / window condition."""
    lq, lk = torch.tensor(q_lengths), torch.tensor(k_lengths)
    doc_q = torch.repeat_interleave(torch.arange(len(lq)), lq)
    doc_k = torch.repeat_interleave(torch.arange(len(lk)), lk)
    aligned_q = torch.arange(len(doc_q)) - offsets(q_lengths)[doc_q] + (lk - lq)[doc_q]
    pos_k = torch.arange(len(doc_k)) - offsets(k_lengths)[doc_k]

    def mod(b, h, q_idx, kv_idx):
        keep = doc_q[q_idx] == doc_k[kv_idx]
        distance = aligned_q[q_idx] - pos_k[kv_idx]
        if causal:
            keep = keep & (distance >= 0)
        if window is not None:
            keep = keep & ((distance < window) if causal else (distance.abs() < window))
        return keep
    return mod


def assert_same_as_reference(q_lengths, k_lengths, causal, window, block):
    mask = flexfa.varlen_block_mask(offsets(q_lengths), offsets(k_lengths), causal=causal,
                                    window=window, BLOCK_SIZE=block)
    mod = reference_mod(q_lengths, k_lengths, causal, window)
    L, S = sum(q_lengths), sum(k_lengths)
    expected = flexfa.create_block_mask(mod, None, None, L, S, device="cpu", BLOCK_SIZE=block)
    for name in TABLES:
        assert torch.equal(getattr(mask, name), getattr(expected, name)), name
    assert mask.seq_lengths == (L, S) and mask.BLOCK_SIZE == expected.BLOCK_SIZE
    # the mask_mod, called torch-style with index tensors and through its (reused) trace
    want = flexfa.create_mask(mod, 1, 1, L, S, device="cpu")
    q_idx, kv_idx = torch.arange(L).view(1, 1, L, 1), torch.arange(S).view(1, 1, 1, S)
    zero = torch.zeros((), dtype=torch.int64)
    assert torch.equal(mask.mask_mod(zero, zero, q_idx, kv_idx).expand(1, 1, L, S), want)
    assert torch.equal(dense_mask(mask.traced_mask, 1, 1, L, S, "cpu"), want)
    return mask


lengths_strategy = st.lists(st.tuples(st.integers(0, 90), st.integers(0, 90)), min_size=1,
                            max_size=6).filter(lambda docs: all(sum(side) for side in zip(*docs)))


@given(docs=lengths_strategy, causal=st.booleans(),
       window=st.one_of(st.none(), st.integers(1, 40)), block=st.sampled_from(BLOCKS))
def test_tables_equal_create_block_mask(docs, causal, window, block):
    q_lengths, k_lengths = (list(side) for side in zip(*docs))
    assert_same_as_reference(q_lengths, k_lengths, causal, window, block)


@pytest.mark.parametrize("q_lengths,k_lengths", [
    ([100], [100]),  # one document
    ([232], [100]),  # more queries than keys: the first queries see nothing (causal)
    ([3, 5, 1, 7, 2, 9], [3, 5, 1, 7, 2, 9]),  # every document shorter than a block
    ([0, 40, 0, 0, 60, 0], [10, 40, 0, 30, 60, 5]),  # empty documents, first and last too
    ([5, 0, 70, 33], [9, 4, 40, 33]),
])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 17),
                                           (False, 9)])
def test_edge_documents(q_lengths, k_lengths, causal, window):
    assert_same_as_reference(q_lengths, k_lengths, causal, window, 32)


def test_tables_equal_torch_create_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    q_lengths, k_lengths = [70, 0, 150, 36], [70, 20, 100, 66]
    mod = reference_mod(q_lengths, k_lengths, True, None)
    mask = flexfa.varlen_block_mask(offsets(q_lengths), offsets(k_lengths), causal=True,
                                    BLOCK_SIZE=64)
    expected = torch_create_block_mask(mod, None, None, 256, 256, device="cpu", BLOCK_SIZE=64)
    for name in TABLES:
        assert torch.equal(getattr(mask, name), getattr(expected, name)), name


def test_new_lengths_keep_the_trace_key():
    """Lengths are data: the traced mask (the kernels' key) is the same for new lengths of the
    same total, and for any total under the same power of two; the offsets are copied."""
    first = flexfa.varlen_block_mask(offsets([100, 28, 72]), causal=True)
    cu = offsets([3, 150, 47])
    second = flexfa.varlen_block_mask(cu, causal=True)
    third = flexfa.varlen_block_mask(offsets([50, 60, 70, 13]), causal=True)
    assert first.traced_mask.key == second.traced_mask.key == third.traced_mask.key
    assert first.traced_mask.buffers[0] is not second.traced_mask.buffers[0]
    assert first.traced_mask.buffer_specs == ((((256,), torch.int32),) * 3)
    cu[1] = 50  # an edit of the caller's offsets does not reach the mask
    assert second.documents.offsets.cu_q.tolist() == [0, 3, 153, 200]
    assert flexfa.varlen_block_mask(offsets([10, 20]), window=4).traced_mask.key != \
        first.traced_mask.key


def assert_kernels_equal_torch(q_lengths, k_lengths, causal, window, block, device="cpu"):
    """The Triton kernels' tables and per-token tensors (interpreted on the CPU) equal the
    torch path's entry by entry."""
    checked = check_offsets("test", offsets(q_lengths), offsets(k_lengths), torch.device(device))
    block = (block, block) if isinstance(block, int) else block
    expected = document_block_mask(checked, causal, window, block, kernels=False)
    written = document_block_mask(checked, causal, window, block, kernels=True)
    for name in TABLES:
        assert torch.equal(getattr(written, name), getattr(expected, name)), name
    for field in dataclasses.fields(TokenTensors):
        assert torch.equal(getattr(written.documents.tokens, field.name),
                           getattr(expected.documents.tokens, field.name)), field.name
    assert written.traced_mask.key == expected.traced_mask.key


small_lengths = st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), min_size=1,
                         max_size=5).filter(lambda docs: all(sum(side) for side in zip(*docs)))


@given(docs=small_lengths, causal=st.booleans(),
       window=st.one_of(st.none(), st.integers(1, 30)),
       block=st.sampled_from([16, 32, (16, 32), (48, 80)]))
def test_table_kernels_equal_torch_tables(docs, causal, window, block):
    q_lengths, k_lengths = (list(side) for side in zip(*docs))
    assert_kernels_equal_torch(q_lengths, k_lengths, causal, window, block)


@pytest.mark.parametrize("q_lengths,k_lengths,causal,window,block", [
    ([0, 40, 0, 0, 60, 0], [10, 40, 0, 30, 60, 5], True, 17, 32),  # empty documents
    ([3, 5, 1, 7, 2, 9], [3, 5, 1, 7, 2, 9], False, 9, 16),  # all shorter than a block
    ([232], [100], True, None, (48, 80)),  # queries before the first key see none
])
def test_table_kernels_on_edge_documents(q_lengths, k_lengths, causal, window, block):
    assert_kernels_equal_torch(q_lengths, k_lengths, causal, window, block)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_table_kernels_on_the_gpu_with_a_window_near_int32(causal):
    """The CUDA table kernels take the capped window too (offsets.window_reach): a window at
    INT32_MAX keeps what no window keeps."""
    for q_lengths, k_lengths in (([10, 30], [10, 30]), ([30, 10], [10, 15])):
        assert_kernels_equal_torch(q_lengths, k_lengths, causal, 2 ** 31 - 1, 16, "cuda")
        cu_q, cu_k = (offsets(lengths).cuda() for lengths in (q_lengths, k_lengths))
        mask = flexfa.varlen_block_mask(cu_q, cu_k, causal=causal, window=2 ** 31 - 1,
                                        BLOCK_SIZE=16)
        same = flexfa.varlen_block_mask(cu_q, cu_k, causal=causal, BLOCK_SIZE=16)
        assert torch.equal(mask.to_dense(), same.to_dense())


@pytest.mark.gpu
def test_table_kernels_on_the_gpu_equal_torch_and_compile_once():
    """CUDA offsets take the kernels: the issue's 16 documents over 32k tokens, then new
    lengths (and new document counts) without a new compile."""
    generator = torch.Generator().manual_seed(0)
    kernel = varlen_tables.kernels(interpret=False).varlen_rows
    for documents in (16, 16, 5):
        cuts = (torch.randperm(32767, generator=generator)[:documents - 1] + 1).sort().values
        lengths = torch.cat([cuts, torch.tensor([32768])]).diff(prepend=torch.tensor([0]))
        assert_kernels_equal_torch(lengths.tolist(), lengths.tolist(), True, None, 128, "cuda")
        compiled = sum(len(cache[0]) for cache in kernel.device_caches.values())
        assert compiled == 1


@pytest.mark.parametrize("args,kwargs,error,words", [
    (([0, 3, 7],), {}, flexfa.InputTypeError, "cu_seqlens_q must be a 1-D int32"),
    ((torch.tensor([0.0, 3.0]),), {}, flexfa.InputTypeError, "torch.float32"),
    ((torch.tensor([[0, 3]]),), {}, flexfa.InputError, "shape (1, 2)"),
    ((torch.tensor([0]),), {}, flexfa.InputError, "at least 2 entries"),
    ((torch.tensor([0, 5, 3, 9]),), {}, flexfa.InputError, "decreases at index 2 (5 -> 3)"),
    ((torch.tensor([0, -2, 4]),), {}, flexfa.InputError, "cu_seqlens_q[1] is -2"),
    ((torch.tensor([2, 5]),), {}, flexfa.InputError, "cu_seqlens_q[0] is 2"),
    ((torch.tensor([0, 0]),), {}, flexfa.InputError, "holds no tokens"),
    ((torch.tensor([0, 5, 9]),), {"Q_LEN": 10}, flexfa.InputError,
     "cu_seqlens_q[-1] is 9 but query has 10 tokens"),
    ((torch.tensor([0, 5, 9]), torch.tensor([0, 9])), {}, flexfa.InputError,
     "cu_seqlens_q has 3 entries (2 documents) but cu_seqlens_k has 2 (1 documents)"),
    ((torch.tensor([0, 5, 9]), torch.tensor([0, 4, 9], device="meta")), {}, flexfa.InputError,
     "cu_seqlens_k is on meta but the attention runs on cpu"),
    ((torch.tensor([0, 9]),), {"window": 0}, flexfa.InputError, "window must be >= 1"),
    ((torch.tensor([0, 9]),), {"window": 2.5}, flexfa.InputTypeError, "window must be an int"),
    ((torch.tensor([0, 9]),), {"causal": 1}, flexfa.InputTypeError, "causal must be a bool"),
    # (numpy's TypeError for a sparse tensor escaped)
    ((torch.tensor([0, 9]).to_sparse(),), {}, flexfa.InputError,
     "cu_seqlens_q has layout torch.sparse_coo"),
    ((torch.tensor([0, 9]), torch.tensor([0, 9]).to_sparse()), {}, flexfa.InputError,
     "cu_seqlens_k has layout torch.sparse_coo"),
])
def test_bad_offsets(args, kwargs, error, words):
    with pytest.raises(error) as caught:
        flexfa.varlen_block_mask(*args, **kwargs)
    assert words in str(caught.value)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [2 ** 31 - 30, 2 ** 31 - 1, 2 ** 31, 2 ** 40, 2 ** 70])
def test_window_past_int32_keeps_every_key(window, causal):
    """A window past the int32 positions is no limit: the mask equals the one without a
    window. 2**40 gave an empty mask (int32 overflow in the table kernels), so
    varlen_attention returned zeros silently; 2**70 failed with OverflowError in torch; and
    without causal a window near INT32_MAX still wrapped in the tables' key ranges
    (diagonal + window): tiles of kept keys dropped, 24 of 40 rows out 0 and lse -inf."""
    for cu_q, cu_k in (([0, 10, 40], [0, 10, 40]), ([0, 30, 40], [0, 10, 25])):
        cu_q, cu_k = (torch.tensor(c, dtype=torch.int32) for c in (cu_q, cu_k))
        mask = flexfa.varlen_block_mask(cu_q, cu_k, causal=causal, window=window, BLOCK_SIZE=16)
        same = flexfa.varlen_block_mask(cu_q, cu_k, causal=causal, BLOCK_SIZE=16)
        assert torch.equal(mask.to_dense(), same.to_dense())
        lengths = [(cu[1:] - cu[:-1]).tolist() for cu in (cu_q, cu_k)]
        assert_kernels_equal_torch(*lengths, causal, min(window, 2 ** 31 - 1), 16)
        q, k = torch.randn(int(cu_q[-1]), 1, 16), torch.randn(int(cu_k[-1]), 1, 16)
        assert torch.equal(flexfa.varlen_attention(q, k, k, cu_q, cu_k, causal=causal,
                                                   window=window),
                           flexfa.varlen_attention(q, k, k, cu_q, cu_k, causal=causal))
