"""The varlen path at its edges, each case against an exact rule written here (document
membership, bottom-right causal and window on every (q, k) pair; the true document of every
token): a window wider than the keys, the table kernels at window edges, past one chunk of 64
tiles and past 1024 tokens (reached on the CPU with tiny tiles; only GPU tests reached them),
the host and device offset checks (a decrease by one, either side alone, past 1024
documents, the longest document per side) and the score_mod read checks at unequal query and
key lengths. From the forty-seventh session's mutation audit of blockmask/varlen*.py and the
packed entry point: each test failed under a mutant the rest of the suite let pass, every one
of which gave wrong tables or outputs or accepted bad offsets; the parenthesis that opens a
docstring names that defect. CPU only (the table kernels through Triton's interpreter)."""
import functools
import pytest
import torch

import flexfa
from flexfa.blockmask.offsets import check_offsets
from flexfa.blockmask.validate import TABLES
from flexfa.blockmask.varlen import checked_block_mask, document_block_mask

CPU = torch.device("cpu")


def offsets(lengths):
    return torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)


def token_info(lengths):
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return doc, torch.arange(len(doc)) - offsets(lengths).long()[doc]


def dense(q_lengths, k_lengths, causal, window):
    """The exact mask: same document, and at positions aligned at the documents' ends
    (query i of lq at key i + lk - lq), causal / window."""
    dq, pq = token_info(q_lengths)
    dk, pk = token_info(k_lengths)
    shift = (torch.tensor(k_lengths) - torch.tensor(q_lengths))[dq]
    distance = (pq + shift)[:, None] - pk[None, :]
    keep = dq[:, None] == dk[None, :]
    if causal:
        keep &= distance >= 0
    if window is not None:
        keep &= (distance < window) if causal else (distance.abs() < window)
    return keep


def _rows(num, idx):
    return [idx[0, 0, r, :int(num[0, 0, r])].tolist() for r in range(num.shape[-1])]


