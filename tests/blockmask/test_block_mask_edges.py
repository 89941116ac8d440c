"""Edges of block masks from the fiftieth session's audit of validate.py, create.py,
block_mask.py and checks.py. Three defects, each silently wrong before: kv tables with rows
past L listing tiles (``from_kv_blocks``, and any mask without q tables: the backward visited
a q tile past L, NaN dK / dV), q tables of full tiles without their kv tables (the forward
skipped tiles the backward walked as full), ``_adjust`` to longer lengths within the same
tiles (tiles classified without the new positions); the rest fail under a rule changed
(a copy forgetting its tables list tiles past the lengths, float tables, a reassigned
mask_mod, create_mask of a score_mod at +inf, messages naming the input)."""
import copy

import pytest
import torch

import flexfa
from flexfa import BlockMask
from flexfa.blockmask.validate import TABLES, check_contents, check_tables, checked_past
from flexfa.reference import attention_reference


def I(x):
    return torch.tensor(x, dtype=torch.int32)


def causal(b, h, q, kv):
    return q >= kv


def _qkv(B, H, L, S, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, 16, generator=g).requires_grad_(grad) for n in (L, S, S)]


def _err(mask, mask_mod, B, H, L, S, seed=0):
    q, k, v = _qkv(B, H, L, S, seed)
    out = flexfa.flex_attention(q, k, v, block_mask=mask)
    return float((out.double() - attention_reference(q, k, v, mask_mod=mask_mod)).abs().max())


def _fresh_past(mask, L, S):
    return check_contents({n: getattr(mask, n) for n in TABLES}, (*mask.BLOCK_SIZE, L, S))


# ---- kv tables with rows past L ----------------------------------------

def test_rows_past_L_from_kv_blocks_cached_check_matches_a_fresh_one():
    """Rows past L listing tiles: the derived q tables list q tiles past L, so the cached
    check's `past` must be True (as a fresh check of the same contents says)."""
    m = BlockMask.from_kv_blocks(I([1, 2, 3, 1]), I([[0, 1, 2]] * 4), BLOCK_SIZE=32,
                                 mask_mod=causal, seq_lengths=(96, 96))
    assert checked_past(m) == _fresh_past(m, 96, 96) is True


def test_rows_past_L_without_q_tables_rows_past_L_count_as_past():
    """compute_q_blocks=False: the backward transposes the kv tables whole, so listed tiles
    in rows past L must make check_tables report tiles past the lengths (clipped)."""
    m = BlockMask.from_kv_blocks(I([1, 2, 3, 1]), I([[0, 1, 2]] * 4), BLOCK_SIZE=32,
                                 mask_mod=causal, seq_lengths=(96, 96), compute_q_blocks=False)
    m2 = BlockMask(m.seq_lengths, *(None if getattr(m, n) is None else getattr(m, n).clone()
                                    for n in TABLES), BLOCK_SIZE=32, mask_mod=causal)
    assert check_tables(m2, 96, 96) is True
    assert checked_past(m) is True


def _grads_ok(mask, mask_mod, L, S, seeds=3):
    """forward + backward vs the float64 reference (a kernel visiting a q tile past L reads
    garbage LSE/delta there: NaN or wrong dK/dV on most seeds)."""
    for seed in range(seeds):
        q, k, v = _qkv(1, 1, L, S, seed, grad=True)
        out = flexfa.flex_attention(q, k, v, block_mask=mask)
        do = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v), do)
        q2, k2, v2 = [t.detach().double().requires_grad_() for t in (q, k, v)]
        want = torch.autograd.grad(attention_reference(q2, k2, v2, mask_mod=mask_mod),
                                   (q2, k2, v2), do.double())
        if not all(torch.allclose(a.double(), b, atol=1e-4) for a, b in zip(got, want)):
            return False
    return True


@pytest.mark.parametrize("compute_q", [True, False])
def test_rows_past_L_backward_with_rows_past_L_is_right(compute_q):
    m = BlockMask.from_kv_blocks(I([1, 2, 3, 1]), I([[0, 1, 2]] * 4), BLOCK_SIZE=32,
                                 mask_mod=causal, seq_lengths=(96, 96),
                                 compute_q_blocks=compute_q)
    assert _grads_ok(m, causal, 96, 96)  # (visiting q tile 3 read garbage: NaN on most seeds)


# ---- _adjust to longer lengths inside the same tiles ------------------------------

def _hidden_tile0(b, h, q, kv):
    return (kv <= q) & ((kv >= 32) | (q >= 100))


def test_adjust_to_longer_lengths_in_the_same_tiles_is_right():
    """Tile 0 of rows 96..99 is empty at (100, 100); rows 100..119 attend it."""
    m = flexfa.create_block_mask(_hidden_tile0, 1, 1, 100, 100, device="cpu", BLOCK_SIZE=32)
    assert _err(m._adjust(120, 120), _hidden_tile0, 1, 1, 120, 120) < 1e-4


