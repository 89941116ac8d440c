"""BlockMask as torch's code uses it: torch's class (isinstance, as_tuple, torch's own
flex_attention), ``_adjust``, ``from_kv_blocks``'s arguments and padding, the dQ metadata,
the constructor's table pairs, copies and pickles, create_block_mask's defaults."""
from __future__ import annotations

import copy
import inspect
import pickle
import warnings

import pytest
import torch
import torch.nn.attention.flex_attention as torch_flex
from hypothesis import given, strategies as st

import flexfa
from flexfa import mods
from flexfa.blockmask import BlockMask, create_block_mask
from flexfa.blockmask.block_mask import TracedMaskMod
from flexfa.blockmask.checks import default_device
from flexfa.blockmask.validate import checked_past
from flexfa.frontend.trace import trace
from flexfa.reference import attention_reference

from .test_vs_torch import TABLES, assert_same_as_torch
from .zoo import ZOO

DQ = ("dq_write_order", "dq_write_order_full", "dq_kv_order", "dq_kv_order_spt")


def torch_mask(mask_mod, B, H, L, S, block=16, **flags):
    return torch_flex.create_block_mask(mask_mod, B, H, L, S, device="cpu", BLOCK_SIZE=block,
                                        **flags)


def ours(mask_mod, B, H, L, S, block=16, **flags):
    return create_block_mask(mask_mod, B, H, L, S, device="cpu", BLOCK_SIZE=block, **flags)


