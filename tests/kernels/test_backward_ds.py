"""The backward with dQ from a stored dS (``BackwardSpec.ds_dq``; kernel_options
``DS_WORKSPACE=True`` forces it under the interpreter): delta kernel, dK/dV storing each tile's
dS in a workspace, dQ = dS @ K from it. It is never the default (the memory policy: nothing
L x S unless asked, ``flexfa.runtime.ds_workspace.allowed``); the stores and loads go through
tensor descriptors (``bwd_USE_TMA=True`` here) or pointers."""
import pytest
import torch

import flexfa
from flexfa import mods
from flexfa.blockmask import BlockMask, create_block_mask
from flexfa.errors import InputError, InputTypeError
from flexfa.runtime import ds_workspace
from flexfa.runtime.call import AttentionCall
from flexfa.runtime.families import backward as backward_family
from flexfa.runtime.options import parse_kernel_options
from flexfa.runtime.target import INTERPRETER, Target
from backward_utils import check_backward, check_ragged_gqa_alibi_causal, record_backward_specs
from forward_utils import make_qkv
from specialization import specialization_spy

DS = {"DS_WORKSPACE": True}
SM80, SM90 = Target("cuda", 8, 0), Target("cuda", 9, 0)


@pytest.fixture
def spy_specs(monkeypatch):
    """Record the BackwardSpec of every backward pass."""
    return record_backward_specs(monkeypatch)


def replace_workspace(monkeypatch, numel: int, make) -> list:
    """torch.empty of the dS workspace (1-D, ``numel`` elements) returns ``make(shape,
    **kwargs)`` instead (a NaN-filled tensor, or raising); returns the list of such calls."""
    real_empty = torch.empty
    calls = []

    def empty(*shape, **kwargs):
        if shape == (numel,):
            calls.append(shape)
            return make(shape, **kwargs)
        return real_empty(*shape, **kwargs)
    monkeypatch.setattr(torch, "empty", empty)
    return calls


def nan_filled(shape, **kwargs):
    return torch.full(shape, float("nan"), **kwargs)


@pytest.mark.parametrize("tma", [False, True])
def test_ds_backward_ragged_gqa_alibi_causal(spy_specs, tma):
    # workspace rows past S never written, columns past L garbage for rows that are not
    # stored; the lse gradient enters through the delta kernel
    check_ragged_gqa_alibi_causal(torch.bfloat16, seed=41, block_size=64, tile=32,
                                  kernel_options={**DS, "bwd_USE_TMA": tma})
    assert spy_specs and all(s.ds_dq and s.use_tma == tma for s in spy_specs)


def test_ds_backward_softcap_dense_and_empty_rows(spy_specs):
    # no block mask (dense walks, a ragged last kv tile); then a mask leaving rows empty,
    # whose dq must be exactly 0
    q, k, v = make_qkv(1, 2, 2, 72, 100, 16, dtype=torch.float16, seed=42)
    check_backward(q, k, v, mods.softcap(5.0),
                   kernel_options={"BLOCK_M": 32, "BLOCK_N": 32, **DS})
    q, k, v = make_qkv(1, 2, 2, 64, 48, 16, dtype=torch.float32, seed=43)

    def late_start(b, h, q_idx, kv_idx):
        return (q_idx >= 20) & (kv_idx <= q_idx)
    block_mask = create_block_mask(late_start, None, None, 64, 48, device="cpu", BLOCK_SIZE=16)
    dq, _, _ = check_backward(q, k, v, None, late_start, block_mask,
                              kernel_options={"BLOCK_M": 16, "BLOCK_N": 16,
                                              "deterministic": True, **DS})
    assert spy_specs and all(s.ds_dq for s in spy_specs)  # deterministic: no atomics here
    assert torch.equal(dq[:, :, :20], torch.zeros_like(dq[:, :, :20]))


