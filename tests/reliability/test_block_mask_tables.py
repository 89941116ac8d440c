"""Block-mask tables are checked before any kernel reads them: an entry edited in place to an
out-of-range value, a tile listed twice, a tile both partial and full, or q tables that are not
the kv tables transposed is an InputError naming the table and the value, on the call after
the edit (flexfa and torch BlockMasks). Valid edits, in place or by replacing a table, are used
by the next call; unchanged tables are not checked again."""
import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

import flexfa
from flexfa import BlockMask
from flexfa.blockmask import validate
from flexfa.blockmask.tables import dense_to_ordered, transpose_ordered
from flexfa.reference import attention_reference
from reference import assert_close_to_reference
from .inputs import qkv

TABLES = validate.TABLES
L = S = 100  # 7 x 7 tiles of 16, the last ragged


def _band(b, h, q_idx, kv_idx):  # partial and full tiles in most rows
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 70)


def _window(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx < 20) & (kv_idx - q_idx < 20)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _masks(kind, mask_mod=_band, H=2, device="cpu"):
    if kind == "torch":
        return torch_create_block_mask(mask_mod, 1, H, L, S, device=device, BLOCK_SIZE=16)
    return flexfa.create_block_mask(mask_mod, 1, H, L, S, device=device, BLOCK_SIZE=16)


_FLEXFA = _masks("flexfa")


def _fresh(kind):
    """A mask with its own tables: a torch BlockMask, or a flexfa one (never checked yet)."""
    if kind == "torch":
        return _masks("torch")
    return BlockMask(_FLEXFA.seq_lengths, *(getattr(_FLEXFA, n).clone() for n in TABLES),
                     BLOCK_SIZE=_FLEXFA.BLOCK_SIZE, mask_mod=_FLEXFA.mask_mod)


def _call(mask, device="cpu", **kwargs):
    q, k, v = (t.to(device) for t in qkv(Hq=2, Hkv=2, L=L, S=S, **kwargs))
    return flexfa.flex_attention(q, k, v, block_mask=mask)


def _listed_entry(num_blocks, data, at_least=1):
    """(b, h, row, column) of a listed entry of a row with at least ``at_least`` entries."""
    rows = (num_blocks >= at_least).nonzero().tolist()
    b, h, row = data.draw(st.sampled_from(rows))
    column = data.draw(st.integers(at_least - 1, int(num_blocks[b, h, row]) - 1))
    return b, h, row, column


# each fault and kind apart (drawn from one list, CI's 15 examples never met "tile dropped")
@pytest.mark.parametrize("fault", ["index past the tiles", "negative index", "count past the row",
                                   "negative count", "tile listed twice", "tile dropped"])
@pytest.mark.parametrize("kind", ["flexfa", "torch"])
@settings(max_examples=4)
@given(pair=st.sampled_from(["kv", "full_kv", "q", "full_q"]), data=st.data())
def test_a_corrupted_table_is_an_input_error_before_launch(kind, pair, fault, data):
    mask = _fresh(kind)
    num_blocks, indices = getattr(mask, f"{pair}_num_blocks"), getattr(mask, f"{pair}_indices")
    tiles, width = 7, indices.shape[-1]
    if fault in ("index past the tiles", "negative index"):
        at = _listed_entry(num_blocks, data)
        value = data.draw(st.integers(tiles, tiles + 1000) if fault == "index past the tiles"
                          else st.integers(-1000, -1))
        indices[at] = value
        match = rf"block_mask\.{pair}_indices\[{', '.join(map(str, at))}\] is {value}; .* 0\.\.6"
        if fault == "index past the tiles":  # skipped (torch masks it): its partner lists it
            match = "must be the kv tables transposed"
    elif fault in ("count past the row", "negative count"):
        at = data.draw(st.sampled_from(torch.ones_like(num_blocks).nonzero().tolist()))
        value = data.draw(st.integers(width + 1, width + 1000) if fault == "count past the row"
                          else st.integers(-1000, -1))
        num_blocks[tuple(at)] = value
        match = rf"block_mask\.{pair}_num_blocks\[{', '.join(map(str, at))}\] is {value}; "
    elif fault == "tile listed twice":
        b, h, row, column = _listed_entry(num_blocks, data, at_least=2)
        tile = int(indices[b, h, row, column - 1])
        indices[b, h, row, column] = tile
        match = rf"block_mask\.{pair}_indices\[{b}, {h}, {row}\] lists tile {tile} 2 times"
    else:  # a valid table on its own, no longer the transpose of its partner
        b, h, row, _ = _listed_entry(num_blocks, data)
        num_blocks[b, h, row] -= 1
        match = "must be the kv tables transposed"
    with pytest.raises(flexfa.InputError, match=match):
        _call(mask)