def same_tensors(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


# ---- torch's class ------------------------------------------------------------------------

@pytest.mark.parametrize("flatten", [True, False])
def test_as_tuple_is_torchs(flatten):
    mask = ours(mods.causal, 2, 1, 100, 70)
    reference = torch_mask(mods.causal, 2, 1, 100, 70)
    mine, theirs = mask.as_tuple(flatten=flatten), reference.as_tuple(flatten=flatten)
    assert len(mine) == len(theirs)
    for a, b in zip(mine[:-1], theirs[:-1]):
        assert same_tensors(a, b) if isinstance(b, torch.Tensor) or a is None else a == b
    assert mine[-1] is mods.causal


def test_torchs_flex_attention_runs_a_flexfa_mask():
    mask = ours(ZOO["document_causal"](2, 2, 64, 64), 2, 2, 64, 64)
    q, k, v = torch.randn(3, 2, 2, 64, 16).unbind()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = torch_flex.flex_attention(q, k, v, block_mask=mask)
        expected = torch_flex.flex_attention(q, k, v, block_mask=torch_mask(
            mask.mask_mod, 2, 2, 64, 64))
    torch.testing.assert_close(theirs, expected)
    torch.testing.assert_close(flexfa.flex_attention(q, k, v, block_mask=mask), expected,
                               atol=1e-5, rtol=1e-5)


def test_sliced_masks_are_recognized_by_both_libraries():
    """A slice resets the mask_mod to torch's placeholder: torch's flex_attention refuses a
    sliced flexfa mask with its own error, flexfa a sliced mask of either with an InputError."""
    q = torch.randn(1, 1, 32, 16)
    sliced = ours(mods.causal, 2, 1, 32, 32)[0]
    with warnings.catch_warnings(), pytest.raises(RuntimeError, match="sliced BlockMask"):
        warnings.simplefilter("ignore")
        torch_flex.flex_attention(q, q, q, block_mask=sliced)
    for mask in (sliced, torch_mask(mods.causal, 2, 1, 32, 32)[0]):
        with pytest.raises(flexfa.InputError, match="block_mask was sliced with"):
            flexfa.flex_attention(q, q, q, block_mask=mask)


def test_str_is_flexfas_drawing():
    mask = ours(mods.causal, 1, 1, 64, 64)
    assert str(mask) == repr(mask) and "BLOCK_SIZE=(16, 16)" in str(mask)


# ---- _adjust ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["causal", "sliding_window", "document_causal"])
@pytest.mark.parametrize("lengths", [(40, 40), (30, 64), (64, 64), (17, 9), (100, 100)])
def test_adjust_matches_torch(name, lengths):
    """Where torch's _adjust runs, flexfa's gives the same tiles, table shapes and lengths."""
    mask_mod = {"causal": mods.causal, "sliding_window": mods.sliding_window(20),
                "document_causal": ZOO["document_causal"](2, 1, 64, 64)}[name]
    mine = ours(mask_mod, 2, 1, 64, 64)._adjust(*lengths)
    theirs = torch_mask(mask_mod, 2, 1, 64, 64)._adjust(*lengths)
    assert mine.seq_lengths == theirs.seq_lengths == lengths
    assert mine.BLOCK_SIZE == theirs.BLOCK_SIZE and mine.mask_mod is mask_mod
    for name in TABLES:
        assert getattr(mine, name).shape == getattr(theirs, name).shape, name
    assert torch.equal(mine.to_dense(), theirs.to_dense())
    for pair in ("q", "full_q"):  # the backward's tables: the kv tables transposed
        assert torch.equal(getattr(mine, f"{pair}_num_blocks"),
                           getattr(theirs, f"{pair}_num_blocks"))


def test_adjust_crops_exactly_where_torchs_count_fails():
    """Cropping a causal mask to fewer keys than queries: torch's recount leaves a tile past
    the new keys listed (its _adjust then fails building the q tables); flexfa drops it, and
    the cropped mask attends like the causal mask built for the new lengths."""
    big = ours(mods.causal, 1, 1, 64, 64)
    with pytest.raises(IndexError):
        torch_mask(mods.causal, 1, 1, 64, 64)._adjust(64, 32)
    cropped = big._adjust(64, 32)
    fresh = ours(mods.causal, 1, 1, 64, 32)
    assert torch.equal(cropped.to_dense(), fresh.to_dense())
    q, k, v = torch.randn(1, 2, 64, 16), torch.randn(1, 2, 32, 16), torch.randn(1, 2, 32, 16)
    torch.testing.assert_close(flexfa.flex_attention(q, k, v, block_mask=cropped),
                               flexfa.flex_attention(q, k, v, block_mask=fresh))


def _band(width):
    def band(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= width
    return band


@pytest.mark.parametrize("width,block,lengths", [
    (70, 32, (100, 130)), (70, 32, (130, 100)), (30, 24, (100, 130)), (40, 16, (64, 96))])
def test_torchs_adjust_leaves_tiles_past_the_lengths_which_add_nothing(width, block, lengths):
    """torch's _adjust recounts a cropped row by its entries' values: where a row's partial
    tiles skip its full ones, a tile past the new keys stays listed (kv_indices lists tile 5
    of S=130's 0..4 at block 32). torch's kernels mask its positions; flexfa refused the mask
    (an InputError) and now runs it without that tile: outputs are torch's (eager, which
    follows the mask_mod; torch has no CPU backward: gradients against the float64
    reference) whether the block is tiled (32), coarsened (24) or the lengths are block
    multiples (torch's GPU kernels read past K there)."""
    L, S = lengths
    cropped = torch_mask(_band(width), 1, 1, 256, 256, block=block)._adjust(L, S)
    listed = torch.arange(cropped.kv_indices.shape[-1]) < cropped.kv_num_blocks[..., None]
    assert int(cropped.kv_indices[listed].max()) >= -(-S // block)  # a tile past S is listed
    q, k, v = (torch.randn(1, 2, n, 16, requires_grad=True) for n in (L, S, S))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's eager flex_attention warns
        expected = torch_flex.flex_attention(q.detach(), k.detach(), v.detach(),
                                             block_mask=cropped)
    exact = attention_reference(q, k, v, mask_mod=_band(width))
    grads = torch.autograd.grad(exact.sum(), (q, k, v))
    ours_mask = BlockMask.from_kv_blocks(  # torch's from_kv_blocks takes the same tables
        cropped.kv_num_blocks, cropped.kv_indices, cropped.full_kv_num_blocks,
        cropped.full_kv_indices, BLOCK_SIZE=block, mask_mod=cropped.mask_mod,
        seq_lengths=lengths)
    for mask in (cropped, ours_mask, cropped):  # (the third call: the kept derived mask)
        out = flexfa.flex_attention(q, k, v, block_mask=mask)
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)
        for mine, theirs in zip(torch.autograd.grad(out.sum(), (q, k, v)), grads):
            torch.testing.assert_close(mine, theirs.float(), atol=1e-4, rtol=1e-4)


def test_a_tile_edited_in_place_past_the_lengths_adds_nothing():
    """An entry edited to a tile past S after a call: the next call skips it (as torch's
    kernels mask it), and an edit back runs the mask itself again."""
    mask = ours(_band(20), 1, 1, 100, 100)  # 7 kv tiles of 16, the last ragged
    q, k, v = (torch.randn(1, 2, 100, 16) for _ in range(3))
    flexfa.flex_attention(q, k, v, block_mask=mask)
    row, column = 0, int(mask.kv_num_blocks[0, 0, 0]) - 1  # q tile 0's last partial tile
    dropped = mask.kv_indices[0, 0, row, column].item()
    mask.kv_indices[0, 0, row, column] = 7
    mask.q_num_blocks[0, 0, dropped] -= 1  # q tile 0 is the first listed: drop it
    mask.q_indices[0, 0, dropped] = mask.q_indices[0, 0, dropped].roll(-1).clone()

    def without_it(b, h, q_idx, kv_idx):
        return _band(20)(b, h, q_idx, kv_idx) & ~((q_idx < 16) & (kv_idx // 16 == dropped))
    torch.testing.assert_close(flexfa.flex_attention(q, k, v, block_mask=mask),
                               flexfa.flex_attention(q, k, v, block_mask=ours(
                                   without_it, 1, 1, 100, 100)))


def test_adjust_keeps_the_trace_and_checks_lengths():
    mask = ours(mods.causal, 1, 1, 64, 64)
    assert mask._adjust(32, 48).traced_mask is mask.traced_mask
    with pytest.raises(flexfa.InputError, match="new_kv_len must be positive"):
        mask._adjust(32, 0)
    with pytest.raises(flexfa.InputError, match=r"_adjust\(32, 32\)"):
        flexfa.flex_attention(*torch.randn(3, 1, 1, 32, 16).unbind(), block_mask=mask)


# ---- from_kv_blocks -----------------------------------------------------------------------

@pytest.mark.parametrize("dims", [2, 4])
def test_from_kv_blocks_pads_with_minus_one_as_torch(dims):
    """Entries past a row's count may be -1 (torch's paged attention pads so); the tables and
    the result are those of the same mask with any other padding."""
    num_blocks = torch.tensor([1, 2, 0, 3])
    indices = torch.tensor([[0, -1, -1, -1], [0, 1, -1, -1], [-1, -1, -1, -1], [1, 2, 3, -1]])
    if dims == 4:
        num_blocks, indices = num_blocks[None, None], indices[None, None]
    mine = BlockMask.from_kv_blocks(num_blocks, indices, BLOCK_SIZE=16)
    theirs = torch_flex.BlockMask.from_kv_blocks(num_blocks, indices, BLOCK_SIZE=16)
    for name in ("q_num_blocks", "q_indices"):
        assert torch.equal(getattr(mine, name).view(getattr(theirs, name).shape),
                           getattr(theirs, name).to(torch.int32))
    clean = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3], [1, 2, 3, 0]])
    clean = BlockMask.from_kv_blocks(num_blocks, clean.view(indices.shape), BLOCK_SIZE=16)
    q, k, v = torch.randn(3, 1, 1, 64, 16).unbind()
    torch.testing.assert_close(flexfa.flex_attention(q, k, v, block_mask=mine),
                               flexfa.flex_attention(q, k, v, block_mask=clean))


@pytest.mark.parametrize("dims", [2, 3])
def test_torchs_mask_with_tables_of_fewer_dims_is_an_error(dims):
    """torch's from_kv_blocks keeps 2- or 3-dim tables as given: flex_attention says so and
    points at flexfa's from_kv_blocks (it failed unpacking the batch and head of a 1-dim
    kv_num_blocks, and read a 2-dim one's q tiles as heads)."""
    num_blocks = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    indices = torch.arange(4, dtype=torch.int32).expand(4, 4).contiguous()
    for _ in range(dims - 2):
        num_blocks, indices = num_blocks[None], indices[None]
    q, k, v = torch.randn(3, 1, 2, 64, 16).unbind()
    theirs = torch_flex.BlockMask.from_kv_blocks(num_blocks, indices, BLOCK_SIZE=16)
    with pytest.raises(flexfa.InputError, match=r"kv_num_blocks has shape .*BlockMask.from_kv_blocks"):
        flexfa.flex_attention(q, k, v, block_mask=theirs)
    mine = BlockMask.from_kv_blocks(num_blocks, indices, BLOCK_SIZE=16)
    tiles = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx // 16 >= kv_idx // 16,
                              None, None, 64, 64, device="cpu", BLOCK_SIZE=16)
    torch.testing.assert_close(flexfa.flex_attention(q, k, v, block_mask=mine),
                               flexfa.flex_attention(q, k, v, block_mask=tiles))