def test_ds_matches_the_two_kernels(monkeypatch):
    """Both paths on the same float32 inputs give the same gradients (dS is the same tile,
    stored in float32 here)."""
    q, k, v = make_qkv(1, 2, 2, 96, 80, 32, dtype=torch.float32, seed=44)
    block_mask = create_block_mask(mods.causal, None, None, 96, 80, device="cpu", BLOCK_SIZE=32)
    specs = record_backward_specs(monkeypatch)
    results = []
    for setting in (False, True):
        options = {"BLOCK_M": 32, "BLOCK_N": 32, "DS_WORKSPACE": setting}
        results.append(check_backward(q, k, v, mods.softcap(8.0), mods.causal, block_mask,
                                      kernel_options=options))
    assert [s.ds_dq for s in specs] == [False, True]
    for name, a, b in zip(("dq", "dk", "dv"), *results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def _spec(dim, dtype=torch.bfloat16, block=128, options=None, target=SM90, **mode):
    """The BackwardSpec of a causal [1, 2, 512, dim] call; ``mode``: fusable, force_ds."""
    from flexfa.runtime.pipeline import prepare_mask

    q, k, v = (torch.zeros(1, 2, 512, dim, dtype=dtype) for _ in range(3))
    mask = create_block_mask(mods.causal, None, None, 512, 512, device="cpu", BLOCK_SIZE=block)
    call = AttentionCall(None, prepare_mask(mask), mask, 0.1, parse_kernel_options(options), 1)
    return backward_family.backward_spec(q, k, v, call, has_dlse=False, target=target, **mode)


def test_ds_mode_takes_its_own_sm90_tiles():
    """On sm_90 at padded head dim 128 the dS mode's kernels take HOPPER_DS_TILES (the dQ
    kernel 128 x 64, 8 warps, 3 stages), bounded by the caller's tiles and the mask's blocks;
    elsewhere they keep the two-kernel tiles."""
    (m1, n1, w1, s1), (m2, n2, w2, s2) = ds_workspace.HOPPER_DS_TILES[128]
    assert (m2, n2, w2, s2) == (128, 64, 8, 3)

    def spec_for(dim, **kwargs):
        return _spec(dim, force_ds=True, **kwargs)
    spec = spec_for(128)
    assert spec.ds_dq and (spec.block_m1, spec.block_n1, spec.block_m2, spec.block_n2) == (
        m1, n1, m2, n2)
    assert spec.launch_options() == {"num_warps": w1, "num_stages": s1}
    assert spec.dq_launch_options() == {"num_warps": w2, "num_stages": s2}
    assert spec_for(128, block=64).block_m2 == 64  # fitted to the mask's blocks
    pinned = spec_for(128, options={"BLOCK_M": 32, "num_warps": 4})
    assert pinned.block_m2 == 32 and pinned.dq_launch_options()["num_warps"] == 4
    pinned = spec_for(128, options={"bwd_BLOCK_M2": 64, "bwd_num_warps": 4})  # torch's keys
    assert pinned.block_m2 == 64 and pinned.dq_launch_options()["num_warps"] == 4
    assert spec_for(128, options={"fwd_BLOCK_M": 32}).block_m2 == m2  # the forward's only
    for other in (spec_for(64), spec_for(128, dtype=torch.float32),  # the two-kernel tiles
                  spec_for(128, target=SM80), spec_for(128, target=Target("cuda", 10, 0))):
        assert other.ds_dq and other.dq_launch_options() == other.launch_options()


def test_backward_spec_takes_the_workspace_only_when_asked():
    """backward_spec asks ds_workspace: never by default (not even on sm_90 with descriptors
    at head dim 128, where it once was), with DS_WORKSPACE=True wherever no captured tensor
    needs a gradient and the workspace (causal 512 x 512 in 128-blocks: 10 block slots per
    head) fits the budget."""
    workspace = 2 * 10 * 128 * 128 * 2  # heads x slots x tile x bf16 bytes
    for options in (None, {"DS_WORKSPACE": "AUTO"}, {"DS_WORKSPACE": False}):
        assert not _spec(128, fusable=True, options=options).ds_dq
    assert _spec(128, fusable=True, options=DS).ds_dq
    assert not _spec(128, fusable=False, options=DS).ds_dq  # captured grads, or no dK/dV
    assert _spec(128, fusable=True, options={**DS, "bwd_USE_TMA": False}).ds_dq
    assert _spec(128, fusable=True, options={**DS, "DS_MAX_BYTES": workspace}).ds_dq
    assert not _spec(128, fusable=True, options={**DS, "DS_MAX_BYTES": workspace - 1}).ds_dq
    for target in (SM80, INTERPRETER):
        assert _spec(64, fusable=True, target=target, options=DS).ds_dq
        assert not _spec(64, fusable=False, target=target, options=DS).ds_dq


@pytest.mark.parametrize("masked", [True, False])
def test_ds_backward_at_the_sm90_ds_tiles(spy_specs, monkeypatch, masked):
    """The interpreter runs the dS mode at the sm_90 tiles (128-row dQ programs over 64-key
    tiles, dK/dV at 64 x 64): ragged lengths, TMA loads and stores, with and without a mask."""
    monkeypatch.setattr(ds_workspace, "tiles",
                        lambda target, e_pad, dtype: ds_workspace.HOPPER_DS_TILES[128])
    options = {**DS, "bwd_USE_TMA": True}
    q, k, v = make_qkv(1, 2, 2, 200, 190, 16, dtype=torch.bfloat16, seed=46)
    if masked:
        block_mask = create_block_mask(mods.causal, None, None, 200, 190, device="cpu")
        check_backward(q, k, v, mods.softcap(6.0), mods.causal, block_mask,
                       kernel_options=options)
    else:
        check_backward(q, k, v, mods.alibi(2), kernel_options=options)
    assert spy_specs and all(s.ds_dq and s.block_m2 == 128 and s.block_n2 == 64
                             for s in spy_specs)


def test_ds_is_not_used_where_it_cannot_be(spy_specs):
    """A captured tensor that needs a gradient (the dQ kernel computes it from P): the two
    kernels, correct gradients."""
    q, k, v = make_qkv(1, 2, 2, 64, 64, 16, dtype=torch.bfloat16, seed=45)
    bias = torch.zeros(2, requires_grad=True)

    def learnable(score, b, h, q_idx, kv_idx):
        return score + bias[h]
    check_backward(q, k, v, learnable, buffers=(bias,),
                   kernel_options={"BLOCK_M": 32, "BLOCK_N": 32, **DS})
    assert spy_specs and not any(s.ds_dq for s in spy_specs)


def test_ds_workspace_rule_and_budget():
    cpu = torch.device("cpu")
    asked = []

    def size(n):
        def workspace():  # the workspace size is asked for only when the rest allows it
            asked.append(n)
            return n
        return workspace

    def use(fusable, n, options=None):
        call = AttentionCall(None, None, None, 0.1, parse_kernel_options(options), 1)
        return ds_workspace.allowed(call, fusable, size(n), cpu)

    # opt-in only: the default and 'AUTO' never take it, not even a tiny one
    for options in (None, {"DS_WORKSPACE": "AUTO"}, {"DS_WORKSPACE": False}):
        assert not use(True, 1, options)
    assert not use(False, 1 << 20, DS)  # captured grads / no dK, dV
    assert asked == []
    assert use(True, 1 << 30, DS)  # within the default 8 GiB
    assert not use(True, (8 << 30) + 1, DS)
    small = {**DS, "DS_MAX_BYTES": 1 << 20}
    assert use(True, 1 << 20, small)
    assert not use(True, (1 << 20) + 1, small)  # over the budget
    assert asked == [1 << 30, (8 << 30) + 1, 1 << 20, (1 << 20) + 1]
    with pytest.raises(InputTypeError,
                       match=r"kernel_options\['DS_WORKSPACE'\] must be True, False or 'AUTO', got str 'yes'"):
        use(True, 1 << 20, {"DS_WORKSPACE": "yes"})
    for bad in (0, -5):
        with pytest.raises(InputError, match=rf"kernel_options\['DS_MAX_BYTES'\] = {bad} is not "
                                             "allowed; a positive number of bytes"):
            use(True, 1 << 20, {**DS, "DS_MAX_BYTES": bad})


def test_workspace_bands_follow_the_mask():
    """bands: one slot per (kv block, q block) in each kv block's band of q blocks; causal
    keeps about half of the dense grid, a document mask its diagonal blocks."""
    L = S = 512  # 4 x 4 blocks of 128
    causal = create_block_mask(mods.causal, None, None, L, S, device="cpu", BLOCK_SIZE=128)
    band, slots = ds_workspace.bands(causal, L, S, 128, 128, torch.device("cpu"))
    # kv block j meets q blocks j..3: widths 4, 3, 2, 1
    assert band[0, 0].tolist() == [[0, 0], [4, 1], [7, 2], [9, 3]] and slots == 10
    doc = torch.tensor([0] * 256 + [1] * 256)

    def same_document(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]
    docs = create_block_mask(same_document, None, None, L, S, device="cpu", BLOCK_SIZE=128)
    band, slots = ds_workspace.bands(docs, L, S, 128, 128, torch.device("cpu"))
    assert band[0, 0, :, 1].tolist() == [0, 0, 2, 2] and slots == 8
    dense, slots = ds_workspace.bands(None, 300, 200, 128, 64, torch.device("cpu"))
    assert slots == 3 * 4 and dense[0, 0].tolist() == [[0, 0], [3, 0], [6, 0], [9, 0]]


@pytest.mark.parametrize("which", ["dkdv", "dq"])
def test_ds_kernels_compile_for_sm90_with_tma(which):
    """The dS store (dK/dV) and load (dQ) go through tensor descriptors on sm_90: TMA bulk
    copies and wgmma in both kernels."""
    from flexfa import compile_check

    name = f"bwd_ds_{which}_d128_bf16_causal"
    result = compile_check.compile_job(name, 90, compile_check.REGISTRY[name])
    assert result.ok, result.error
    assert result.wgmma and "cp.async.bulk.tensor" in result.ptx
    if which == "dkdv":  # the store of dS: a bulk copy from shared to global memory
        assert "cp.async.bulk.tensor.2d.global.shared" in result.ptx
    else:  # at the dS mode's tiles: 128-row programs on 8 warps, nothing spilled
        assert result.spill_bytes in (None, 0), result.spill_bytes


def test_out_of_memory_for_the_workspace_falls_back_to_the_recomputing_kernels(monkeypatch):
    """The workspace fit the budget when the signature was planned but cannot be allocated
    now: the call runs the dQ kernel that recomputes P and dP, with correct gradients."""
    specs = record_backward_specs(monkeypatch)
    q, k, v = make_qkv(1, 2, 2, 64, 64, 16, dtype=torch.float32, seed=46)
    workspace = 1 * 2 * 1 * 64 * 64  # B * Hq * slots * tile: one 64 x 64 block (no mask)

    def no_room(shape, **kwargs):
        raise torch.cuda.OutOfMemoryError("no room for the dS workspace (test)")
    failed = replace_workspace(monkeypatch, workspace, no_room)
    check_backward(q, k, v, mods.softcap(4.0),
                   kernel_options={"BLOCK_M": 64, "BLOCK_N": 64, **DS})
    assert failed and [s.ds_dq for s in specs] == [True, False]


@pytest.mark.parametrize("tma", [False, True])
def test_unwritten_workspace_entries_never_reach_the_gradients(monkeypatch, tma):
    """On a GPU the workspace holds whatever the allocator's memory held: here it starts as
    NaN. Keys past S (the last block's padding, never written by dK/dV) are masked when read;
    queries past L only reach dq rows that are not stored; tiles the mask skips are never read."""
    specs = record_backward_specs(monkeypatch)
    # S = 40: the dK/dV programs (32 keys each) write key rows 0..63, the dQ kernel walks the
    # whole 128-key block, so rows 64..127 are read unwritten
    B, H, L, S, E = 1, 2, 90, 40, 16
    q, k, v = make_qkv(B, H, H, L, S, E, dtype=torch.bfloat16, seed=47)
    workspace = B * H * 1 * 128 * 128  # one 128 x 128 block slot per head (L, S < 128)
    poisoned = replace_workspace(monkeypatch, workspace, nan_filled)
    block_mask = create_block_mask(mods.causal, None, None, L, S, device="cpu", BLOCK_SIZE=128)
    dq, dk, dv = check_backward(q, k, v, mods.softcap(6.0), mods.causal, block_mask,
                                kernel_options={"BLOCK_M": 32, "BLOCK_N": 32,
                                                "bwd_USE_TMA": tma, **DS})
    assert poisoned and specs and all(s.ds_dq and s.use_tma == tma for s in specs)
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))