@pytest.mark.parametrize("kind", ["flexfa", "torch"])
def test_a_tile_both_partial_and_full_is_rejected(kind):
    mask = _fresh(kind)
    row = int((mask.full_kv_num_blocks[0, 0] > 0).nonzero()[0])
    tile = int(mask.full_kv_indices[0, 0, row, 0])
    count = int(mask.kv_num_blocks[0, 0, row])
    mask.kv_indices[0, 0, row, count] = tile  # listed as partial too
    mask.kv_num_blocks[0, 0, row] += 1
    for table, value in zip(("q_num_blocks", "q_indices"),
                            transpose_ordered(mask.kv_num_blocks, mask.kv_indices)):
        getattr(mask, table).copy_(value)  # the q tables stay the kv tables transposed
    with pytest.raises(flexfa.InputError, match=f"both list kv tile {tile} of q tile {row}"):
        _call(mask)


@pytest.mark.parametrize("kind", ["flexfa", "torch"])
@pytest.mark.parametrize("device", DEVICES)
def test_an_edit_after_a_successful_call_is_caught_on_the_next_call(kind, device):
    mask = _masks(kind, device=device)
    reference = _call(mask, device)
    torch.testing.assert_close(_call(mask, device), reference)  # unchanged: fine
    assert mask.kv_num_blocks[0, 1, 3] > 0
    listed = int(mask.kv_indices[0, 1, 3, 0])
    mask.kv_indices[0, 1, 3, 0] = -99
    with pytest.raises(flexfa.InputError, match=r"kv_indices\[0, 1, 3, 0\] is -99"):
        _call(mask, device)
    mask.kv_indices[0, 1, 3, 0] = listed  # repaired in place: accepted again
    torch.testing.assert_close(_call(mask, device), reference)


def test_an_edit_between_forward_and_backward_is_caught_in_the_backward():
    mask = _masks("flexfa")
    q, k, v = (t.requires_grad_() for t in qkv(Hq=2, Hkv=2, L=L, S=S))
    out = flexfa.flex_attention(q, k, v, block_mask=mask)
    mask.q_indices.view(-1)[0] = -7  # an edit through a view
    with pytest.raises(flexfa.InputError, match=r"q_indices\[0, 0, 0, 0\] is -7"):
        out.sum().backward()


@pytest.mark.parametrize("ds", [False, True])
def test_a_valid_in_place_edit_is_used_by_the_next_call(ds):
    """The band mask's tables overwritten in place with a window mask's: the next forward and
    backward (also with the dS workspace, whose block slots come from the q tables) follow
    the new tables."""
    options = {"DS_WORKSPACE": ds}
    mask, window = _masks("flexfa", H=1), _masks("flexfa", _window, H=1)
    q, k, v = (t.requires_grad_() for t in qkv(Hq=1, Hkv=1, L=L, S=S))
    flexfa.flex_attention(q, k, v, block_mask=mask, kernel_options=options).sum().backward()
    for name in TABLES:
        getattr(mask, name).copy_(getattr(window, name))
    mask.mask_mod = _window
    q.grad = k.grad = v.grad = None
    out = flexfa.flex_attention(q, k, v, block_mask=mask, kernel_options=options)
    out.sum().backward()
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out = attention_reference(*ref, mask_mod=_window)
    ref_out.sum().backward()
    eager = attention_reference(*(t.detach() for t in (q, k, v)), mask_mod=_window,
                                dtype=torch.float32)
    assert_close_to_reference(out, ref_out, eager)
    for got, want in zip((q.grad, k.grad, v.grad), (t.grad for t in ref)):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


