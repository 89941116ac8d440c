"""The BlockMask object: dense view, sparsity, slicing, drawings, devices, from_kv_blocks,
the compatibility check flex_attention uses, create_mask."""
import numpy as np
import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

import flexfa
from flexfa import mods
from flexfa.blockmask import BlockMask, create_block_mask, create_mask
from flexfa.errors import InputError, InputTypeError
from flexfa.frontend.trace import TracedMod, trace

from .test_vs_torch import TABLES, assert_same_as_torch
from .zoo import ZOO


def torch_mask(mask_mod, B, H, L, S, block=32):
    return torch_flex.create_block_mask(mask_mod, B, H, L, S, device="cpu", BLOCK_SIZE=block)


def test_to_dense_matches_torch():
    mod = ZOO["document_causal"](2, 2, 232, 232)
    ours = create_block_mask(mod, 2, 2, 232, 232, device="cpu", BLOCK_SIZE=32)
    dense = ours.to_dense()
    assert dense.shape == (2, 2, 8, 8) and dense.dtype == torch.int32
    assert torch.equal(dense, torch_mask(mod, 2, 2, 232, 232).to_dense())


def test_sparsity_counts_skipped_tiles():
    ours = create_block_mask(mods.causal, 1, 1, 256, 256, device="cpu", BLOCK_SIZE=32)
    assert ours.sparsity() == pytest.approx(100 * 28 / 64)  # 8 x 8 tiles, 36 computed
    assert ours.sparsity() == pytest.approx(torch_mask(mods.causal, 1, 1, 256, 256).sparsity())
    padded = create_block_mask(flexfa.noop_mask, 1, 1, 100, 100, device="cpu", BLOCK_SIZE=64)
    assert padded.sparsity() == 0.0  # torch's area formula would give a negative number


@pytest.mark.parametrize("index", [0, -1, (1, 0), (slice(0, 2), 1), (0, slice(None), 2),
                                   (slice(None), slice(None), torch.tensor([1, 3]))])
def test_getitem_matches_torch(index):
    mod = ZOO["head_windows"](3, 2, 200, 200)
    ours = create_block_mask(mod, 3, 2, 200, 200, device="cpu", BLOCK_SIZE=32)[index]
    theirs = torch_mask(mod, 3, 2, 200, 200)[index]
    for name in TABLES:
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    assert ours.seq_lengths == (200, 200)
    with pytest.raises(InputError, match="sliced"):
        ours._check_compatible(*ours.kv_num_blocks.shape[:2], 200, 200)


@pytest.mark.parametrize("index", [(slice(None), slice(None), slice(3, 1)), slice(5, None)])
def test_empty_slices_have_torchs_table_shapes_and_print(index):
    """No q tiles (or no batches): the q counts were [B, H, KV_TILES, 0] (the cumulative
    count's last column of no columns), and printing divided by zero tiles."""
    ours = create_block_mask(mods.causal, 2, 1, 64, 64, device="cpu", BLOCK_SIZE=16)[index]
    theirs = torch_mask(mods.causal, 2, 1, 64, 64, block=16)[index]
    for name in TABLES:
        assert getattr(ours, name).shape == getattr(theirs, name).shape, name
    assert "BlockMask(shape=" in repr(ours)


def test_getitem_rejects_bad_index():
    mask = create_block_mask(mods.causal, 2, 1, 64, 64, device="cpu", BLOCK_SIZE=32)
    with pytest.raises(InputError, match="out of range"):
        mask[5]
    with pytest.raises(InputError, match="at most 3"):
        mask[0, 0, 0, 0]
    for index in (None, True, (0, None), torch.tensor(True), torch.zeros(1, 1, dtype=torch.long),
                  ([[0]],)):  # they would add a dim to the tables
        with pytest.raises(InputError, match="integers, slices, lists or 1-dim tensors"):
            mask[index]
    with pytest.raises(InputTypeError, match="got float 0.5"):
        mask[0.5]