def test_blocks_inside_a_band_that_the_mask_skips_are_never_read(monkeypatch):
    """A mask with holes (every other 64-token block pair): each kv block's band spans q
    blocks it does not meet; their slots stay unwritten (NaN here) and unread."""
    specs = record_backward_specs(monkeypatch)
    L = S = 256
    q, k, v = make_qkv(1, 2, 2, L, S, 16, dtype=torch.float32, seed=48)

    def checkerboard(b, h, q_idx, kv_idx):
        return (q_idx // 64 + kv_idx // 64) % 2 == 0
    block_mask = create_block_mask(checkerboard, None, None, L, S, device="cpu", BLOCK_SIZE=64)
    band, slots = ds_workspace.bands(block_mask, L, S, 64, 64, torch.device("cpu"))
    assert slots == 4 * 3  # kv blocks 0, 1, 2, 3 span q blocks 0-2, 1-3, 0-2, 1-3
    poisoned = replace_workspace(monkeypatch, 1 * 2 * slots * 64 * 64, nan_filled)
    dq, dk, dv = check_backward(q, k, v, None, checkerboard, block_mask,
                                kernel_options={"BLOCK_M": 32, "BLOCK_N": 32, **DS})
    assert poisoned and specs and all(s.ds_dq for s in specs)
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))