def test_from_kv_blocks_takes_torchs_arguments():
    reference = torch_mask(mods.causal, 1, 2, 64, 64, compute_dq_write_order=True)
    signature = inspect.signature(torch_flex.BlockMask.from_kv_blocks).parameters
    assert list(inspect.signature(BlockMask.from_kv_blocks).parameters)[:len(signature)] == \
        list(signature)
    mask = BlockMask.from_kv_blocks(
        reference.kv_num_blocks, reference.kv_indices, reference.full_kv_num_blocks,
        reference.full_kv_indices, 16, mods.causal, (64, 64), False,
        dq_write_order=reference.dq_write_order,
        dq_write_order_full=reference.dq_write_order_full, dq_kv_order=True)
    assert mask.q_num_blocks is None and mask.full_q_indices is None
    assert mask.dq_write_order is reference.dq_write_order and mask.dq_kv_order_spt is True
    assert mask.dq_kv_order is None
    order = torch.arange(4, dtype=torch.int32)
    explicit = BlockMask.from_kv_blocks(reference.kv_num_blocks, reference.kv_indices,
                                        dq_kv_order=order)
    assert explicit.dq_kv_order is order and explicit.dq_kv_order_spt is None
    with pytest.raises(NotImplementedError, match="tensor dq_kv_order"):
        explicit[0]
    with pytest.raises(flexfa.InputTypeError, match="dq_kv_order must be a bool, a tensor"):
        BlockMask.from_kv_blocks(reference.kv_num_blocks, reference.kv_indices, dq_kv_order=1)