@pytest.mark.parametrize("as_scalar", [np.int64, torch.tensor], ids=["numpy", "0-dim tensor"])
@pytest.mark.parametrize("at", [0, 1, 2])
def test_getitem_integer_scalars_keep_their_dim(as_scalar, at):
    """A numpy integer or a 0-dim tensor indexes as an int does (both dropped the dim: mask[:,
    np.int64(2)] was a [1, 3] mask whose heads were the batches)."""
    mask = create_block_mask(ZOO["head_windows"](3, 3, 100, 100), 3, 3, 100, 100, device="cpu",
                             BLOCK_SIZE=32)
    index = (slice(None),) * at + (2,)
    scalar = (slice(None),) * at + (as_scalar(2),)
    for name in TABLES:
        assert torch.equal(getattr(mask[scalar], name), getattr(mask[index], name)), name
    assert mask[scalar].shape == mask[index].shape


def test_getitem_indexes_each_dim_on_its_own():
    """Lists for batch and head pick every (batch, head) pair of them, as slices would (the
    pairs (0, 1) and (2, 2) made a [1, 2] mask)."""
    mask = create_block_mask(ZOO["head_windows"](3, 3, 100, 100), 3, 3, 100, 100, device="cpu",
                             BLOCK_SIZE=32)
    picked, expected = mask[[0, 2], torch.tensor([1, 2])], mask[0:3:2, 1:3]
    assert picked.shape == (2, 2, 100, 100)
    for name in TABLES:
        assert torch.equal(getattr(picked, name), getattr(expected, name)), name


@pytest.mark.parametrize("index,same_as", [
    ((..., 1), (slice(None), slice(None), 1)), ((0, ...), (0,)), ((0, ..., 1), (0, slice(None), 1)),
    ((...,), ())])
def test_getitem_expands_ellipsis(index, same_as):
    """``...`` stands for the dims it skips (it used to pad at the end: mask[..., 1] sliced
    the head dim of the count tables and the q tiles of the index tables)."""
    mask = create_block_mask(ZOO["head_windows"](2, 3, 100, 100), 2, 3, 100, 100, device="cpu",
                             BLOCK_SIZE=32)
    ours, expected = mask[index], mask[same_as] if same_as else mask
    for name in TABLES:
        assert torch.equal(getattr(ours, name), getattr(expected, name)), name


def test_repr_draws_tiles():
    mask = create_block_mask(mods.causal, 1, 1, 128, 128, device="cpu", BLOCK_SIZE=32)
    text = repr(mask)
    assert "BlockMask(shape=(1, 1, 128, 128), BLOCK_SIZE=(32, 32)" in text
    assert "mask_mod=causal" in text
    rows = [line for line in text.splitlines() if line.startswith("|")]
    assert rows == ["|~~      |", "|##~~    |", "|####~~  |", "|######~~|"]


def test_repr_limits_heads_and_grid():
    mask = create_block_mask(mods.causal, 2, 3, 2048, 2048, device="cpu", BLOCK_SIZE=16)
    text = repr(mask)
    assert "4 more (b, h) pairs" in text
    assert max(len(line) for line in text.splitlines() if line.startswith("|")) <= 2 * 24 + 2