def test_gpu_budget_is_capped_by_the_free_memory_of_the_calls_gpu(monkeypatch):
    """On a GPU (memory queries faked: no GPU here) the budget is DS_MAX_BYTES, else the
    default at most a quarter of the GPU, and never more than half of what the call's GPU
    has free now."""
    gib = 1 << 30
    memory = {0: (60 * gib, 80 * gib), 1: (2 * gib, 16 * gib)}  # (free, total) per GPU
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: memory[device.index])

    def budget(index, options=None):
        call = AttentionCall(None, None, None, 0.1, parse_kernel_options(options), 1)
        return ds_workspace.budget(call, torch.device("cuda", index))
    assert budget(0) == ds_workspace.DEFAULT_MAX_BYTES  # 8 GiB < 80 / 4 and < 60 / 2
    assert budget(1) == gib  # half of the 2 GiB free (a quarter of 16 is 4)
    memory[1] = (16 * gib, 16 * gib)
    assert budget(1) == 4 * gib  # a quarter of the GPU
    assert budget(0, {"DS_MAX_BYTES": 40 * gib}) == 30 * gib  # even when asked for more
    assert budget(0, {"DS_MAX_BYTES": 12345}) == 12345


def test_default_budget_keeps_long_contexts_lean():
    """The default budget (8 GiB) admits the benchmark's E = 128 S = 16384 workspaces (causal
    4.3 GB, dense 8 GiB) and keeps causal S = 65536 with 8 heads (tests/gpu/test_memory_gpu.py,
    34 GB) on the kernels that allocate nothing L x S."""
    cpu = torch.device("cpu")

    def call(options=None):
        return AttentionCall(None, None, None, 0.1, parse_kernel_options(options), 1)
    budget = ds_workspace.budget(call(), cpu)
    assert budget == ds_workspace.DEFAULT_MAX_BYTES == 8 << 30
    assert ds_workspace.budget(call({"DS_MAX_BYTES": 12345}), cpu) == 12345

    def workspace(heads, length, block_mask):
        _, slots = ds_workspace.bands(block_mask, length, length, 128, 128, cpu)
        return heads * slots * 128 * 128 * 2

    mask = create_block_mask(mods.causal, None, None, 16384, 16384, device="cpu")
    assert workspace(16, 16384, mask) <= budget and workspace(16, 16384, None) <= budget
    mask = create_block_mask(mods.causal, None, None, 65536, 65536, device="cpu")
    assert workspace(8, 65536, mask) > 4 * budget


