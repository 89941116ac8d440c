"""Large and odd head dims under the interpreter: E = 80 and 96 (padded to 128), E = 192 with
Ev = 128 (DeepSeek's MLA: q/k and v padded apart, 256 and 128) and E = 256, forward (both
forward families) and backward (pointer loads and tensor descriptors) against the float64
reference with a score_mod and a block mask; and the tiles the runtime picks for them on sm_90
(no GPU needed: the choice is host code)."""
import dataclasses

import pytest
import torch

from flexfa import mods
from flexfa.codegen.spec import head_dim_blocks
from flexfa.blockmask import create_block_mask
from flexfa.runtime import autotune
from flexfa.runtime.call import AttentionCall, Dropout
from flexfa.runtime.families import backward as backward_family
from flexfa.runtime.families.hopper import HOPPER
from flexfa.runtime.options import KernelOptions
from flexfa.runtime.pipeline import prepare_mask
from flexfa.runtime.target import INTERPRETER, Target
from backward_utils import check_backward, record_backward_specs
from forward_utils import TEMPLATES, check_forward, make_qkv

SM90 = Target("cuda", 9, 0)
# L and S that are not tile multiples; a window and a soft cap: masked and partial tiles
L, S = 64, 80


def _mask():
    return create_block_mask(mods.sliding_window(40), None, None, L, S, device="cpu",
                             BLOCK_SIZE=64)


@pytest.mark.parametrize("family", ["ampere", "hopper"])
@pytest.mark.parametrize("E,Ev", [(80, 80), (96, 96), (192, 128), (256, 256)])
def test_forward_matches_the_reference(family, E, Ev):
    q, k, v = make_qkv(1, 2, 2, L, S, E, Ev, dtype=torch.bfloat16, seed=E + Ev)
    check_forward(q, k, v, mods.softcap(20.0), mods.sliding_window(40), _mask(),
                  kernel_options=TEMPLATES[family])


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("E,Ev", [(96, 96), (192, 128), (256, 256)])
def test_backward_matches_the_reference(spy_specs, E, Ev, tma):
    q, k, v = make_qkv(1, 2, 2, L, S, E, Ev, dtype=torch.bfloat16, seed=E - Ev)
    check_backward(q, k, v, mods.softcap(20.0), mods.sliding_window(40), _mask(), with_lse=True,
                   kernel_options={"bwd_USE_TMA": tma})
    (spec,) = spy_specs
    assert spec.use_tma == tma and (spec.head_dim, spec.head_dim_v) == (E, Ev)
    # q/k and v pad apart: E = 192 reads 256 columns of q and k, Ev = 128 of v
    constexprs = spec.dkdv_constexprs(False)
    assert (constexprs["E_PAD"], constexprs["EV_PAD"]) == (
        256 if E > 128 else 128, 256 if Ev > 128 else 128)
    # 256 in one column block walks the window's partial and full blocks in one loop
    assert constexprs["ONE_LOOP"] == (E == 256)


@pytest.mark.parametrize("gqa", [1, 2])
def test_backward_one_loop_without_score_mod(spy_specs, gqa):
    # ONE_LOOP with dscore = 1 (P masked once, dS from it) and a causal mask (the diagonal
    # blocks partial, the rest full), GQA's loop over query heads around the walk
    q, k, v = make_qkv(1, 2 * gqa, 2, L, S, 256, 256, dtype=torch.bfloat16, seed=gqa)
    causal = create_block_mask(mods.causal, None, None, L, S, device="cpu", BLOCK_SIZE=32)
    check_backward(q, k, v, None, mods.causal, causal, enable_gqa=gqa > 1)
    (spec,) = spy_specs
    assert spec.dkdv_constexprs(True)["ONE_LOOP"]


@pytest.mark.parametrize("mask_mod, gqa, one_loop", [
    (mods.causal, 2, True), (mods.sliding_window(40), 4, True),
    (mods.causal, 1, False), (None, 2, False)])