# ---- rules ---------------------------------------------------------------------------

def _tables_of_128(L=96, S=96):
    """create_block_mask's causal tables for 128 x 128 (4 x 4 tiles of 32) as a mask of
    lengths (L, S): its q tables list q tile 3, past L=96 (accepted, clipped)."""
    big = flexfa.create_block_mask(causal, 1, 1, 128, 128, device="cpu", BLOCK_SIZE=32)
    return BlockMask((L, S), *(getattr(big, n).clone() for n in TABLES), BLOCK_SIZE=32,
                     mask_mod=causal)


def test_to_keeps_past_flag():
    """to() and copies of a checked mask listing tiles past its lengths keep `past`, so the
    copy is clipped too (a copy marked past=False runs q tile 3 in the backward)."""
    m = _tables_of_128()
    q, k, v = _qkv(1, 1, 96, 96)
    flexfa.flex_attention(q, k, v, block_mask=m)  # checked: past
    assert checked_past(m) is True
    moved = m.to("cpu")
    assert checked_past(moved) is True
    assert checked_past(copy.copy(m)) is True
    assert _grads_ok(moved, causal, 96, 96)


def test_cached_check_follows_new_lengths():
    """Tables checked for (128, 128) then used for (96, 96) (seq_lengths reassigned): the
    cached check is not reused for the new geometry (the wrong dK/dV)."""
    m = _tables_of_128(128, 128)
    q, k, v = _qkv(1, 1, 128, 128)
    flexfa.flex_attention(q, k, v, block_mask=m)  # checked for (128, 128): nothing past
    m.seq_lengths = (96, 96)
    assert check_tables(m, 96, 96) is True
    assert _grads_ok(m, causal, 96, 96)


def test_storage_cache_sees_in_place_edits():
    """A new BlockMask around tables edited in place since their check is checked again
    ."""
    m = flexfa.create_block_mask(causal, 1, 1, 96, 96, device="cpu", BLOCK_SIZE=32)
    q, k, v = _qkv(1, 1, 96, 96)
    flexfa.flex_attention(q, k, v, block_mask=m)
    m.kv_num_blocks[0, 0, 1] = 2          # row 1 now lists kv tile 1 (partial) and tile 0,
    m.kv_indices[0, 0, 1, :2] = I([1, 0])  # which full_kv also lists: overlap
    again = BlockMask(m.seq_lengths, *(getattr(m, n) for n in TABLES), BLOCK_SIZE=32,
                      mask_mod=causal)
    with pytest.raises(flexfa.InputError):
        flexfa.flex_attention(q, k, v, block_mask=again)