def _tile_mask(keep):
    """A mask of whole 16 x 16 tiles (all full, mask_mod noop) where ``keep(i, j)`` of tile
    indices, and its mask_mod for the reference."""
    tiles = torch.arange(7)
    full = keep(tiles[:, None], tiles[None, :]).expand(1, 1, 7, 7)
    none = torch.zeros(1, 1, 7, dtype=torch.int32)
    mask = BlockMask.from_kv_blocks(none, torch.zeros(1, 1, 7, 7, dtype=torch.int32),
                                    *dense_to_ordered(full), BLOCK_SIZE=16, seq_lengths=(L, S))
    return mask, lambda b, h, q_idx, kv_idx: keep(q_idx // 16, kv_idx // 16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("template", ["AMPERE", "HOPPER"])
def test_a_replaced_table_is_used_by_the_next_call(template, device):
    """Replacing the tables of a mask (not in place) after a call: the cached launch plan of
    the first call (keyed by the mask object and its mods) must not keep the old tables."""
    options = {"BACKEND": template}
    mask, _ = _tile_mask(lambda i, j: i >= j)
    near, near_mod = _tile_mask(lambda i, j: (i - j).abs() <= 1)
    mask, near = mask.to(device), near.to(device)
    q, k, v = qkv(Hq=1, Hkv=1, L=L, S=S, dtype=torch.bfloat16)
    for _ in range(2):  # the second call takes the cached (direct) launch
        flexfa.flex_attention(*(t.to(device) for t in (q, k, v)), block_mask=mask,
                              kernel_options=options)
    for name in TABLES:
        setattr(mask, name, getattr(near, name))
    out = flexfa.flex_attention(*(t.to(device) for t in (q, k, v)), block_mask=mask,
                                kernel_options=options).cpu()
    exact = attention_reference(q, k, v, mask_mod=near_mod)
    eager = attention_reference(q, k, v, mask_mod=near_mod, dtype=torch.bfloat16)
    assert_close_to_reference(out, exact, eager)


def test_an_in_place_edit_of_a_mask_without_q_tables_reaches_the_backward():
    """A mask from ``from_kv_blocks(compute_q_blocks=False)``: dK/dV walk q tables transposed
    from the kv tables. After kv tables edited in place (mask_mod unchanged), the backward's
    cached plan held the first call's transposed tables: dK and dV of the old mask."""
    lower, _ = _tile_mask(lambda i, j: i >= j)
    upper, upper_mod = _tile_mask(lambda i, j: i <= j)
    kv_tables = TABLES[:4]
    mask = BlockMask.from_kv_blocks(*(getattr(lower, n).clone() for n in kv_tables),
                                    BLOCK_SIZE=16, seq_lengths=(L, S), compute_q_blocks=False)
    q, k, v = (t.requires_grad_() for t in qkv(Hq=1, Hkv=1, L=L, S=S))
    flexfa.flex_attention(q, k, v, block_mask=mask).sum().backward()
    for name in kv_tables:
        getattr(mask, name).copy_(getattr(upper, name))
    q.grad = k.grad = v.grad = None
    flexfa.flex_attention(q, k, v, block_mask=mask).sum().backward()
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    attention_reference(*ref, mask_mod=upper_mod).sum().backward()
    for got, want in zip((q.grad, k.grad, v.grad), (t.grad for t in ref)):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


def _by_batch(b, h, q_idx, kv_idx):  # batch 1 drops the first 40 keys
    return (kv_idx <= q_idx) & ((b == 0) | (kv_idx >= 40))


def test_tables_reshaped_in_place_by_set_are_read_with_their_new_strides():
    """Tables built for B=1 (broadcast), then ``set_`` in place to tables of two batches:
    the same objects, so the launch plan of the first call (which fixes the tables' strides,
    0 along the broadcast batch) was taken again, and batch 1 read batch 0's tables. (The
    first tables list every tile as partial: only such tables of batch 1 may serve a mask_mod
    reading b for two batches.)"""
    tiles = -(-L // 16)
    every = torch.arange(tiles, dtype=torch.int32).expand(1, 1, tiles, tiles).contiguous()
    mask = flexfa.BlockMask.from_kv_blocks(
        torch.full((1, 1, tiles), tiles, dtype=torch.int32), every,
        torch.zeros(1, 1, tiles, dtype=torch.int32), torch.zeros_like(every), BLOCK_SIZE=16,
        mask_mod=_by_batch, seq_lengths=(L, S))
    two = flexfa.create_block_mask(_by_batch, 2, 1, L, S, device="cpu", BLOCK_SIZE=16)
    q, k, v = qkv(B=2, Hq=1, Hkv=1, L=L, S=S)
    flexfa.flex_attention(q, k, v, block_mask=mask)
    for name in TABLES:
        getattr(mask, name).set_(getattr(two, name).clone())
    out = flexfa.flex_attention(q, k, v, block_mask=mask)
    exact = attention_reference(q, k, v, mask_mod=_by_batch)
    eager = attention_reference(q, k, v, mask_mod=_by_batch, dtype=torch.float32)
    assert_close_to_reference(out, exact, eager)


@pytest.mark.parametrize("change", ["batch", "width"])
def test_tables_reshaped_in_place_by_set_are_checked_against_the_call_again(change):
    """A call's shape and block-mask checks are skipped for a signature that passed them, the
    same table objects included: tables ``set_`` in place to 3 batches for a call of 2 (or to
    fewer columns than the tiles of S) went unchecked where a new mask is refused (3 batches
    for a call of 3 that had passed with 1 read past the tables: a crash)."""
    q, k, v = qkv(B=2, Hq=1, Hkv=1, L=L, S=S)
    mask = flexfa.create_block_mask(_band, 1, 1, L, S, device="cpu", BLOCK_SIZE=16)
    flexfa.flex_attention(q, k, v, block_mask=mask)
    if change == "batch":
        three = flexfa.create_block_mask(_band, 3, 1, L, S, device="cpu", BLOCK_SIZE=16)
        for name in TABLES:
            getattr(mask, name).set_(getattr(three, name).clone())
        message = "built for \\(B=3"
    else:  # the band lists at most 6 of the 7 kv tiles a row: the contents still pass
        for name in ("kv_indices", "full_kv_indices"):
            getattr(mask, name).set_(getattr(mask, name)[..., :6].clone())
        message = "7 x 6 tiles"
    with pytest.raises(flexfa.errors.InputError, match=message):
        flexfa.flex_attention(q, k, v, block_mask=mask)


def _same_tile_of_64(b, h, q_idx, kv_idx):
    return q_idx // 64 == kv_idx // 64


def test_a_block_size_assigned_after_a_call_is_used_by_the_next_call():
    """Tables of 4 x 4 diagonal tiles of 32 (each q tile attends its own kv tile), then
    ``BLOCK_SIZE = (64, 64)``: the first 2 x 2 of the same tables, tiles of 64. The launch plan
    of the first call (specialized on the block size) was taken again."""
    rows = torch.arange(4, dtype=torch.int32).view(1, 1, 4, 1).expand(1, 1, 4, 4).contiguous()
    none = torch.zeros(1, 1, 4, dtype=torch.int32)
    mask = BlockMask.from_kv_blocks(none, rows, torch.ones_like(none), rows, BLOCK_SIZE=32,
                                    seq_lengths=(128, 128))
    q, k, v = qkv(Hq=1, Hkv=1, L=128, S=128)
    flexfa.flex_attention(q, k, v, block_mask=mask)
    mask.BLOCK_SIZE = (64, 64)
    out = flexfa.flex_attention(q, k, v, block_mask=mask)
    exact = attention_reference(q, k, v, mask_mod=_same_tile_of_64)
    eager = attention_reference(q, k, v, mask_mod=_same_tile_of_64, dtype=torch.float32)
    assert_close_to_reference(out, exact, eager)


def test_tables_are_checked_once_per_state(monkeypatch):
    """flexfa's own masks need no check; a torch mask is checked on its first call, again
    after an in-place edit (also through a view) or a replaced table, not otherwise."""
    checks = []
    original = validate.check_contents
    monkeypatch.setattr(validate, "check_contents",
                        lambda *a, **k: checks.append(a) or original(*a, **k))
    _call(_masks("flexfa"))
    assert checks == []
    mask = _masks("torch")
    counts = []
    for change in (None, None, "edit", None, "view edit", "replace", None):
        if change == "edit":
            mask.kv_indices[0, 0, 0, 0] = mask.kv_indices[0, 0, 0, 0]
        elif change == "view edit":
            mask.full_q_indices[0, 0, 0].add_(0)
        elif change == "replace":
            mask.q_indices = mask.q_indices.clone()
        validate.check_tables(mask, L, S)
        counts.append(len(checks))
    assert counts == [1, 1, 2, 2, 3, 4, 4]


def _aliased(mask):
    """A new BlockMask object around aliases of ``mask``'s tables (what a compiled graph's
    operators rebuild from its inputs and autograd's saved tensors)."""
    return BlockMask(mask.seq_lengths, *(getattr(mask, n).detach()[:] for n in TABLES),
                     BLOCK_SIZE=mask.BLOCK_SIZE, mask_mod=mask.mask_mod)


def test_aliases_of_checked_tables_need_no_check_until_edited_or_freed(monkeypatch):
    checks = []
    original = validate.check_contents
    monkeypatch.setattr(validate, "check_contents",
                        lambda *a, **k: checks.append(a) or original(*a, **k))
    mask = _masks("flexfa")
    for _ in range(2):
        validate.check_tables(_aliased(mask), L, S)
    assert checks == []  # the tables flexfa built, through two other mask objects
    validate.check_tables(_aliased(mask), L - 2, S - 2)
    assert len(checks) == 1  # another geometry is checked
    alias = _aliased(mask)
    alias.kv_indices[0, 0, 0, 0] = -99  # an edit through an alias: the next mask checks
    with pytest.raises(flexfa.InputError, match="kv_indices"):
        validate.check_tables(_aliased(mask), L, S)
    assert len(checks) == 2
    # a freed table's address may hold a new table: a record of a dead storage is not taken
    tables = [getattr(_masks("flexfa"), n).clone() for n in TABLES]
    fresh = BlockMask(_FLEXFA.seq_lengths, *tables, BLOCK_SIZE=16, mask_mod=_band)
    validate.mark_checked(fresh)
    key, refs = validate._storage_key(tables, (fresh.BLOCK_SIZE, L, S))
    assert validate._checked_before(tables, (fresh.BLOCK_SIZE, L, S)) is False  # (no tile past)
    del fresh, tables
    assert all(ref.expired() for ref in refs)
    recorded = validate._CHECKED._memo.get(key)  # still recorded, its storages gone: a new
    assert recorded and all(ref.expired() for ref in recorded[1])  # table there is not taken
    assert validate._CHECKED.get(key) is None  # for them


def test_storage_signatures_of_aliases_match_and_odd_tensors_have_none():
    table = torch.arange(12, dtype=torch.int32).view(3, 4)
    same, other = validate.storage_signature([table]), validate.storage_signature([table[1:]])
    assert validate.storage_signature([table.detach()[:]])[0] == same[0] != other[0]
    table.add_(0)  # an edit moves the version
    assert validate.storage_signature([table])[0] != same[0]
    assert validate.storage_signature([table], versions=False)[0] == \
        validate.storage_signature([table.detach()], versions=False)[0]
    with torch.inference_mode():
        frozen = torch.zeros(3)
    assert validate.storage_signature([frozen]) is None  # no version counter
    assert validate.storage_signature([torch.zeros(3).to_sparse()]) is None  # no storage


def test_inference_tensors_are_checked_on_every_call(monkeypatch):
    with torch.inference_mode():
        mask = _masks("flexfa")
    checks = []
    original = validate.check_contents
    monkeypatch.setattr(validate, "check_contents",
                        lambda *a, **k: checks.append(a) or original(*a, **k))
    for expected in (1, 2):
        validate.check_tables(mask, L, S)
        assert len(checks) == expected
    assert validate.table_generations(mask)[1] is None  # edits cannot be seen: no memos


def test_from_kv_blocks_checks_listed_entries_only():
    """Entries past a row's count are never read (torch pads them): any value is accepted;
    a tile listed twice, or both partial and full, is not."""
    num_blocks = torch.tensor([[1, 2, 0, 1]], dtype=torch.int32)
    indices = torch.tensor([[[0, 99, -5, 7], [0, 1, 42, -1], [3, 3, 3, 3], [3, 0, 0, 0]]],
                           dtype=torch.int32)
    mask = BlockMask.from_kv_blocks(num_blocks, indices, BLOCK_SIZE=16, seq_lengths=(64, 64))
    clean = BlockMask.from_kv_blocks(num_blocks, indices.clamp(0, 3), BLOCK_SIZE=16,
                                     seq_lengths=(64, 64))
    q, k, v = qkv(L=64, S=64)
    torch.testing.assert_close(flexfa.flex_attention(q, k, v, block_mask=mask),
                               flexfa.flex_attention(q, k, v, block_mask=clean))
    twice = indices.clone()
    twice[0, 1, 1] = 0
    with pytest.raises(flexfa.InputError, match=r"from_kv_blocks: kv_indices\[0, 0, 1\] lists "
                                                "tile 0 2 times"):
        BlockMask.from_kv_blocks(num_blocks, twice, BLOCK_SIZE=16, seq_lengths=(64, 64))
    with pytest.raises(flexfa.InputError, match="both list kv tile 0 of q tile 0"):
        BlockMask.from_kv_blocks(num_blocks, indices, num_blocks, indices, BLOCK_SIZE=16,
                                 seq_lengths=(64, 64))


@pytest.mark.parametrize("past", [3, 99])
def test_an_index_past_the_lengths_tiles_adds_nothing(past):
    """A table wider than the lengths need (4 x 4 tiles for 40 x 40), or an index past the
    table: a listed tile past S's tiles (torch's _adjust leaves such; its kernels mask their
    positions) is skipped, never read, as if the row did not list it."""
    num_blocks = torch.ones(1, 1, 4, dtype=torch.int32)
    indices = torch.zeros(1, 1, 4, 4, dtype=torch.int32)
    indices[0, 0, 1, 0] = past  # S = 40 has kv tiles 0..2
    mask = BlockMask.from_kv_blocks(num_blocks, indices, BLOCK_SIZE=16, seq_lengths=(40, 40))
    without = num_blocks.clone()
    without[0, 0, 1] = 0
    clean = BlockMask.from_kv_blocks(without, indices, BLOCK_SIZE=16, seq_lengths=(40, 40))
    q, k, v = qkv(L=40, S=40)
    torch.testing.assert_close(flexfa.flex_attention(q, k, v, block_mask=mask),
                               flexfa.flex_attention(q, k, v, block_mask=clean))


def test_during_a_cuda_graph_capture_the_check_is_a_device_side_assert(monkeypatch):
    """Inside a capture (torch.compile mode="reduce-overhead" records flexfa's operator) the
    check cannot sync: a fault is a device-side assert (here on the CPU, where torch's
    _assert_async raises at once), a consistent mask passes without a sync."""
    monkeypatch.setattr(validate, "_capturing", lambda tensor: True)
    mask = _fresh("flexfa")
    mask.full_kv_indices.copy_(mask.kv_indices[..., :mask.full_kv_indices.shape[-1]])
    with pytest.raises(RuntimeError, match="tables are inconsistent .checked during CUDA graph capture"):
        validate.check_tables(mask, L, S)
    synced = []
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: synced.append(self) or [])
    validate.check_tables(_fresh("flexfa"), L, S)
    assert synced == []