def test_backward_one_loop_at_192_with_gqa(spy_specs, mask_mod, gqa, one_loop):
    # E = 192 (column blocks 128 + 64) with Ev = 128 on 8 warps (sm_90's tiles at tile
    # multiples) under a block mask with GQA: the one loop (dS^T formed under the mask's
    # branch); without GQA or a block mask, or on 4 warps (the ragged lengths' tiles, and the
    # interpreter's default), the two loops
    q, k, v = make_qkv(1, 2 * gqa, 2, L, S, 192, 128, dtype=torch.bfloat16, seed=gqa + 7)
    mask = (create_block_mask(mask_mod, None, None, L, S, device="cpu", BLOCK_SIZE=32)
            if mask_mod else None)
    check_backward(q, k, v, mods.softcap(20.0), mask_mod, mask, enable_gqa=gqa > 1,
                   with_lse=True, kernel_options={"bwd_USE_TMA": True, "bwd_num_warps": 8})
    (spec,) = spy_specs
    assert spec.num_warps == 8 and spec.column_blocks == (128, 64)
    dkdv = spec.dkdv_constexprs(False)
    assert dkdv["ONE_LOOP"] == one_loop and dkdv["DV_LAST"] and not dkdv["ROW_OFFSETS"]
    assert not dataclasses.replace(spec, num_warps=4).dkdv_constexprs(False)["ONE_LOOP"]
    assert not dataclasses.replace(spec, dropout=True).dkdv_constexprs(False)["ONE_LOOP"]


@pytest.mark.parametrize("E, Ev, gqa, score_mod, mask_mod, one_loop", [
    (256, 256, 1, mods.softcap(20.0), mods.causal, True),
    (256, 256, 2, None, mods.causal, True),                   # dscore = 1: P's absolute value
    (256, 256, 1, None, mods.sliding_window(40), True),
    (192, 128, 2, mods.softcap(20.0), mods.causal, False)])  # not at 192 with dropout
def test_backward_one_loop_with_dropout(spy_specs, E, Ev, gqa, score_mod, mask_mod, one_loop):
    # dropout under a block mask at 256: the one loop draws the keep mask into P's sign bit
    # before the mask's branch and takes dP^T through it there, dV from the dropped P last;
    # every gradient against the float64 reference fed the same keep mask
    q, k, v = make_qkv(1, 2 * gqa, 2, L, S, E, Ev, dtype=torch.bfloat16, seed=E + gqa)
    mask = create_block_mask(mask_mod, None, None, L, S, device="cpu", BLOCK_SIZE=32)
    check_backward(q, k, v, score_mod, mask_mod, mask, with_lse=True, enable_gqa=gqa > 1,
                   dropout=(0.3, 1234),
                   kernel_options={"bwd_USE_TMA": True, "bwd_num_warps": 8})
    (spec,) = spy_specs
    dkdv = spec.dkdv_constexprs(score_mod is None)
    assert spec.dropout and dkdv["ONE_LOOP"] == one_loop and dkdv["DV_LAST"] == one_loop
    # without a block mask (the unmasked tile body has no dropout path) never
    assert not dataclasses.replace(spec, has_block_mask=False).dkdv_constexprs(False)["ONE_LOOP"]


@pytest.mark.parametrize("E,Ev,gqa,tma", [(256, 256, 1, True), (256, 256, 2, False),
                                           (192, 128, 2, True)])