@pytest.mark.parametrize("tma", [False, True])
def test_a_plan_launches_as_its_first_launch_was_specialized_after_a_table_edit(monkeypatch,
                                                                                 tma):
    """On a GPU a plan's steps launch their first launch's compiled kernel directly
    (``launch.Step``), so no argument Triton specializes on may change between its launches:
    MAX_SLOTS follows the tables' contents, which an in-place edit changes under the same
    plan (1 slot per head, then 3: a kernel compiled for the constant 1 would overlap the
    heads' workspace regions). The interpreter specializes nothing: this records what a GPU
    would, and the gradients after the edit against the reference."""
    launched, changed = specialization_spy(monkeypatch)
    L, block = 96, 32
    q, k, v = make_qkv(1, 2, 2, L, L, 16, seed=3)
    kv_num_blocks = torch.tensor([[[1, 0, 0]]], dtype=torch.int32)  # block (0, 0) alone
    kv_indices = torch.zeros(1, 1, 3, 3, dtype=torch.int32)

    def same_block(b, h, q_idx, kv_idx):
        return q_idx // block == kv_idx // block
    mask = BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=block,
                                    mask_mod=same_block)

    options = {**DS, "bwd_USE_TMA": tma}  # (with TMA: the workspace's descriptors)

    def call() -> None:
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        flexfa.flex_attention(*inputs, block_mask=mask, kernel_options=options).sum().backward()
    call()
    call()
    kv_num_blocks.fill_(1)  # the diagonal blocks, the mask_mod's own
    kv_indices[0, 0, :, 0] = torch.arange(3)
    mask.q_num_blocks.copy_(kv_num_blocks)
    mask.q_indices.copy_(kv_indices)
    call()  # the plan of the calls before: the same upstream gradient's layout
    check_backward(q, k, v, None, same_block, mask, kernel_options=options)
    assert launched and not changed, f"specialized otherwise than at first: {changed}"