def test_mask_without_q_tables_trains():
    """compute_q_blocks=False (torch's inference masks): the backward transposes the kv
    tables itself and gives the gradients of the full mask."""
    full = ours(mods.causal, 1, 1, 48, 48)
    bare = BlockMask.from_kv_blocks(full.kv_num_blocks, full.kv_indices,
                                    full.full_kv_num_blocks, full.full_kv_indices, 16,
                                    mods.causal, compute_q_blocks=False)
    q, k, v = (t.requires_grad_() for t in torch.randn(3, 1, 2, 48, 16).unbind())
    grads = [torch.autograd.grad(flexfa.flex_attention(q, k, v, block_mask=m).sum(), (q, k, v))
             for m in (full, bare)]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


# ---- dQ metadata --------------------------------------------------------------------------

@pytest.mark.parametrize("descending", [True, False])
def test_dq_write_order_as_torch(descending):
    mine = ours(ZOO["document_causal"](2, 2, 100, 100), 2, 2, 100, 100,
                compute_dq_write_order=True, dq_kv_order=descending)
    theirs = torch_mask(mine.mask_mod, 2, 2, 100, 100, compute_dq_write_order=True,
                        dq_kv_order=descending)
    for name in DQ:
        a, b = getattr(mine, name), getattr(theirs, name)
        assert same_tensors(a, b) if isinstance(b, torch.Tensor) or a is None else a == b, name
    sliced, torch_sliced = mine[1, :, 1:], theirs[1, :, 1:]
    for name in DQ:
        a, b = getattr(sliced, name), getattr(torch_sliced, name)
        assert same_tensors(a, b) if isinstance(b, torch.Tensor) or a is None else a == b, name
    plain = ours(mods.causal, 1, 1, 32, 32)
    assert all(getattr(plain, name) is None for name in DQ)