def test_backward_wide_without_block_mask_ragged(spy_specs, E, Ev, gqa, tma):
    # no block mask, L and S not tile multiples: at 256 the dK/dV kernel runs the one loop's
    # tile body (APPLY_MASK False); past 128 the dQ kernel checks bounds on every key tile
    # (RAGGED_APART off); GQA's heads around the walk
    q, k, v = make_qkv(2, 2 * gqa, 2, L + 8, S + 10, E, Ev, dtype=torch.bfloat16, seed=E + gqa)
    check_backward(q, k, v, mods.softcap(20.0), enable_gqa=gqa > 1, with_lse=True,
                   kernel_options={"bwd_USE_TMA": tma})
    (spec,) = spy_specs
    assert not spec.even_l1 and not spec.even_s2 and not spec.has_block_mask
    dkdv = spec.dkdv_constexprs(False)
    assert dkdv["ONE_LOOP"] == (E == 256) and dkdv["DV_LAST"]
    assert dkdv["ROW_OFFSETS"] == (E == 256 and tma)
    # without a score_mod (dscore = 1) the two-loop body: it measured faster there
    assert not spec.dkdv_constexprs(True)["ONE_LOOP"]
    assert not spec.dq_constexprs(False, False)["RAGGED_APART"]
    # the q tiles in one bounds-checked body past 128 at a ragged L (RAGGED_L_APART off)
    assert not dkdv["RAGGED_L_APART"]
    assert dataclasses.replace(spec, even_l1=True).dkdv_constexprs(False)["RAGGED_L_APART"]
    narrow = dataclasses.replace(spec, head_dim=128, head_dim_v=128)
    assert narrow.dq_constexprs(False, False)["RAGGED_APART"]
    assert not narrow.dkdv_constexprs(False)["ONE_LOOP"]
    assert narrow.dkdv_constexprs(False)["RAGGED_L_APART"]


@pytest.fixture
def spy_specs(monkeypatch):
    return record_backward_specs(monkeypatch)


# ---- split q/k head dims: the backward holds Q, K, dQ and dK in two column blocks ----


@pytest.mark.parametrize("E,blocks", [(192, (128, 64)), (96, (64, 32)), (80, (64, 16)),
                                      (160, (128, 32)), (72, (64, 16)), (40, (32, 16)),
                                      (200, (256, 0)), (100, (128, 0)), (24, (32, 0)),
                                      (128, (128, 0)), (8, (16, 0))])
def test_head_dim_blocks(E, blocks):
    # two powers of two where they cover E in fewer columns than its padding, else one
    assert head_dim_blocks(E) == blocks


def test_the_split_runs_on_sm90_and_the_interpreter_and_past_128_elsewhere():
    sm80 = Target("cuda", 8, 0)
    for target in (SM90, INTERPRETER):
        assert [backward_family.split_head_dim(E, target) for E in (192, 96, 80, 128, 100)] \
            == [True, True, True, False, False]
    # sm_80's kernels at 96 and 80 spill with the blocks (docs/head-dims.md)
    assert [backward_family.split_head_dim(E, sm80) for E in (192, 160, 96, 80)] == \
        [True, True, False, False]


def _split_case(E, Ev, L=72, S=100, Hq=4, Hkv=2, dtype=torch.bfloat16):
    # L and S not multiples of the interpreter's 64-row tiles; GQA 2
    q, k, v = make_qkv(1, Hq, Hkv, L, S, E, Ev, dtype=dtype, seed=E + 7 * Ev)
    return q, k, v, create_block_mask(mods.causal, None, None, L, S, device="cpu",
                                      BLOCK_SIZE=64)


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("E,Ev", [(192, 128), (96, 96), (80, 80)])
def test_split_backward_softcap_causal_gqa(spy_specs, E, Ev, tma):
    q, k, v, causal = _split_case(E, Ev)
    check_backward(q, k, v, mods.softcap(20.0), mods.causal, causal, enable_gqa=True,
                   with_lse=True, kernel_options={"bwd_USE_TMA": tma})
    (spec,) = spy_specs
    assert spec.split_head_dim and spec.use_tma == tma
    flags = spec.dq_constexprs(False, False)
    assert (flags["E_A"], flags["E_B"]) == head_dim_blocks(E) == spec.column_blocks