def test_to_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "mask.png"
    create_block_mask(ZOO["natten_2d"](1, 2, 256, 256), 1, 2, 256, 256, device="cpu",
                      BLOCK_SIZE=16).to_png(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_to_device_keeps_everything():
    mask = create_block_mask(mods.causal, 1, 1, 100, 100, device="cpu", BLOCK_SIZE=32)
    moved = mask.to("cpu")
    assert moved is not mask and moved.traced_mask is mask.traced_mask
    for name in TABLES:
        assert torch.equal(getattr(moved, name), getattr(mask, name))
    assert moved.device == torch.device("cpu")


def test_from_kv_blocks_matches_torch():
    theirs = torch_mask(ZOO["dilated_window"](1, 1, 200, 200), 1, 1, 200, 200)
    ours = BlockMask.from_kv_blocks(theirs.kv_num_blocks, theirs.kv_indices,
                                    theirs.full_kv_num_blocks, theirs.full_kv_indices,
                                    BLOCK_SIZE=32, seq_lengths=(200, 200))
    for name in TABLES:
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    plain = BlockMask.from_kv_blocks(theirs.kv_num_blocks[0, 0], theirs.kv_indices[0, 0])
    assert plain.kv_indices.shape == (1, 1, 7, 7) and plain.seq_lengths == (7 * 128, 7 * 128)
    assert plain.full_kv_num_blocks is None and plain.full_q_indices is None
    assert plain.mask_mod is flexfa.noop_mask


def test_from_kv_blocks_checks_tables():
    num, idx = torch.zeros(1, 1, 4, dtype=torch.int32), torch.zeros(1, 1, 4, 4, dtype=torch.int32)
    with pytest.raises(InputError, match="kv_num_blocks has shape"):
        BlockMask.from_kv_blocks(num[..., :3], idx)
    with pytest.raises(InputError, match="given together"):
        BlockMask.from_kv_blocks(num, idx, full_kv_num_blocks=num)
    with pytest.raises(TypeError, match="must hold integers"):
        BlockMask.from_kv_blocks(num.float(), idx)
    with pytest.raises(InputError, match="BLOCK_SIZE"):
        BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=0)
    # int64 entries past int32 wrapped in the tables' cast: index 2**32 + 1 became tile 1 (a
    # full tile the row attended; an audit's probe), a count of 2**32 + 1 became 1
    wide = torch.zeros(1, 1, 4, 4, dtype=torch.int64)
    wide[0, 0, 0, 0] = 2 ** 32 + 1
    with pytest.raises(InputError, match="full_kv_indices holds 4294967297, past the int32"):
        BlockMask.from_kv_blocks(num, idx, torch.ones(1, 1, 4, dtype=torch.int64), wide,
                                 BLOCK_SIZE=16)
    with pytest.raises(InputError, match="kv_num_blocks holds 4294967297"):
        BlockMask.from_kv_blocks(torch.tensor([2 ** 32 + 1, 1, 1, 1]), idx[0, 0], BLOCK_SIZE=16)


def test_traced_mask_is_kept_and_follows_mask_mod():
    mask = create_block_mask(mods.causal, 1, 1, 64, 64, device="cpu", BLOCK_SIZE=32)
    assert isinstance(mask.traced_mask, TracedMod) and mask.traced_mask.name == "causal"
    mask.mask_mod = mods.prefix_lm(3)
    assert mask.traced_mask.name == "prefix_lm_3"


_REACH = 20  # read by _within_reach as a global: rebinding it changes the mask_mod


def _within_reach(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).abs() <= _REACH


def test_a_mask_mod_whose_state_changed_is_traced_again(monkeypatch):
    """The mask_mod reads a global that is rebound after the first call: the mask (all its
    tiles partial) must apply the mod as it is now, as torch calls its mask_mod again and as a
    new BlockMask around the same tables does; it kept the first call's trace."""
    mask = create_block_mask(_within_reach, 1, 1, 64, 64, device="cpu", BLOCK_SIZE=16,
                             separate_full_blocks=False)
    q, k, v = torch.randn(3, 1, 1, 64, 16).unbind(0)
    flexfa.flex_attention(q, k, v, block_mask=mask)
    monkeypatch.setitem(globals(), "_REACH", 5)
    out = flexfa.flex_attention(q, k, v, block_mask=mask)
    narrow = (torch.arange(64)[:, None] - torch.arange(64)).abs() <= 5
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=narrow)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_traced_mod_accepted():
    traced = trace(mods.sliding_window(20))
    mask = create_block_mask(traced, 1, 1, 100, 100, device="cpu", BLOCK_SIZE=16)
    assert mask.traced_mask is traced
    reference = assert_same_as_torch(mods.sliding_window(20), 1, 1, 100, 100, 16)
    assert torch.equal(mask.kv_indices, reference.kv_indices)
    b, h, q, kv = (torch.tensor(v) for v in (0, 0, 30, 12))
    assert bool(mask.mask_mod(b, h, q, kv)) and not bool(mask.mask_mod(b, h, q, q + 1))