# ---- the constructor ----------------------------------------------------------------------

@pytest.mark.parametrize("pair", ["full_kv", "full_q", "q"])
@pytest.mark.parametrize("missing", ["num_blocks", "indices"])
def test_constructor_rejects_half_a_table_pair(pair, missing):
    mask = ours(mods.causal, 1, 1, 64, 64)
    tables = {name: getattr(mask, name) for name in TABLES}
    tables[f"{pair}_{missing}"] = None
    with pytest.raises(flexfa.InputError, match=f"{pair}_num_blocks and {pair}_indices must be "
                                                "given together"):
        BlockMask((64, 64), *tables.values(), BLOCK_SIZE=16)


def test_constructor_checks_its_arguments():
    mask = ours(mods.causal, 1, 1, 64, 64)
    tables = [getattr(mask, name) for name in TABLES]
    with pytest.raises(flexfa.InputError, match="kv_num_blocks and kv_indices are required"):
        BlockMask((64, 64), None, *tables[1:])
    with pytest.raises(flexfa.InputTypeError, match="full_kv_indices must be a tensor or None"):
        BlockMask((64, 64), *tables[:3], [0], *tables[4:])
    with pytest.raises(flexfa.InputError, match="dq_write_order_full needs dq_write_order"):
        BlockMask((64, 64), *tables, dq_write_order_full=tables[0])
    rebuilt = BlockMask((64, 64), *tables, 16, mods.causal)
    assert rebuilt.BLOCK_SIZE == (16, 16) and rebuilt.mask_mod is mods.causal


def test_constructor_without_lengths_derives_them_as_torch():
    """seq_lengths=None failed inside Python ('NoneType' is not subscriptable); torch's
    from_kv_blocks derives the tiles times the block size, as flexfa's now does in both."""
    mask = ours(mods.causal, 1, 1, 100, 60, block=(32, 16))
    tables = [getattr(mask, name) for name in TABLES]
    rebuilt = BlockMask(None, *tables, BLOCK_SIZE=(32, 16), mask_mod=mods.causal)
    theirs = torch_flex.BlockMask.from_kv_blocks(mask.kv_num_blocks, mask.kv_indices,
                                                 BLOCK_SIZE=(32, 16))
    assert rebuilt.seq_lengths == tuple(theirs.seq_lengths) == (128, 64)
    assert BlockMask.from_kv_blocks(mask.kv_num_blocks, mask.kv_indices,
                                    BLOCK_SIZE=(32, 16)).seq_lengths == (128, 64)