@pytest.mark.parametrize("tma", [False, True])
def test_split_backward_learnable_bias_dense(spy_specs, tma):
    # a captured tensor's gradient (the dQ kernel's BUFFER_GRADS) with the split at 80, no
    # mask; E = 72's second block runs past E (64 + 16 for 72 columns: zeros, TMA's fill)
    for E in (80, 72):
        q, k, v, _ = _split_case(E, 48, Hq=2)
        bias = (0.3 * torch.randn(2, 72, 100, generator=torch.Generator().manual_seed(E)))
        bias.requires_grad_()

        def learnable(score, b, h, q_idx, kv_idx):
            return score + bias[h, q_idx, kv_idx]
        check_backward(q, k, v, learnable, buffers=(bias,), enable_gqa=True,
                       kernel_options={"bwd_USE_TMA": tma})
    assert [s.column_blocks for s in spy_specs] == [(64, 16), (64, 16)]


@pytest.mark.parametrize("tma", [False, True])
def test_split_backward_with_the_ds_workspace(spy_specs, tma):
    # dK/dV stores dS^T, dQ = dS @ K block by block
    q, k, v, causal = _split_case(192, 128)
    check_backward(q, k, v, None, mods.causal, causal, enable_gqa=True,
                   kernel_options={"DS_WORKSPACE": True, "bwd_USE_TMA": tma})
    assert [(s.ds_dq, s.split_head_dim) for s in spy_specs] == [(True, True)]


def test_split_backward_float32_pointer_loads(spy_specs):
    q, k, v, causal = _split_case(40, 24, dtype=torch.float32)
    check_backward(q, k, v, mods.softcap(10.0), mods.causal, causal, enable_gqa=True)
    assert [(s.split_head_dim, s.use_tma) for s in spy_specs] == [(True, False)]


def _call():
    return AttentionCall(None, None, None, 0.125, KernelOptions(), 1)


@pytest.mark.parametrize("E,Ev,default", [
    (192, 128, autotune.HOPPER_CONFIGS_WIDE_QK[256, 128][0]),
    (256, 256, autotune.HOPPER_CONFIGS[256][0]),
    (96, 96, autotune.HOPPER_CONFIGS[128][0]),  # padded to 128: the tuned E = 128 tiles
])
def test_sm90_forward_defaults(monkeypatch, E, Ev, default):
    monkeypatch.setenv("FLEXFA_AUTOTUNE", "0")
    q, k = (torch.empty(2, 16, 4096, E, dtype=torch.bfloat16) for _ in range(2))
    v = torch.empty(2, 16, 4096, Ev, dtype=torch.bfloat16)  # never touched: no launch
    assert HOPPER.why_not(SM90, _call(), q, k, v) is None
    assert HOPPER.choose_config(q, k, v, _call(), SM90, False, None, None) == default


def test_sm90_backward_defaults_need_descriptors():
    q, k = (torch.empty(1, 2, 256, 192, dtype=torch.bfloat16) for _ in range(2))
    v = torch.empty(1, 2, 256, 128, dtype=torch.bfloat16)
    spec = backward_family.backward_spec(q, k, v, _call(), False, SM90)
    m1, n1, m2, n2, warps, stages, dq_warps, _ = backward_family.HOPPER_BACKWARD_WIDE[256, 128][0]
    assert spec.use_tma and (spec.block_m1, spec.block_n1, spec.block_m2, spec.block_n2,
                             spec.num_warps) == (m1, n1, m2, n2, warps)
    # the dQ kernel launches with its own warps (8: wgmma at 64 rows)
    assert spec.dq_launch_options()["num_warps"] == dq_warps == 8
    # rows of a [B, L, H, E] tensor seen as [B, H, L, E]: no descriptors, the generic tiles
    # (the 4-warp ones spill 700..2700 bytes on pointer loads)
    strided = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
    spec = backward_family.backward_spec(*strided, _call(), False, SM90)
    generic = backward_family.default_tiles(256, torch.bfloat16, SM90, 128, tma=False)
    assert not spec.use_tma and spec.num_warps == generic[4] == 8