@pytest.mark.parametrize("call,ok", [((2, 4, 100, 100), True), ((1, 4, 100, 100), False),
                                     ((2, 3, 100, 100), False), ((2, 4, 100, 99), False)])
def test_check_compatible(call, ok):
    mask = create_block_mask(ZOO["head_windows"](2, 4, 100, 100), 2, 4, 100, 100, device="cpu",
                             BLOCK_SIZE=32)
    if ok:
        mask._check_compatible(*call)
        return
    with pytest.raises(InputError) as info:
        mask._check_compatible(*call)
    assert "B=2, H=4, Q_LEN=100, KV_LEN=100" in str(info.value)
    B, H, L, S = call
    assert f"(B={B}, H={H}, Q_LEN={L}, KV_LEN={S})" in str(info.value)


def test_check_compatible_broadcasts_size_one():
    mask = create_block_mask(mods.causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    mask._check_compatible(8, 16, 64, 64)


@pytest.mark.parametrize("name", ["document_causal", "head_windows", "batch_lengths", "natten_2d"])
def test_create_mask_matches_torch(name):
    mod = ZOO[name](2, 3, 100, 120)
    ours = create_mask(mod, 2, 3, 100, 120, device="cpu")
    assert ours.dtype == torch.bool and ours.shape == (2, 3, 100, 120)
    assert torch.equal(ours, torch_flex.create_mask(mod, 2, 3, 100, 120, device="cpu")
                       .expand(2, 3, 100, 120))


def test_create_mask_of_a_score_mod():
    def causal_score(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx >= kv_idx, score, -float("inf"))
    ours = create_mask(causal_score, None, None, 50, 60, device="cpu")
    theirs = torch_flex.create_mask(causal_score, 1, 1, 50, 60, device="cpu")
    assert ours.shape == (1, 1, 50, 60) and torch.equal(ours, theirs)


@pytest.mark.parametrize("grid_size", [-1, (-1, -1), (-1, 4)])
def test_to_string_minus_one_draws_every_tile(grid_size):
    """torch's ``to_string(grid_size=-1)`` draws the uncompressed mask (it drew empty,
    '-16x-16 tiles' cells)."""
    mask = create_block_mask(mods.causal, 1, 1, 256, 256, device="cpu", BLOCK_SIZE=16)
    rows = [line for line in mask.to_string(grid_size).splitlines() if line.startswith("|")]
    assert len(rows) == 16
    if grid_size == (-1, 4):  # 16 kv tiles in 4 cells
        assert rows[0] == "|~~      |" and rows[-1] == "|######~~|"
    else:
        assert rows[0] == "|~~" + "  " * 15 + "|" and rows[-1] == "|" + "##" * 15 + "~~|"


@pytest.mark.parametrize("grid_size,error", [
    (0, InputError), ((4, 0), InputError), ((4, -2), InputError), (2.5, InputTypeError),
    ((4,), InputTypeError), (True, InputTypeError)])
def test_to_string_rejects_other_grid_sizes(grid_size, error):
    mask = create_block_mask(mods.causal, 1, 1, 64, 64, device="cpu", BLOCK_SIZE=16)
    with pytest.raises(error, match="grid_size"):
        mask.to_string(grid_size)


def test_to_string_defaults_are_torchs():
    """to_string's defaults were flexfa's own picture's (24 x 24 cells, 2 pairs) where
    torch's are 20 x 20 and 4 pairs: a B=2, H=2 mask drew 2 pairs and '... 2 more'.
    print(mask) keeps flexfa's picture."""
    import inspect
    from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask
    ours = inspect.signature(flexfa.BlockMask.to_string).parameters
    theirs = inspect.signature(TorchBlockMask.to_string).parameters
    assert [(p.name, p.default) for p in ours.values()] == \
        [(p.name, p.default) for p in theirs.values()]
    mask = flexfa.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, 2, 2, 64, 64,
                                    device="cpu", BLOCK_SIZE=16)
    assert "more" not in mask.to_string() and "more" in repr(mask)