def assert_tables_sound(mask, keep):
    """Every tile listed full keeps all its pairs (and lies inside L x S); every tile not
    listed keeps none; kv side and q side; and the mask_mod is the exact mask."""
    bq, bk = mask.BLOCK_SIZE
    L, S = keep.shape
    for side, rows, width in (("kv", -(-L // bq), -(-S // bk)), ("q", -(-S // bk), -(-L // bq))):
        partial = _rows(getattr(mask, f"{side}_num_blocks"), getattr(mask, f"{side}_indices"))
        full = _rows(getattr(mask, f"full_{side}_num_blocks"),
                     getattr(mask, f"full_{side}_indices"))
        assert len(partial) == len(full) == rows
        for r in range(rows):
            assert not set(partial[r]) & set(full[r]), (side, r)
            assert len(set(partial[r])) == len(partial[r]) and len(set(full[r])) == len(full[r])
            for c in range(width):
                i, j = (r, c) if side == "kv" else (c, r)
                tile = keep[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
                if c in full[r]:
                    assert (i + 1) * bq <= L and (j + 1) * bk <= S and bool(tile.all()), \
                        f"{side} tile ({i}, {j}) listed full has masked pairs"
                elif c not in partial[r]:
                    assert not bool(tile.any()), f"{side} tile ({i}, {j}) skipped has kept pairs"
    q_idx, kv_idx = torch.arange(L).view(L, 1), torch.arange(S).view(1, S)
    zero = torch.zeros((), dtype=torch.int64)
    assert torch.equal(mask.mask_mod(zero, zero, q_idx, kv_idx).expand(L, S), keep)


def kernel_mask(q_lengths, k_lengths, causal, window, block):
    """The mask CUDA offsets get (the two table kernels), interpreted on the CPU."""
    checked = check_offsets("test", offsets(q_lengths), offsets(k_lengths), CPU)
    return document_block_mask(checked, causal, window, block, kernels=True)


def torch_mask(q_lengths, k_lengths, causal, window, block):
    return flexfa.varlen_block_mask(offsets(q_lengths), offsets(k_lengths), causal=causal,
                                    window=window, BLOCK_SIZE=block)


@pytest.mark.parametrize("build", [torch_mask, kernel_mask], ids=["torch", "kernels"])
@pytest.mark.parametrize("q_lengths,k_lengths,window", [([100], [20], 1000),
                                                         ([5, 100], [3, 20], 64)])
def test_window_wider_than_the_keys_keeps_early_queries(build, q_lengths, k_lengths, window):
    """(window_reach capped at total_k + 1): without causal, a query far before its
    document's end (more queries than keys) keeps every key of a wide window; the tables'
    capped window cut its range and skipped tiles of kept keys (out 0, lse -inf)."""
    mask = build(q_lengths, k_lengths, False, window, (16, 16))
    assert_tables_sound(mask, dense(q_lengths, k_lengths, False, window))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("q_lengths,k_lengths,window,block", [
    ([9], [10], 2, 2), ([10], [10], 3, 2), ([3, 8], [2, 9], 3, 2), ([9], [10], 4, 2),
    ([17], [18], 7, 4), ([3, 8], [2, 9], 2, 2)])
def test_kernel_tables_at_window_edges(causal, q_lengths, k_lengths, window, block):
    """(the table kernels' window one key too wide: lo = diag - window, or
    hi = diag + window + 1 without causal): at windows of one or two tiles a tile missing one
    pair was listed full (the pair attended unmasked); the CI windows never hit the edge."""
    mask = kernel_mask(q_lengths, k_lengths, causal, window, (block, block))
    assert_tables_sound(mask, dense(q_lengths, k_lengths, causal, window))
    same = torch_mask(q_lengths, k_lengths, causal, window, block)
    for name in TABLES:
        assert torch.equal(getattr(mask, name), getattr(same, name)), name


@pytest.mark.parametrize("q_lengths,k_lengths,causal,window,block", [
    ([70, 0, 62], [60, 5, 66], True, None, (2, 2)),  # 66 x 66 tiles: both sides past a chunk
    ([40, 110], [150, 3], False, 9, (2, 4)),  # 75 q tiles: the q-side tables' chunks
])
def test_kernel_tables_past_one_chunk_of_tiles(q_lengths, k_lengths, causal, window, block):
    """(the table kernels' ordered rows across CHUNK = 64 tiles: the set
    count or the ranks not carried from one chunk to the next): more than 64 tiles in a row
    or a column, as with 16-token tiles past 1024 tokens on a GPU. Only the GPU tests reached
    a second chunk; tiny tiles reach it on the CPU."""
    mask = kernel_mask(q_lengths, k_lengths, causal, window, block)
    assert_tables_sound(mask, dense(q_lengths, k_lengths, causal, window))
    same = torch_mask(q_lengths, k_lengths, causal, window, block)
    for name in TABLES:
        assert torch.equal(getattr(mask, name), getattr(same, name)), name


def test_kernel_token_tensors_past_1024_tokens():
    """(the per-token blocks of TOKENS = 1024: a wrong block stride, or
    positions written in the first block only): past 1536 tokens the documents, the
    in-document positions the score_mod reads and the diagonals are those of each token."""
    q_lengths, k_lengths = [700, 0, 900, 33], [650, 10, 950, 20]
    mask = kernel_mask(q_lengths, k_lengths, True, 64, (256, 256))
    tokens = mask.documents.tokens
    dq, pq = token_info(q_lengths)
    dk, pk = token_info(k_lengths)
    diag = torch.arange(len(dq)) + (offsets(k_lengths)[1:] - offsets(q_lengths)[1:]).long()[dq]
    for name, want in (("doc_q", dq), ("pos_q", pq), ("doc_k", dk), ("pos_k", pk), ("diag", diag)):
        got = getattr(tokens, name)[:len(want)].long()
        assert torch.equal(got, want), (name, int((got != want).sum()))
    assert_tables_sound(mask, dense(q_lengths, k_lengths, True, 64))


def device_mask(cu_q, cu_k, totals):
    return checked_block_mask("test", cu_q, cu_k, CPU, totals, True, None, (256, 256),
                              kernels=True)


@pytest.mark.parametrize("totals", [(None, None), (9, 9)])
def test_device_checks_refuse_a_decrease_by_one_and_bad_key_offsets(totals):
    """(the device checks missed a decrease by one) and 54 (the key offsets'
    flags ignored): offsets the host refuses are refused on the CUDA path too, on either
    side alone (the device test gave both sides the same values)."""
    good = torch.tensor([0, 4, 5, 9], dtype=torch.int32)
    drop = torch.tensor([0, 5, 4, 9], dtype=torch.int32)
    with pytest.raises(flexfa.InputError, match="decreases at index 2"):
        device_mask(drop, good, totals)
    with pytest.raises(flexfa.InputError, match="cu_seqlens_k decreases at index 2"):
        device_mask(good, drop, totals)
    with pytest.raises(flexfa.InputError, match="cu_seqlens_k decreases at index 2"):
        device_mask(good, torch.tensor([0, 7, 3, 9], dtype=torch.int32), totals)


def test_host_checks_refuse_a_decrease_by_one():
    """(the host checks accepted a decrease by one: test_bad_offsets drops by 2):
    CPU offsets decreasing by one are refused before any table is built."""
    drop = torch.tensor([0, 5, 4, 9], dtype=torch.int32)
    with pytest.raises(flexfa.InputError, match=r"decreases at index 2 \(5 -> 4\)"):
        flexfa.varlen_block_mask(drop)
    q = torch.randn(9, 1, 16)
    with pytest.raises(flexfa.InputError, match=r"decreases at index 2 \(5 -> 4\)"):
        flexfa.varlen_attention(q, q, q, drop, drop)


@pytest.mark.parametrize("totals", [(None, None), (1200, 1200)])
def test_device_checks_past_one_chunk_of_documents(totals):
    """(the device checks' decreases or longest document kept from the last
    chunk of 1024 entries only): 1200 documents, a decrease and the longest document in the
    first chunk."""
    many = torch.arange(1201, dtype=torch.int32)
    many[5], many[6] = 6, 5
    with pytest.raises(flexfa.InputError, match="decreases at index 6"):
        device_mask(many, many.clone(), totals)
    lengths = [50] + [1] * 1150
    found = device_mask(offsets(lengths), offsets(lengths),
                        (None, None) if totals[0] is None else (1200, 1200)).documents.offsets
    assert (found.max_q, found.max_k) == (50, 50)


def test_device_longest_documents_per_side(monkeypatch):
    """(the device path's longest query / key documents swapped): they bound the
    score_mod's read checks; swapped, a table too short for the 40-query document was
    accepted and read with clamped indices."""
    q_lengths, k_lengths = [40, 5], [10, 5]
    for totals in ((None, None), (45, 15)):
        found = device_mask(offsets(q_lengths), offsets(k_lengths), totals).documents.offsets
        assert (found.max_q, found.max_k) == (40, 10)
    import flexfa.varlen as varlen_module
    table = torch.randn(10)
    q, k = torch.randn(45, 1, 16), torch.randn(15, 1, 16)
    monkeypatch.setattr(varlen_module, "checked_block_mask",  # CUDA's path
                        functools.partial(varlen_module.checked_block_mask, kernels=True))
    with pytest.raises(flexfa.InputError):
        flexfa.varlen_attention(q, k, k, offsets(q_lengths), offsets(k_lengths),
                                score_mod=lambda s, b, h, q_idx, kv_idx: s + table[q_idx])


def test_score_mod_reads_checked_at_the_longest_query_document():
    """(the first read check bounded q_idx by the longest key document): a table
    read at q_idx with 10 entries, 40 queries and 10 keys in a document, is refused (it was
    run with clamped reads)."""
    table = torch.randn(10)
    q, k = torch.randn(45, 2, 16), torch.randn(15, 1, 16)
    with pytest.raises(flexfa.InputError):
        flexfa.varlen_attention(q, k, k, offsets([40, 5]), offsets([10, 5]),
                                score_mod=lambda s, b, h, q_idx, kv_idx: s + table[q_idx])


def test_score_mod_reads_checked_per_document_at_its_query_length():
    """(the per-document read check took lk queries and lq keys): a packed
    per-query table one entry short (the last query of document 1, 30 queries and 10 keys)
    is refused, naming the document."""
    q_lengths, k_lengths = [10, 30], [30, 10]
    starts = offsets(q_lengths).long()
    per_query = torch.randn(sum(q_lengths) - 1)
    q, k = torch.randn(40, 2, 16), torch.randn(40, 1, 16)
    with pytest.raises(flexfa.InputError, match="in document 1"):
        flexfa.varlen_attention(q, k, k, offsets(q_lengths), offsets(k_lengths),
                                score_mod=lambda s, b, h, q_idx, kv_idx:
                                s + per_query[starts[b] + q_idx])