@pytest.mark.parametrize("seq_lengths, error, message", [
    (64, flexfa.InputTypeError, "seq_lengths must be a \\(Q_LEN, KV_LEN\\) pair of ints or None, "
                                "got int 64"),
    ((64,), flexfa.InputTypeError, "pair of ints or None, got tuple \\(64,\\)"),
    ((64, 64, 64), flexfa.InputTypeError, "pair of ints"),  # was cut to its first two
    ("ab", flexfa.InputTypeError, "pair of ints or None, got str 'ab'"),
    ((64.5, 64), flexfa.InputTypeError, "pair of ints"),  # was truncated to 64
    ((True, 64), flexfa.InputTypeError, "pair of ints"),  # was read as 1
    (torch.tensor([64.0, 64.0]), flexfa.InputTypeError, "pair of ints"),
    ((-1, 64), flexfa.InputError, "seq_lengths must be in 0..2147483647"),
    ((2 ** 40, 64), flexfa.InputError, "seq_lengths must be in 0..2147483647"),
])
@pytest.mark.parametrize("build", ["constructor", "from_kv_blocks"])
def test_bad_seq_lengths_are_named(seq_lengths, error, message, build):
    mask = ours(mods.causal, 1, 1, 64, 64)
    tables = [getattr(mask, name) for name in TABLES]
    with pytest.raises(error, match=message):
        if build == "constructor":
            BlockMask(seq_lengths, *tables, BLOCK_SIZE=16)
        else:
            BlockMask.from_kv_blocks(*tables[:4], BLOCK_SIZE=16, seq_lengths=seq_lengths)


def test_constructor_checks_the_rest():
    """A mask_mod that is no function, compute_q_blocks of no bool and 1-D tables were taken
    (the mask failed when used; torch refuses 1-D tables too)."""
    mask = ours(mods.causal, 1, 1, 64, 64)
    tables = [getattr(mask, name) for name in TABLES]
    with pytest.raises(flexfa.InputTypeError, match="BlockMask: mask_mod must be a function"):
        BlockMask((64, 64), *tables, BLOCK_SIZE=16, mask_mod=5)
    with pytest.raises(flexfa.InputTypeError, match="from_kv_blocks: mask_mod must be a function"):
        BlockMask.from_kv_blocks(*tables[:4], BLOCK_SIZE=16, mask_mod="causal")
    with pytest.raises(flexfa.InputTypeError, match="compute_q_blocks must be a bool"):
        BlockMask.from_kv_blocks(*tables[:4], BLOCK_SIZE=16, compute_q_blocks="no")
    with pytest.raises(flexfa.InputError, match="kv_indices must have at least 2 dims"):
        BlockMask((64, 64), tables[0].flatten(), tables[1].flatten(), *(None,) * 6)
    with pytest.raises(flexfa.InputTypeError, match="dq_write_order must be a tensor or None"):
        BlockMask((64, 64), *tables, BLOCK_SIZE=16, dq_write_order=[0])
    with pytest.raises(flexfa.InputTypeError, match="dq_kv_order_spt must be a bool"):
        BlockMask((64, 64), *tables, BLOCK_SIZE=16, dq_kv_order_spt="yes")


def test_numpy_bools_are_bools():
    """np.True_ as a BlockMask index was read as index 1 (batch 1 of two, silently), and
    dq_kv_order=np.True_ was refused as 'got bool'."""
    numpy = pytest.importorskip("numpy")
    mask = ours(mods.causal, 2, 1, 64, 64)
    with pytest.raises(flexfa.InputError, match="BlockMask\\[...\\] takes integers.*got np.True_"):
        mask[numpy.True_]
    built = BlockMask.from_kv_blocks(mask.kv_num_blocks, mask.kv_indices, BLOCK_SIZE=16,
                                     dq_kv_order=numpy.True_)
    assert built.dq_kv_order_spt is True
    created = ours(mods.causal, 1, 1, 64, 64, compute_dq_write_order=numpy.True_,
                   dq_kv_order=numpy.True_)
    assert created.dq_kv_order_spt is True and created.dq_write_order is not None