@pytest.mark.parametrize("name", ["kv_num_blocks", "kv_indices", "full_kv_indices"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_non_integer_tables_fail_early(name, dtype):
    """Float or bool tables set on a BlockMask (constructor path, no from_kv_blocks) fail
    with an InputError naming the table, not inside Triton."""
    m = flexfa.create_block_mask(causal, 1, 1, 96, 96, device="cpu", BLOCK_SIZE=32)
    tables = {n: getattr(m, n).clone() for n in TABLES}
    tables[name] = tables[name].to(dtype)
    bad = BlockMask(m.seq_lengths, *tables.values(), BLOCK_SIZE=32, mask_mod=causal)
    q, k, v = _qkv(1, 1, 96, 96)
    with pytest.raises(flexfa.InputError, match=name):
        flexfa.flex_attention(q, k, v, block_mask=bad)


# ---- full_q tables without full_kv tables -------------------------------------------

def test_full_q_tables_without_full_kv_tables_are_rejected():
    """The forward would skip the tiles that the backward walks as full: rejected (or the
    gradients must match the forward's mask)."""
    m = flexfa.create_block_mask(causal, 1, 1, 96, 96, device="cpu", BLOCK_SIZE=32)
    t = {n: getattr(m, n) for n in TABLES}
    t["full_kv_num_blocks"] = t["full_kv_indices"] = None
    bm = BlockMask(m.seq_lengths, *t.values(), BLOCK_SIZE=32, mask_mod=causal)
    def diag(b, h, q, kv):
        return (q // 32 == kv // 32) & (q >= kv)
    try:
        ok = _grads_ok(bm, diag, 96, 96, seeds=1)
    except flexfa.InputError:
        return
    assert ok


def test_from_kv_blocks_derives_each_q_table_from_its_own_kv_table():
    """from_kv_blocks marks its mask checked (no transposition check at the call), so each
    derived q table must be its kv table transposed: full_q from full_kv, and the
    backward must match the reference."""
    src = flexfa.create_block_mask(causal, 1, 1, 96, 96, device="cpu", BLOCK_SIZE=32)
    m = BlockMask.from_kv_blocks(src.kv_num_blocks, src.kv_indices, src.full_kv_num_blocks,
                                 src.full_kv_indices, BLOCK_SIZE=32, mask_mod=causal)
    for name in ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert torch.equal(getattr(m, name), getattr(src, name)), name
    assert _grads_ok(m, causal, 96, 96, seeds=1)


def test_from_kv_blocks_rejects_full_tables_of_another_tile_shape():
    """Full tables narrower than the partial ones fail in from_kv_blocks, naming both shapes,
    not at the first call."""
    with pytest.raises(flexfa.InputError, match=r"full_kv_indices has tile shape \(3, 2\)"):
        BlockMask.from_kv_blocks(I([1, 1, 1]), I([[0, 1, 2], [1, 0, 2], [2, 0, 1]]),
                                 I([0, 1, 1]), I([[0, 1], [0, 1], [0, 1]]), BLOCK_SIZE=32,
                                 mask_mod=causal)


def test_slice_step_zero_is_an_input_error():
    """bm[::0] fails with flexfa's message naming the step, not torch's ValueError."""
    m = flexfa.create_block_mask(causal, 2, 1, 64, 64, device="cpu", BLOCK_SIZE=32)
    with pytest.raises(flexfa.InputError, match="step must be positive"):
        m[::0]


@pytest.mark.parametrize("index", [[0, 5], torch.tensor([-3]), (slice(None), [1])])
def test_list_index_out_of_range_is_an_input_error(index):
    """List / tensor indices out of range fail with flexfa's InputError naming the index,
    not torch's IndexError from inside the table indexing."""
    m = flexfa.create_block_mask(causal, 2, 1, 64, 64, device="cpu", BLOCK_SIZE=32)
    with pytest.raises(flexfa.InputError, match="out of range"):
        m[index]


def test_from_kv_blocks_rejects_bool_tables():
    """Bool tables would be read as counts/indices 0 and 1: InputTypeError."""
    with pytest.raises(flexfa.InputTypeError, match="kv_indices must hold integers"):
        BlockMask.from_kv_blocks(I([1, 1]), torch.tensor([[True, False], [False, True]]),
                                 BLOCK_SIZE=32)


def test_a_reassigned_mask_mod_replaces_a_given_trace():
    """A mask built with traced_mask= runs the new mask_mod once mask_mod is reassigned
    (the kept trace used whatever the mask_mod)."""
    from flexfa.frontend.trace import MASK_MOD, trace

    def window(b, h, q, kv):
        return (q - kv).abs() <= 8

    every = I([[0, 1], [0, 1]])
    m = BlockMask.from_kv_blocks(I([2, 2]), every, BLOCK_SIZE=32, mask_mod=causal,
                                 traced_mask=trace(causal, MASK_MOD))
    assert _err(m, causal, 1, 1, 64, 64) < 1e-4
    m.mask_mod = window
    assert _err(m, window, 1, 1, 64, 64) < 1e-4


def test_shape_is_b_h_q_len_kv_len_as_torch():
    """BlockMask.shape is (B, H, Q_LEN, KV_LEN), as torch's, also for Q_LEN != KV_LEN."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_create
    m = flexfa.create_block_mask(causal, 2, 1, 40, 100, device="cpu", BLOCK_SIZE=32)
    t = torch_create(causal, 2, 1, 40, 100, device="cpu", BLOCK_SIZE=32)
    assert tuple(m.shape) == tuple(t.shape) == (2, 1, 40, 100)


def test_create_mask_of_a_score_mod_keeps_plus_inf():
    """create_mask of a score_mod masks only -inf scores, as torch's (+inf masked too)."""
    def boost(score, b, h, q, kv):
        return torch.where(q >= kv, score + float("inf"), score)
    dense = flexfa.create_mask(boost, 1, 1, 16, 16, device="cpu")
    assert bool(dense.all())


def test_adjust_to_longer_lengths_keeps_a_tables_only_mask():
    """Without a mask_mod the tables are the mask (a listed tile is attended whole): growing
    within the last tiles keeps them, as torch's _adjust does (a new position's tile is not
    made partial, which would attend an unlisted tile whole)."""
    m = BlockMask.from_kv_blocks(I([1, 2]), I([[0, 1], [0, 1]]), BLOCK_SIZE=32,
                                 seq_lengths=(50, 50))
    grown = m._adjust(60, 60)
    assert torch.equal(grown.kv_num_blocks, m.kv_num_blocks)
    assert torch.equal(grown.kv_indices[..., :1], m.kv_indices[..., :1])
    assert grown.seq_lengths == (60, 60)


def test_a_negative_index_in_a_row_past_L_is_dropped_not_a_crash():
    """Rows past L are not checked (the lengths never reach them); transposing one holding a
    negative index failed inside scatter_ with torch's RuntimeError."""
    m = BlockMask.from_kv_blocks(I([1, 1, 1, 1]), I([[0, 1, 2], [1, 0, 2], [2, 0, 1], [-1, 0, 1]]),
                                 BLOCK_SIZE=32, mask_mod=causal, seq_lengths=(96, 96))
    assert m.q_num_blocks.flatten().tolist() == [1, 1, 1]  # the diagonal, nothing from row 3