def test_sm90_backward_tunes_the_wide_candidates(tmp_path, monkeypatch):
    """At E = Ev = 256 the sm_90 backward times its wide candidates (dQ's own warps and
    stages included; timed launches faked: no GPU here) and keeps the fastest."""
    monkeypatch.setenv("FLEXFA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "MIN_TUNED_WORK", 0)
    autotune.clear_memo()
    candidates = backward_family.HOPPER_BACKWARD_WIDE[256, 256]
    timed = []

    def fake_plan(self, spec, call, x, joint):
        dq = spec.dq_launch_options()
        timed.append((spec.block_m1, spec.block_n1, spec.block_m2, spec.block_n2,
                      spec.num_warps, spec.num_stages, dq["num_warps"], dq["num_stages"]))
    monkeypatch.setattr(backward_family.Backward, "make_plan", fake_plan)
    monkeypatch.setattr(autotune.triton.testing, "do_bench",
                        lambda fn, **kw: 1.0 if timed[-1] == candidates[1] else 2.0)
    q = torch.randn(1, 2, 128, 256, dtype=torch.bfloat16)
    x = backward_family.Inputs(q, q.clone(), q.clone(), q.clone(), torch.zeros(1, 2, 128),
                               q.clone(), None, q.clone(), q.clone(), q.clone(), {})
    try:
        chosen = backward_family.BACKWARD.choose_config(_call(), x, None, True, SM90)
    finally:
        autotune.clear_memo()
    assert chosen == candidates[1] and timed == list(candidates)
    assert backward_family._label(chosen) == "32x64/128x32 w8 s2 dq w8 s2"


@pytest.mark.parametrize("L,S,ragged", [(256, 256, False), (8192, 4096, False),
                                        (200, 256, True), (256, 8100, True), (64, 64, True)])
def test_sm90_wide_backward_default_follows_ragged_lengths(L, S, ragged):
    """Past 128, lengths that are not multiples of 128 (the bounds-checked code) take the
    4-warp dK/dV tiles, where the 8-warp ones spill and lose on the H200; the dQ tiles and
    the candidates are the same; such lengths tune under their own key."""
    assert backward_family.ragged_lengths(torch.empty(1, 1, L, 8), torch.empty(1, 1, S, 8)) \
        is ragged
    for E, Ev in ((192, 128), (256, 256)):
        q, k = (torch.empty(1, 2, n, E, dtype=torch.bfloat16) for n in (L, S))
        v = torch.empty(1, 2, S, Ev, dtype=torch.bfloat16)
        spec = backward_family.backward_spec(q, k, v, _call(), False, SM90)
        pair = (256, 128 if Ev == 128 else 256)
        want = (backward_family.HOPPER_BACKWARD_WIDE_RAGGED[pair] if ragged
                else backward_family.HOPPER_BACKWARD_WIDE[pair][0])
        m1, n1, m2, n2, warps, stages, dq_warps, dq_stages = want
        assert (spec.block_m1, spec.block_n1, spec.num_warps) == (
            min(m1, 128), min(n1, 128), warps)
        assert spec.dq_launch_options()["num_warps"] == dq_warps
        candidates = backward_family.hopper_candidates(*pair, ragged)
        assert candidates[0] == want
        assert set(candidates) >= set(backward_family.HOPPER_BACKWARD_WIDE[pair])
    # at 128 and below the lengths change nothing
    assert backward_family.hopper_candidates(128, 128, True) == \
        backward_family.hopper_candidates(128, 128)


@pytest.mark.parametrize("E,Ev,dropout", [(256, 256, False), (256, 256, True),
                                           (192, 192, False), (192, 128, False)])
def test_sm90_wide_backward_under_a_block_mask_at_ragged_lengths(E, Ev, dropout):
    """Under a block mask, ragged lengths at padded 256/256 take the even lengths' 8-warp
    64-key dK/dV tiles (1.4x faster than the 4-warp ones on the H200 with causal, softcap,
    ALiBi, document masks, GQA and dropout); at 192/128 and without a mask the ragged
    default stays, and the candidates are the same set either way."""
    L = 200
    q, k = (torch.empty(1, 2, L, E, dtype=torch.bfloat16) for _ in range(2))
    v = torch.empty(1, 2, L, Ev, dtype=torch.bfloat16)
    block_mask = create_block_mask(mods.causal, None, None, L, L, device="cpu")
    masked = AttentionCall(None, prepare_mask(block_mask), block_mask, 0.125, KernelOptions(), 1,
                           dropout=Dropout(0.1, torch.zeros(2, dtype=torch.int64))
                           if dropout else None)
    pair = (256, 128 if Ev == 128 else 256)
    even, ragged = (backward_family.HOPPER_BACKWARD_WIDE[pair][0],
                    backward_family.HOPPER_BACKWARD_WIDE_RAGGED[pair])
    for call, want in ((masked, even if pair == (256, 256) else ragged), (_call(), ragged)):
        assert backward_family.ragged_default(q, k, v, call) is (want == ragged)
        spec = backward_family.backward_spec(q, k, v, call, False, SM90)
        assert (spec.block_m1, spec.block_n1, spec.num_warps) == (
            min(want[0], 128), min(want[1], 128), want[4]), (call.block_mask is None, spec)
    # tile multiples take the even default with or without a mask
    q256, k256 = (torch.empty(1, 2, 256, E, dtype=torch.bfloat16) for _ in range(2))
    assert not backward_family.ragged_default(q256, k256, v, masked)


def test_sm90_wide_backward_tunes_ragged_lengths_under_their_own_key(monkeypatch):
    monkeypatch.setattr(autotune, "MIN_TUNED_WORK", 0)
    monkeypatch.setattr(autotune, "enabled", lambda: True)
    keys = []
    monkeypatch.setattr(autotune, "tune", lambda key, candidates, *rest: keys.append(
        (key, candidates[0])) or candidates[0])
    for L, E in ((256, 256), (200, 256), (200, 64)):
        q = torch.randn(1, 2, L, E, dtype=torch.bfloat16)
        x = backward_family.Inputs(q, q.clone(), q.clone(), q.clone(), torch.zeros(1, 2, L),
                                   q.clone(), None, q.clone(), q.clone(), q.clone(), {})
        backward_family.BACKWARD.choose_config(_call(), x, None, True, SM90)
    assert keys[0][0].startswith("bwd|") and keys[1][0].startswith("bwd_ragged|")
    assert keys[0][1] == backward_family.HOPPER_BACKWARD_WIDE[256, 256][0]
    assert keys[1][1] == backward_family.HOPPER_BACKWARD_WIDE_RAGGED[256, 256]
    assert keys[2][0].startswith("bwd|")  # up to 128 ragged lengths share the key


def test_sm90_split_head_dims_tune_under_their_own_key(monkeypatch):
    """192 in column blocks of 128 and 64 is another kernel than 256 (and 48 than 64): its
    own tuned winners, though the padded dims are the same."""
    monkeypatch.setattr(autotune, "MIN_TUNED_WORK", 0)
    monkeypatch.setattr(autotune, "enabled", lambda: True)
    keys = []
    monkeypatch.setattr(autotune, "tune", lambda key, *rest: keys.append(key) or rest[0][0])
    for E, Ev, L in ((256, 128, 256), (192, 128, 256), (192, 128, 200), (64, 64, 256),
                     (48, 64, 256)):
        q = torch.randn(1, 2, L, E, dtype=torch.bfloat16)
        v = torch.randn(1, 2, L, Ev, dtype=torch.bfloat16)
        x = backward_family.Inputs(q, q.clone(), v, v.clone(), torch.zeros(1, 2, L),
                                   v.clone(), None, q.clone(), q.clone(), v.clone(), {})
        backward_family.BACKWARD.choose_config(_call(), x, None, True, SM90)
    assert [key.split("|")[0] for key in keys] == [
        "bwd", "bwd_split", "bwd_ragged_split", "bwd", "bwd_split"]
    assert len({key.split("|", 1)[1] for key in keys[:2]}) == 1  # the same padded dims