@pytest.mark.parametrize("device", ["nope", 5.5, torch.float32])
def test_to_takes_devices_only(device):
    """BlockMask.to(torch.float32) (or 5.5) passed it on to Tensor.to: float tables."""
    with pytest.raises(flexfa.InputError, match="BlockMask.to: device=.* is not a torch device"):
        ours(mods.causal, 1, 1, 64, 64).to(device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_to_cuda_without_cuda_is_an_input_error():
    """It was torch's AssertionError ("Torch not compiled with CUDA enabled")."""
    with pytest.raises(flexfa.InputError, match="BlockMask.to: device='cuda' but CUDA is not"):
        ours(mods.causal, 1, 1, 64, 64).to("cuda")


# ---- copies -------------------------------------------------------------------------------

class HoldsAMask(torch.nn.Module):
    def __init__(self, mask):
        super().__init__()
        self.mask = mask
        self.proj = torch.nn.Linear(16, 16)


def test_deepcopy_of_a_used_mask_and_of_a_model_holding_it():
    """A mask that ran (traced, checked, kernels cached) deep-copies: copied tables, the same
    mask_mod and trace, the same result; deepcopy(model) of a model holding it too."""
    mask = ours(ZOO["head_windows"](1, 2, 64, 64), 1, 2, 64, 64)
    q = torch.randn(1, 2, 64, 16)
    expected = flexfa.flex_attention(q, q, q, block_mask=mask)
    for copied in (copy.deepcopy(mask), copy.deepcopy(HoldsAMask(mask)).mask):
        assert type(copied) is BlockMask and copied.kv_indices is not mask.kv_indices
        assert copied.mask_mod is mask.mask_mod and copied.traced_mask is mask.traced_mask
        assert checked_past(copied) is False  # checked, unchanged, no tile past the lengths
        for name in TABLES:
            assert torch.equal(getattr(copied, name), getattr(mask, name))
        torch.testing.assert_close(flexfa.flex_attention(q, q, q, block_mask=copied), expected)
    shallow = copy.copy(mask)
    assert shallow.kv_indices is mask.kv_indices and shallow.traced_mask is mask.traced_mask


def test_pickle_of_a_used_mask():
    """A mask with a picklable mask_mod (a module-level function, or one built from a traced
    mod) round-trips through pickle and runs; its trace is made again from the mask_mod."""
    q = torch.randn(1, 1, 64, 16)
    for mask_mod in (mods.causal, trace(mods.causal)):
        mask = ours(mask_mod, 1, 1, 64, 64)
        expected = flexfa.flex_attention(q, q, q, block_mask=mask)
        loaded = pickle.loads(pickle.dumps(mask))
        for name in TABLES:
            assert torch.equal(getattr(loaded, name), getattr(mask, name))
        assert loaded.traced_mask.key == mask.traced_mask.key
        torch.testing.assert_close(flexfa.flex_attention(q, q, q, block_mask=loaded), expected)
    assert isinstance(loaded.mask_mod, TracedMaskMod)


# ---- create_block_mask's defaults and block sizes -----------------------------------------

def test_default_device_is_torchs():
    """device=None: the current accelerator if it is CUDA (and usable), else the CPU, where
    the old default was "cuda"."""
    assert inspect.signature(create_block_mask).parameters["device"].default is None
    assert inspect.signature(torch_flex.create_block_mask).parameters["device"].default is None
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert create_block_mask(mods.causal, 1, 1, 32, 32).device.type == expected
    assert default_device().type == expected


def test_default_device_without_a_usable_cuda(monkeypatch):
    monkeypatch.setattr(torch.accelerator, "current_accelerator",
                        lambda *args, **kwargs: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_device() == torch.device("cpu")
    monkeypatch.setattr(torch.accelerator, "current_accelerator",
                        lambda *args, **kwargs: torch.device("mps"))
    assert default_device() == torch.device("cpu")


@given(block=st.tuples(st.integers(1, 130), st.integers(1, 130)),
       lengths=st.tuples(st.integers(1, 200), st.integers(1, 200)),
       name=st.sampled_from(["causal", "document_causal", "dilated_window", "head_windows"]))
def test_any_block_size_matches_torch(block, lengths, name):
    """Any positive block size, as torch accepts (1 for decoding rows, 24, 100, ...): the
    same tables as torch's create_block_mask."""
    L, S = lengths
    assert_same_as_torch(ZOO[name](1, 2, L, S), 1, 2, L, S, block)


@pytest.mark.parametrize("block", [(1, 64), 96, 512, (256, 1024)])
def test_large_and_decoding_block_sizes_match_torch(block):
    assert_same_as_torch(mods.causal, 1, 1, 600, 700, block)
