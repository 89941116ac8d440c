"""The Gluon backward family on the CPU: opt-in under GLUON_BACKWARD=True with the Triton backward
as the fallback, its refusals (each a phrase naming what it does not do), the spec it plans,
the module it renders, and its row kernels (lse2/delta before the Gluon kernel, dQ's scale
and cast after) run under the interpreter against torch. Its sm_90 compile check is in
test_gluon_compile.py, its GPU tests in tests/gpu/test_gluon_bwd_gpu.py."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flexfa
from flexfa import mods
from flexfa.codegen.gluon_bwd import RowsSpec, gluon_bwd_kernel
from flexfa.runtime import registry
from flexfa.runtime.call import AttentionCall
from flexfa.runtime.families import gluon_bwd as gluon_bwd_module
from flexfa.runtime.families.backward import Inputs, joint_graph
from flexfa.runtime.families.gluon_bwd import (GLUON_BWD, SHARED_BYTES, dq_parts, dq_slots,
                                               gluon_bwd_spec, padded_rows, part_streams,
                                               row_steps, run_post, run_pre, shared_bytes,
                                               why_not_gluon_bwd, zero_step)
from flexfa.features import prepare_dropout
from flexfa.runtime.options import parse_kernel_options
from flexfa.runtime.pipeline import prepare_mask, prepare_score_mod
from flexfa.runtime.target import INTERPRETER, Target

SM90, SM80 = Target("cuda", 9, 0), Target("cuda", 8, 0)
FORCED = {"GLUON_BACKWARD": True}


def _call(options=None, block_mask=None, score_mod=None, gqa_group=1, dropout_p=0.0,
          sinks=None):
    return AttentionCall(prepare_score_mod(score_mod), prepare_mask(block_mask), block_mask,
                         0.125, parse_kernel_options(options), gqa_group, sinks,
                         dropout=prepare_dropout(dropout_p, (5, 1), "cpu"))


def _qkv(L=256, E=128, Ev=None, dtype=torch.bfloat16):
    return (torch.zeros(1, 2, L, E, dtype=dtype), torch.zeros(1, 2, L, E, dtype=dtype),
            torch.zeros(1, 2, L, Ev or E, dtype=dtype))


def _mask(L, block=128, mask_mod=mods.causal):
    return flexfa.create_block_mask(mask_mod, None, None, L, L, device="cpu", BLOCK_SIZE=block)


def test_gluon_backward_forced_or_off_with_triton_as_fallback():
    q, k, v = _qkv()  # L = S = 256: shorter than the default takes it
    assert registry.choose("backward", SM90, _call(FORCED), q, k, v) is GLUON_BWD
    assert registry.choose("backward", SM90, _call({**FORCED, "BACKEND": "HOPPER"}), q, k,
                           v) is GLUON_BWD  # the forward's family does not matter
    for options in (None, {"BACKEND": "HOPPER"}, {"BACKEND": "AUTO"}, {"BACKEND": "GLUON"},
                    {"GLUON_BACKWARD": False}, {"GLUON_BACKWARD": "AUTO"}):
        assert registry.choose("backward", SM90, _call(options), q, k, v).name == "triton_bwd"
    # where it cannot run, GLUON_BACKWARD leaves the backward to the Triton family
    for target in (INTERPRETER, SM80):
        assert registry.choose("backward", target, _call(FORCED), q, k, v).name == "triton_bwd"
    assert "past 4096" in why_not_gluon_bwd(SM90, _call(), q, k, v)
    assert "GLUON_BACKWARD=False" in why_not_gluon_bwd(SM90, _call({"GLUON_BACKWARD": False}),
                                                       q, k, v)


def test_gluon_backward_refuses_more_kv_blocks_than_a_grid_axis_holds(monkeypatch):
    """The kv blocks are the grid's y axis (at most 65535 on CUDA: S past 8 M keys); past it
    the Triton backward runs, with the reason (the limit lowered here to S = 256's 2 blocks
    minus one, so as not to allocate 8 M keys)."""
    q, k, v = _qkv()
    assert why_not_gluon_bwd(SM90, _call(FORCED), q, k, v) is None
    monkeypatch.setattr(gluon_bwd_module, "MAX_GRID_Y", 1)
    found = why_not_gluon_bwd(SM90, _call(FORCED), q, k, v)
    assert "S=256" in found and "2 kv blocks" in found and "exceed a grid's 1" in found
    assert registry.choose("backward", SM90, _call(FORCED), q, k, v).name == "triton_bwd"


def _window(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).abs() < 256


def _causal_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 1024)


@pytest.mark.parametrize("L, E, mask_mod, options, chosen", [
    (8192, 128, None, None, "gluon_bwd"),          # dense: 0.86x the Triton backward's time
    (8192, 128, mods.causal, None, "gluon_bwd"),   # masked: causal 0.86x, prefix 0.88x
    (8192, 64, mods.causal, None, "gluon_bwd"),    # E = 64: 0.88-0.89x
    # sparse: by the mean query rows a program walks (SPARSE_WALK_ROWS = 1024): a causal
    # window of 1024 walks 1088 (0.92x the time at S = 16384), one of 256 each way 576
    (8192, 128, _causal_window, None, "gluon_bwd"),
    (8192, 64, _causal_window, None, "triton_bwd"),  # sparse at E = 64: not measured
    (8192, 128, _window, None, "triton_bwd"),
    (4096, 128, None, None, "triton_bwd"),         # not past 4096: not measured
    # 96 and 80 pad to 128: 0.81-0.82x the Triton backward's time (gb_f6f3362)
    (8192, 96, None, None, "gluon_bwd"),
    (8192, 80, mods.causal, None, "gluon_bwd"),
    (8192, 112, None, None, "gluon_bwd"),          # between them: the same E = 128 kernel
    # 256: 0.73-0.90x the time dense (wdb_45b05fb); under a block mask the Triton backward's
    # split one-loop tiles took 0.81-0.90x the Gluon backward's time (sp_0d1195a); 192 (v's
    # 192) not measured
    (8192, 256, None, None, "triton_bwd"),  # the full walk (BWD_FULL_WALK, wn_b990bbf) ...
    (8192, 256, None, {"BWD_FULL_WALK": False}, "gluon_bwd"),  # ... without it
    (8192, 256, mods.causal, None, "triton_bwd"),
    (8192, 256, mods.causal, FORCED, "gluon_bwd"),
    (8192, 192, mods.causal, None, "triton_bwd"),
    (8192, 256, _causal_window, None, "triton_bwd"),
    (4096, 256, mods.causal, None, "triton_bwd"),
    (8192, 48, None, None, "triton_bwd"),          # pads to 64: not measured ...
    (8192, 48, mods.causal, FORCED, "gluon_bwd"),  # ... runs when asked for
    (8192, 96, _causal_window, None, "triton_bwd"),  # sparse: measured at 128 only
    (8192, 128, None, {"GLUON_BACKWARD": False}, "triton_bwd"),
    (8192, 128, _window, FORCED, "gluon_bwd"),
    (8192, 128, None, {"deterministic": True}, "triton_bwd"),
])
def test_gluon_backward_by_default_where_it_measured_faster(L, E, mask_mod, options, chosen):
    # 64 heads: as much work as the measured calls (SPARSE_MIN_TILES)
    q, k, v = (torch.empty(1, 64, L, E, dtype=torch.bfloat16) for _ in range(3))
    mask = _mask(L, mask_mod=mask_mod) if mask_mod else None
    call = _call(options, block_mask=mask)
    assert registry.choose("backward", SM90, call, q, k, v).name == chosen
    assert registry.choose("backward", SM80, call, q, k, v).name == "triton_bwd"
    if E == 48 and options is None:
        assert "head dims 64, 80 to 128 and 256" in why_not_gluon_bwd(SM90, call, q, k, v)
    if mask_mod is _window and options is None:
        assert "walks 1024 query rows or more on average" in why_not_gluon_bwd(SM90, call, q, k,
                                                                               v)


@pytest.mark.parametrize("L, E, mask_mod, chosen", [
    (2048, 128, mods.causal, "gluon_bwd"),   # 0.95x the Triton backward's time with dropout
    (2048, 96, None, "gluon_bwd"),           # pads to 128 (dense 0.86x at 2048)
    (1024, 128, mods.causal, "triton_bwd"),  # 1.05x
    (4096, 64, mods.causal, "gluon_bwd"),    # 0.97x
    (2048, 64, mods.causal, "triton_bwd"),   # 1.07x
    (8192, 128, None, "gluon_bwd"),
])
def test_gluon_backward_with_dropout_by_default_from_the_measured_lengths(L, E, mask_mod,
                                                                          chosen):
    """With dropout, 'AUTO' takes the Gluon backward from DROPOUT_MIN_LENGTH on (2048 at
    E = 128, 4096 at 64), where it measured faster than the Triton backward (which draws
    the mask in both its kernels); the reason names the lengths."""
    q, k, v = (torch.empty(1, 64, L, E, dtype=torch.bfloat16) for _ in range(3))
    mask = _mask(L, mask_mod=mask_mod) if mask_mod else None
    call = _call(None, block_mask=mask, dropout_p=0.1)
    assert registry.choose("backward", SM90, call, q, k, v).name == chosen
    if chosen == "triton_bwd":
        reason = why_not_gluon_bwd(SM90, call, q, k, v)
        assert f"dropout at head dim {E} for L and S of at least" in reason, reason
    # the same call without dropout: past 4096 only
    plain = _call(None, block_mask=mask)
    assert registry.choose("backward", SM90, plain, q, k, v).name == (
        "gluon_bwd" if L > 4096 else "triton_bwd")


@pytest.mark.parametrize("L, E, mask_mod", [(8192, 128, None), (8192, 128, mods.causal),
                                          (8192, 256, mods.causal), (4096, 128, mods.causal),
                                          (8192, 192, mods.causal)])
def test_gluon_backward_takes_sinks_where_it_takes_the_call_without(L, E, mask_mod):
    """Attention sinks change nothing in the backward's kernels (the forward's lse holds
    them; their gradient comes from lse and delta after the kernels), so 'AUTO' chooses for
    a call with sinks as for the same call without; so does the forward (the Gluon forward
    folds them in its epilogue)."""
    q, k, v = (torch.empty(1, 64, L, E, dtype=torch.bfloat16) for _ in range(3))
    mask = _mask(L, mask_mod=mask_mod) if mask_mod else None
    with_sinks = _call(None, block_mask=mask, sinks=torch.zeros(64))
    assert with_sinks.features == {"sinks"}
    plain = registry.choose("backward", SM90, _call(None, block_mask=mask), q, k, v)
    assert registry.choose("backward", SM90, with_sinks, q, k, v) is plain
    # (at 256 under a block mask the Triton backward: sp_0d1195a)
    assert (plain is GLUON_BWD) == (L > 4096 and E == 128)
    assert registry.choose("forward", SM90, with_sinks, q, k, v) is registry.choose(
        "forward", SM90, _call(None, block_mask=mask), q, k, v)


@pytest.mark.parametrize("E, Ev, L, chosen", [
    # under a block mask at 256 the Triton backward's one loop: 0.86-0.98x the Gluon
    # backward's time (wb_38feb86, H100)
    (256, 256, 8192, "triton_bwd"), (256, 256, 2048, "triton_bwd"),
    (256, 256, 1024, "triton_bwd"), (256, 256, 512, "triton_bwd"),
    (192, 128, 8192, "gluon_bwd"),    # 0.90x
    (192, 128, 4096, "gluon_bwd"),    # 0.91x
    (192, 128, 2048, "gluon_bwd"),    # 0.96x
    (192, 128, 1024, "triton_bwd"),   # not measured
    (256, 128, 8192, "triton_bwd"),   # the same padded pair, not measured
    (160, 128, 8192, "triton_bwd"),   # not measured
])
def test_gluon_backward_with_dropout_at_wide_head_dims(E, Ev, L, chosen):
    """The wide kernel draws the keep mask too: GLUON_BACKWARD=True takes dropout at the
    head dims padding to 256; 'AUTO' from DROPOUT_MIN_LENGTH of the padded pair on (1024 at
    256, 2048 at 192 / 128, where it measured faster), below that the Triton backward, and
    at 192 / 128 without dropout the Triton backward always (faster there)."""
    q, k = (torch.empty(1, 64, L, E, dtype=torch.bfloat16) for _ in range(2))
    v = torch.empty(1, 64, L, Ev, dtype=torch.bfloat16)
    mask = _mask(L, mask_mod=mods.causal)
    forced = _call(FORCED, block_mask=mask, dropout_p=0.1)
    assert why_not_gluon_bwd(SM90, forced, q, k, v) is None
    assert registry.choose("backward", SM90, forced, q, k, v) is GLUON_BWD
    auto = _call(None, block_mask=mask, dropout_p=0.1)
    assert registry.choose("backward", SM90, auto, q, k, v).name == chosen
    if chosen == "triton_bwd":
        reason = why_not_gluon_bwd(SM90, auto, q, k, v)
        assert (f"dropout at head dim {E} for L and S of at least" in reason
                or "E = 192 with Ev = 128 with dropout" in reason
                or "256 with dropout under a block mask" in reason), reason
    plain = why_not_gluon_bwd(SM90, _call(None, block_mask=mask), q, k, v)
    if E != Ev:
        assert "E = 192 with Ev = 128 with dropout or at lengths" in plain, plain



@pytest.mark.parametrize("L, chosen", [
    (8192, "gluon_bwd"), (2048, "gluon_bwd"),    # dense 0.81x (we_001b317)
    (1024, "gluon_bwd"),                         # 0.94x (dr_32693bf)
    (1000, "gluon_bwd"),                         # ragged 0.78x (wb_38feb86)
    (512, "triton_bwd"),                         # not measured dense
])
def test_unmasked_dropout_at_256(L, chosen):
    """Without a block mask the wide kernel keeps dropout at 256 from 1024, and from 1000 at
    lengths that are not multiples of 128 (where the Triton backward runs its bounds-checked
    programs), as it does without dropout."""
    q, k, v = (torch.empty(1, 16, L, 256, dtype=torch.bfloat16) for _ in range(3))
    auto = _call(None, dropout_p=0.1)
    assert registry.choose("backward", SM90, auto, q, k, v).name == chosen

@pytest.mark.parametrize("L, mask_mod, chosen", [
    (8100, mods.causal, "gluon_bwd"), (8100, None, "gluon_bwd"),     # 0.98x, 0.95x
    (8192, mods.causal, "triton_bwd"), (8192, None, "triton_bwd"),   # 1.09x, 1.04x
    (4000, mods.causal, "triton_bwd"),                               # not measured
])
def test_mla_shape_takes_the_wide_backward_at_ragged_lengths(L, mask_mod, chosen):
    """E = 192 / Ev = 128 without dropout: 'AUTO' takes the wide kernel where L or S is not
    a multiple of 128 (past 4096), where it measured faster than the Triton backward's
    bounds-checked programs, and keeps the Triton backward at tile multiples."""
    q, k = (torch.empty(1, 16, L, 192, dtype=torch.bfloat16) for _ in range(2))
    v = torch.empty(1, 16, L, 128, dtype=torch.bfloat16)
    mask = _mask(L, mask_mod=mask_mod) if mask_mod else None
    call = _call(None, block_mask=mask)
    assert registry.choose("backward", SM90, call, q, k, v).name == chosen


NO_WALK = {"BWD_FULL_WALK": False}


@pytest.mark.parametrize("L, mask_mod, options, chosen", [
    # by default the full-block walk (BWD_FULL_WALK 'AUTO'): 0.88-0.93x the wide kernel's time
    # at 1000-8192 (wn_b990bbf)
    (2048, None, None, "triton_bwd"), (8192, None, None, "triton_bwd"),
    (1000, None, None, "triton_bwd"), (512, None, None, "triton_bwd"),
    # with the walk off the unmasked walk's tiles: the wide kernel from 2048, from 1000 at
    # ragged lengths (0.96x, 0.94x at 2048 and 4096, we_001b317; 0.92x at 1000, dr_32693bf)
    (2048, None, NO_WALK, "gluon_bwd"), (4096, None, NO_WALK, "gluon_bwd"),
    (1024, None, NO_WALK, "triton_bwd"), (512, None, NO_WALK, "triton_bwd"),
    (1000, None, NO_WALK, "gluon_bwd"), (999, None, NO_WALK, "triton_bwd"),
    # under a block mask the Triton backward's one-loop tiles (0.81-0.90x, sp_0d1195a)
    (1000, mods.causal, None, "triton_bwd"), (2048, mods.causal, None, "triton_bwd"),
    (8192, mods.causal, None, "triton_bwd"), (8100, mods.causal, NO_WALK, "triton_bwd"),
    (16384, mods.prefix_lm(4096), None, "triton_bwd")])
def test_wide_backward_without_dropout_where_measured(L, mask_mod, options, chosen):
    """At E = 256 without dropout 'AUTO' takes the Triton backward under a block mask and,
    through the full-block walk (BWD_FULL_WALK 'AUTO', the default), without one; with that
    walk off, the wide kernel without a block mask from L = S = WIDE_DENSE_MIN_LENGTH (2048),
    or WIDE_DENSE_RAGGED_MIN_LENGTH (1000) at lengths that are not multiples of 128, where it
    measured faster than the unmasked walk's tiles."""
    q, k, v = (torch.empty(1, 16, L, 256, dtype=torch.bfloat16) for _ in range(3))
    mask = _mask(L, mask_mod=mask_mod) if mask_mod else None
    call = _call(options, block_mask=mask)
    assert registry.choose("backward", SM90, call, q, k, v).name == chosen
    if chosen == "triton_bwd":
        reason = why_not_gluon_bwd(SM90, call, q, k, v)
        assert ("256 without dropout to the Triton backward" if mask_mod or not options
                else "past 4096") in reason, reason
    forced = _call({**(options or {}), **FORCED}, block_mask=mask)  # True still runs it
    assert why_not_gluon_bwd(SM90, forced, q, k, v) is None


@pytest.mark.parametrize("E, Ev, trimmed", [(96, 96, True), (80, 80, True), (128, 128, False),
                                           (64, 64, False), (192, 128, False), (256, 256, False)])
def test_gluon_bwd_qk_trim_is_set_only_where_it_trims(E, Ev, trimmed):
    """GLUON_BWD_QK_TRIM reaches the E <= 128 kernel's spec where E's 32-column slices are
    fewer than E_PAD's (80, 96), never the wide kernel's (its module flag is on always), and
    is in the kernel's key, name and module flags; 'AUTO' (the default) trims wherever it
    can (measured faster at 80 and 96: wj_2c4a86f)."""
    q, k = (torch.empty(1, 2, 256, E, dtype=torch.bfloat16) for _ in range(2))
    plain = gluon_bwd_spec(q, k, _call({**FORCED, "GLUON_BWD_QK_TRIM": False}), SM90,
                           head_dim_v=Ev)
    chosen = gluon_bwd_spec(q, k, _call({**FORCED, "GLUON_BWD_QK_TRIM": True}), SM90,
                            head_dim_v=Ev)
    assert (plain.qk_trim, chosen.qk_trim) == (False, trimmed)
    assert gluon_bwd_spec(q, k, _call(FORCED), SM90, head_dim_v=Ev) == chosen
    assert gluon_bwd_spec(q, k, _call({**FORCED, "GLUON_BWD_QK_TRIM": "auto"}), SM90,
                          head_dim_v=Ev) == chosen
    # the wide kernel's Q K^T runs over E's 32-column slices always (its module flag on)
    assert plain.constexprs(True)["QK_TRIM"] is (E > 128)
    if trimmed:
        call = _call(FORCED)
        joint = joint_graph(call.score)
        names = {gluon_bwd_kernel(spec, joint, call.score, call.mask).name
                 for spec in (plain, chosen)}
        assert len(names) == 2
    else:
        assert plain == chosen


def test_sparse_walk_comes_from_what_create_block_mask_recorded(monkeypatch):
    """The walk comes from the visited share create_block_mask recorded: the choice reads
    no table back (a device sync in the middle of a step)."""
    from flexfa.blockmask import density
    q, k, v = (torch.empty(1, 64, 8192, 128, dtype=torch.bfloat16) for _ in range(3))
    mask = _mask(8192, mask_mod=_causal_window)
    share = density.visited_share(mask)
    assert share is not None and 1024 <= share * 8192 < 1152
    monkeypatch.setattr(torch.Tensor, "sum", lambda *a, **kw: pytest.fail("tables read"))
    assert registry.choose("backward", SM90, _call(None, block_mask=mask), q, k, v) is GLUON_BWD
    # the same walk over fewer heads: less work than was measured, the host's launches of
    # the parts would dominate
    few = [t[:, :8] for t in (q, k, v)]
    call = _call(None, block_mask=mask)
    assert "16384 visited 128 x 128 tiles" in why_not_gluon_bwd(SM90, call, *few)
    assert registry.choose("backward", SM90, call, *few).name == "triton_bwd"


def _learnable_bias():
    bias = torch.zeros(2, requires_grad=True)

    def head_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h]
    return head_bias


@pytest.mark.parametrize("make, reason", [
    (lambda: (_call(None, score_mod=_learnable_bias()), _qkv(L=8192)),
     "leaves captured-tensor gradients"),
    (lambda: (_call({**FORCED, "deterministic": True}), _qkv()), "deterministic=True"),
    (lambda: (_call({**FORCED, "DS_WORKSPACE": True}), _qkv()), "dS workspace"),
    (lambda: (_call({**FORCED, "bwd_BLOCK_M1": 32}), _qkv()), "pin backward tiles"),
    (lambda: (_call(FORCED), _qkv(E=512)),
     "E/Ev that pad to one of 64/64, 128/128, 256/128, 256/256, not E=512"),
    (lambda: (_call(FORCED, block_mask=_mask(256, 32)), _qkv(E=256)),
     "multiples of (64, 64)"),
    (lambda: (_call(FORCED), _qkv(E=96, Ev=128)), "not E=96, Ev=128"),
    (lambda: (_call(FORCED), _qkv(E=128, Ev=64)), "not E=128, Ev=64"),
    (lambda: (_call(FORCED), _qkv(dtype=torch.float32)), "fp16/bf16"),
    (lambda: (_call(FORCED, block_mask=_mask(256, 64)), _qkv()), "multiples of (64, 128)"),
])
def test_gluon_backward_refusals_say_what_it_does_not_do(make, reason):
    call, (q, k, v) = make()
    found = why_not_gluon_bwd(SM90, call, q, k, v)
    assert found is not None and reason in found, found
    assert registry.choose("backward", SM90, call, q, k, v).name == "triton_bwd"


def _key_bias():
    bias = torch.zeros(256, requires_grad=True)

    def key_bias(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]
    return key_bias


def _row_bias():
    bias = torch.zeros(2, 256, requires_grad=True)

    def row_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx]
    return row_bias


@pytest.mark.parametrize("E", [128, 96])
def test_gluon_backward_refuses_the_captured_tensor_gradients_it_got_wrong(E):
    """On the H200 (gpu_2026-12-05) the E <= 128 kernel with captured-tensor gradients passed
    sm_90's shared memory: under GLUON_BACKWARD=True those calls take the Triton backward."""
    q, k, v = _qkv(E=E)
    call = _call(FORCED, score_mod=_learnable_bias())
    found = why_not_gluon_bwd(SM90, call, q, k, v)
    assert found is not None and "below E = 256" in found, found
    assert registry.choose("backward", SM90, call, q, k, v).name == "triton_bwd"


@pytest.mark.parametrize("E", [192, 256])
def test_gluon_backward_takes_captured_tensor_gradients_when_asked(E):
    """Learnable captured tensors at head dims padding to 256: GLUON_BACKWARD=True takes them
    (HAS_BUFFER_GRADS: the joint rendered again with the gradients' loads, an fp32
    accumulator parameter per tensor, the scatter-adds by Gluon's atomics); 'AUTO' leaves
    them to the Triton backward (refusals test above). A call without them keeps the kernel
    without any of it."""
    q, k, v = _qkv(E=E)
    call = _call(FORCED, score_mod=_learnable_bias())
    assert why_not_gluon_bwd(SM90, call, q, k, v) is None
    assert registry.choose("backward", SM90, call, q, k, v) is GLUON_BWD
    spec = gluon_bwd_spec(q, k, call, SM90)
    joint = joint_graph(call.score)
    assert joint.grad_slots == (0,)
    kernel = gluon_bwd_kernel(spec, joint, call.score, call.mask)
    parameters = kernel.source.split(f"def {kernel.name}(")[1].split("):")[0]
    assert "HAS_BUFFER_GRADS = tl.constexpr(True)" in kernel.source
    assert "gbuf0_ptr" in parameters and "gbuf0_stride0" in parameters
    assert "gl.atomic_add(gbuf0_ptr + " in kernel.source
    fixed = _call(FORCED, score_mod=mods.alibi(2))
    plain = gluon_bwd_kernel(spec, joint_graph(fixed.score), fixed.score, None)
    assert "HAS_BUFFER_GRADS = tl.constexpr(False)" in plain.source
    assert "gbuf0" not in plain.source


@pytest.mark.parametrize("E, score_mod, axis", [
    (256, _key_bias, 0), (192, _key_bias, 0), (256, _row_bias, 1)])
def test_gluon_backward_adds_sums_along_one_axis_once(E, score_mod, axis):
    """A tensor indexed along one axis of the score tile alone (col[kv_idx], row[h, q_idx])
    on the wide Gluon backward: its sum stays a vector of the reduced (sliced) layout, and
    the offsets are reduced to that layout too (a keep_dims tile repeats the vector in a
    thread's registers and Gluon's atomics added every copy: wrong on the H200 before; the
    sm_90 compile test counts repeated adds)."""
    q, k, v = _qkv(E=E)
    call = _call(FORCED, score_mod=score_mod())
    assert why_not_gluon_bwd(SM90, call, q, k, v) is None
    assert registry.choose("backward", SM90, call, q, k, v) is GLUON_BWD
    kernel = gluon_bwd_kernel(gluon_bwd_spec(q, k, call, SM90), joint_graph(call.score),
                              call.score, call.mask)
    adds = [line.strip() for line in kernel.source.splitlines() if "gl.atomic_add(gbuf" in line]
    assert len(adds) == 1, adds
    assert "keep_dims" not in adds[0]
    assert f"gl.reduce(gl.where(p > 0.0, ds_out * dload0, 0.0), {axis}, flexfa_sum_combine)" \
        in adds[0]
    assert f"{axis}, flexfa_max_combine)" in adds[0]


def test_gluon_backward_takes_dropout_and_draws_the_mask_again():
    """Dropout runs on the Gluon backward (the family has the feature, as it has sinks),
    its spec and kernel carry DROPOUT and the seed's parameters, and GLUON_BWD_EARLY_DP (dP^T
    from -delta, which dropout's dS^T cannot use) gives way to it."""
    q, k, v = _qkv()
    call = _call({**FORCED, "GLUON_BWD_EARLY_DP": True}, dropout_p=0.25)
    assert call.features == {"dropout"}
    assert registry.choose("backward", SM90, call, q, k, v) is GLUON_BWD
    spec = gluon_bwd_spec(q, k, call, SM90)
    assert spec.dropout and not spec.early_dp
    assert not gluon_bwd_spec(q, k, _call({**FORCED, "GLUON_BWD_EARLY_DP": True}), SM90).dropout
    flags = spec.constexprs(True)
    assert flags["DROPOUT"] is True and flags["EARLY_DP"] is False

    def parameters(kernel):
        return kernel.source.split(f"def {kernel.name}(")[1].split("):")[0]
    kernel = gluon_bwd_kernel(spec, None, None, None)
    assert "DROPOUT = tl.constexpr(True)" in kernel.source
    for name in ("DROPOUT_SEED", "dropout_threshold", "dropout_scale"):
        assert name in parameters(kernel), name
    plain = gluon_bwd_kernel(gluon_bwd_spec(q, k, _call(FORCED), SM90), None, None, None)
    assert "DROPOUT_SEED" not in parameters(plain) and "sm_scale" in parameters(plain)
    with pytest.raises(AssertionError, match="EARLY_DP"):
        dataclasses.replace(spec, early_dp=True)


@pytest.mark.parametrize("L, block_mask, sparse_q, even_l, even_s, l_pad", [
    (200, None, 64, False, False, 256),
    (256, None, 64, True, True, 256),
    (200, "causal", 128, False, False, 256),
    (384, "causal", 128, True, True, 384),
])
def test_gluon_backward_spec(L, block_mask, sparse_q, even_l, even_s, l_pad):
    q, k, _ = _qkv(L)
    mask = _mask(L) if block_mask else None
    spec = gluon_bwd_spec(q, k, _call(FORCED, block_mask=mask), SM90)
    assert (spec.sparse_q, spec.even_l, spec.even_s) == (sparse_q, even_l, even_s)
    assert spec.has_block_mask == (mask is not None) and spec.stages == 3
    assert padded_rows(L, spec) == l_pad
    assert spec.launch_options() == {"num_warps": 4, "num_stages": 1, "maxnreg": 168}


@pytest.mark.parametrize("E, stages, chosen", [(128, None, 3), (64, None, 3), (128, 3, 3),
                                               (64, 4, 4), (128, 2, 2), (96, None, 3),
                                               (48, 4, 4), (256, None, 2), (192, 2, 2)])
def test_gluon_backward_ring_depth_from_kernel_options(E, stages, chosen):
    q, k, _ = _qkv(256, E)
    options = {**FORCED, **({"GLUON_BWD_STAGES": stages} if stages else {})}
    spec = gluon_bwd_spec(q, k, _call(options), SM90)
    assert spec.stages == chosen and shared_bytes(E, chosen) <= SHARED_BYTES
    # a padded head dim takes its power of two's buffers (TMA fills the columns past E)
    padded = 1 << (E - 1).bit_length()
    assert shared_bytes(E, chosen) == shared_bytes(padded, chosen)
    assert spec.constexprs(False)["E_PAD"] == padded and spec.constexprs(False)["E"] == E


def test_gluon_backward_ring_that_does_not_fit_fails_by_name():
    q, k, _ = _qkv(256, 128)
    with pytest.raises(ValueError, match=r"GLUON_BWD_STAGES=4.*head dim 128 needs 265216 bytes"
                                         r".*stages that fit: \[2, 3\]"):
        gluon_bwd_spec(q, k, _call({**FORCED, "GLUON_BWD_STAGES": 4}), SM90)
    for bad in (1, 5, "2"):
        with pytest.raises((flexfa.InputError, TypeError), match="GLUON_BWD_STAGES"):
            parse_kernel_options({"GLUON_BWD_STAGES": bad})


def test_gluon_backward_renders_mods_in_the_transposed_score_layout():
    q, k, _ = _qkv(256)
    mask = _mask(256, mask_mod=lambda b, h, q_idx, kv_idx: h >= 0)  # not a tile by itself
    call = _call(FORCED, block_mask=mask, score_mod=mods.softcap(30.0))
    spec = gluon_bwd_spec(q, k, call, SM90)
    source = gluon_bwd_kernel(spec, joint_graph(call.score), call.score, call.mask).source
    assert "gl.full([KEYS, BLOCK_M], 1, tl.int1, S_LAYOUT)" in source
    assert "create_async_tma_reduce" in source and "flexfa_tma_reduce_add(DQ_DESC" in source
    assert "dscore = " in source and "DSCORE_IS_ONE = tl.constexpr(False)" in source
    assert "flexfa_tanh_approx" in source  # the GPU's fast tanh, as the forward


def _inputs(L, E, dtype, has_dlse, seed):
    g = torch.Generator().manual_seed(seed)
    B, H = 1, 2
    q = torch.zeros(B, H, L, E, dtype=dtype)
    out, grad_out = (torch.randn(B, H, L, E, generator=g).to(dtype) for _ in range(2))
    lse = torch.randn(B, H, L, generator=g)
    lse[0, 1, L // 2] = float("-inf")  # an empty row
    grad_lse = torch.randn(B, H, L, generator=g) if has_dlse else None
    return Inputs(q, q, q, out, lse, grad_out, grad_lse, torch.empty_like(q), q, q, {})


@settings(max_examples=6, deadline=None)
@given(L=st.sampled_from([16, 100, 232]), has_dlse=st.booleans(),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]), seed=st.integers(0, 99))
def test_row_kernels_under_the_interpreter(L, has_dlse, dtype, seed):
    x = _inputs(L, 64, dtype, has_dlse, seed)
    l_pad = math.ceil(L / 64) * 64
    pre, post = row_steps(RowsSpec(64, has_dlse, INTERPRETER.name), x, l_pad)
    lse2, delta = run_pre(pre, x, l_pad)
    # both rows in dQ's own memory (it is written only after the kernel has read them)
    for rows in (lse2, delta):
        assert rows.untyped_storage().data_ptr() == x.dq.untyped_storage().data_ptr()
    want = (x.out.double() * x.grad_out.double()).sum(-1)
    if has_dlse:
        want = want - x.grad_lse.double()
    lse = x.lse.double() * math.log2(math.e)
    lse = torch.where(x.lse == float("-inf"), float("inf"), lse)
    torch.testing.assert_close(delta[:, :L].double(), want.view(2, L), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse2[:, :L].double(), lse.view(2, L))
    assert (lse2[:, L:] == float("inf")).all() and (delta[:, L:] == 0).all()
    acc = torch.randn(2 * l_pad, 64)
    run_post(post, acc, x, 0.125)
    torch.testing.assert_close(x.dq, (acc.view(1, 2, l_pad, 64)[:, :, :L] * 0.125).to(dtype))


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 6), Hkv=st.integers(1, 9), chunks=st.integers(1, 12),
       overlap=st.booleans())
def test_dq_parts_cover_every_pair_once_in_a_bounded_accumulator(B, Hkv, chunks, overlap):
    slots = dq_slots(B, Hkv, chunks, overlap)
    (acc_b, acc_h), parts = dq_parts(B, Hkv, chunks, slots)
    covered = [(b, h) for b0, h0, nb, nh in parts for b in range(b0, b0 + nb)
               for h in range(h0, h0 + nh)]
    assert sorted(covered) == [(b, h) for b in range(B) for h in range(Hkv)]
    assert all(nb <= acc_b and nh <= acc_h for _, _, nb, nh in parts)
    # the accumulator's slots together hold about 1 / chunks of the pairs: at most
    # ceil(B * Hkv / chunks)
    room = -(-B * Hkv // min(chunks, B * Hkv))
    assert slots * acc_b * acc_h <= room
    # two slots exactly where asked for, with room for two pairs and more than one part
    assert slots == (2 if overlap and 2 <= room < B * Hkv else 1)
    assert slots == 1 or len(parts) >= 2


def test_parts_take_turns_in_two_slots_on_two_streams(monkeypatch):
    """With GLUON_BWD_OVERLAP (default) and room for two pairs (B = 1, Hkv = 4,
    GLUON_BWD_DQ_CHUNKS=2), part i runs in slot i % 2: its kernel writes, and its
    postprocess reads, that slot's accumulator, zeroed before the kernel; off, one slot."""
    from flexfa.runtime.launch import Step
    L, E = 256, 64
    q, k, v = _qkv(L=L, E=E)
    q, k, v = (t.repeat(1, 2, 1, 1) for t in (q, k, v))  # four heads
    for overlap, want_slots in ((True, 2), (False, 1)):
        launched = []
        monkeypatch.setattr(Step, "launch", lambda self, args, device, grid=None, stream=None: (
            launched.append((self, dict(zip(self.binder.names, args)), grid or self.grid)),
            setattr(self, "launched", True)))
        options = {"GLUON_BWD_DQ_CHUNKS": 2, "GLUON_BWD_OVERLAP": overlap}
        call = _call({**FORCED, **options}, _mask(L), None)
        x = _inputs(L, E, torch.bfloat16, True, 0)
        x.q, x.k, x.v = q, k, v
        x.dq, x.dk, x.dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        x.out, x.grad_out = torch.randn_like(q), torch.randn_like(q)
        x.lse = torch.zeros(q.shape[:3])
        plan = GLUON_BWD.make_plan(call, x, SM90)
        assert plan.fixed["slots"] == want_slots
        GLUON_BWD.run(plan, call, x, False, True)
        pre, kernel, post, zero = plan.steps
        kernels = [a for step, a, _ in launched if step is kernel]
        posts = [a for step, a, _ in launched if step is post]
        zeros = [a for step, a, _ in launched if step is zero]
        assert [a["HKV0"] for a in kernels] == list(range(0, 4, 2 // want_slots))
        slot_of = [a["DQ_DESC"].base for a in kernels]
        assert [acc.data_ptr() for acc in slot_of] == [
            slot_of[i % want_slots].data_ptr() for i in range(len(slot_of))]
        assert len({acc.data_ptr() for acc in slot_of}) == want_slots
        # the bytes memory reports take from the plan are those the slots hold
        assert plan.fixed["accumulator_bytes"] == want_slots * slot_of[0].numel() * 4
        assert [a["DQ_ACC"].data_ptr() for a in posts] == [acc.data_ptr() for acc in slot_of]
        # each part's slot is zeroed, whole, right before its kernel
        assert [a["DQ_ACC"].data_ptr() for a in zeros] == [acc.data_ptr() for acc in slot_of]
        assert [step for step, _, _ in launched[1:]] == [zero, kernel, post] * len(kernels)
        assert {a["ROWS"] for a in zeros} == {slot_of[0].shape[0]}


def test_part_streams_off_cuda_are_the_current_stream():
    with part_streams(torch.device("cpu"), 2) as streams:
        assert streams == [None, None]
        with torch.cuda.stream(streams[1]):  # a no-op context off CUDA
            pass


def test_part_streams_on_cuda_fork_from_and_join_the_current_stream(monkeypatch):
    """Two slots on a GPU (streams faked: no GPU here): the side stream starts after what
    the device's current stream queued, and the current stream waits for it on the way out,
    an error inside the block too (a part launched on the side stream is never left
    running unjoined); one slot makes no stream."""
    events = []

    class FakeStream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            events.append(f"{self.name} waits {other.name}")
    made = []
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device: FakeStream(f"main:{device.index}"))
    monkeypatch.setattr(torch.cuda, "Stream",
                        lambda device: made.append(device) or FakeStream(f"side:{device.index}"))
    gpu = torch.device("cuda", 1)
    with part_streams(gpu, 2) as streams:
        assert [s.name for s in streams] == ["main:1", "side:1"]
        assert events == ["side:1 waits main:1"]
    assert events[1:] == ["main:1 waits side:1"] and made == [gpu]
    with pytest.raises(RuntimeError, match="a launch failed"):
        with part_streams(gpu, 2):
            raise RuntimeError("a launch failed")
    assert events[2:] == ["side:1 waits main:1", "main:1 waits side:1"]
    with part_streams(gpu, 1) as streams:
        assert streams == [None]
    assert len(made) == 2


def test_postprocess_writes_each_part_to_its_heads_under_the_interpreter():
    """Parts of (batches, heads) through a part-sized accumulator: every dQ row comes from
    the part holding its (batch, head), at the part's first batch and head."""
    B, Hq, L, E, l_pad = 3, 4, 40, 64, 64
    x = _inputs(L, E, torch.float16, False, 0)
    x.q = x.dq = torch.zeros(B, Hq, L, E, dtype=torch.float16)
    want = torch.randn(B, Hq, L, E)
    for acc_heads, parts in ((2, [(b, h, 1, 2) for b in range(B) for h in (0, 2)]),
                             (Hq, [(0, 0, 2, Hq), (2, 0, 1, Hq)])):
        x.dq.zero_()
        _, post = row_steps(RowsSpec(E, False, INTERPRETER.name), x, l_pad, acc_heads)
        for b0, h0, nb, nh in parts:
            acc = torch.full((nb, acc_heads, l_pad, E), float("nan"))
            acc[:, :nh, :L] = want[b0:b0 + nb, h0:h0 + nh] * 8
            run_post(post, acc.view(-1, E), x, 0.125, (b0, h0, nb, nh))
        torch.testing.assert_close(x.dq.float(), want, atol=2e-3, rtol=1e-3)


def _recorded_run(monkeypatch, L: int, E: int, dropout_p: float = 0.0):
    """(plan, call, inputs, k, v, launches) of the family's plan and a cached run of a
    causal call with a captured bias at length L (no dK/dV wanted), the launches recorded:
    the Gluon kernel runs on an H200 only."""
    from flexfa.runtime.launch import Step
    launched = []
    monkeypatch.setattr(Step, "launch", lambda self, args, device, grid=None, stream=None: (
        launched.append((self, args, grid or self.grid)), setattr(self, "launched", True)))
    q, k, v = _qkv(L=L, E=E)
    bias = torch.randn(2)
    call = _call(FORCED, _mask(L), lambda score, b, h, q_idx, kv_idx: score + bias[h],
                 dropout_p=dropout_p)
    x = _inputs(L, E, torch.bfloat16, True, 0)
    x.k, x.v, x.dk, x.dv = k, v, torch.empty_like(k), torch.empty_like(v)
    plan = GLUON_BWD.make_plan(call, x, SM90)
    x.dk = x.dv = None  # a cached call whose key and value need no gradient
    GLUON_BWD.run(plan, call, x, False, False)
    return plan, call, x, k, v, launched


@pytest.mark.parametrize("L", [256, 200])
def test_ragged_lengths_read_q_do_k_v_by_heads(monkeypatch, L):
    """At a length that is no multiple of the tiles the kernel's Q, dO, K and V descriptors
    are over the [B * H, n, E] heads with [1, rows, E] blocks (a tile past n reads TMA's zero
    fill, never the next head's rows, whose inf made dQ, dK, dV NaN); at multiples over
    the [B * H * n, E] rows."""
    E = 64
    plan, call, x, k, v, launched = _recorded_run(monkeypatch, L, E)
    main = dict(zip(plan.steps[1].binder.names, launched[2][1]))
    for name, rows in (("Q_DESC", 64), ("DO_DESC", 64), ("K_DESC", 64), ("V_DESC", 64)):
        desc = main[name]
        if L % 128:
            assert (desc.shape, desc.strides, desc.block_shape) == (
                [2, L, E], [L * E, E, 1], [1, rows, E]), (name, desc)
            assert desc.layout.rank == 3
        else:
            assert (desc.shape, desc.strides, desc.block_shape) == (
                [2 * L, E], [E, 1], [rows, E]), (name, desc)


@pytest.mark.parametrize("dropout_p", [0.0, 0.5])
def test_a_plan_binds_every_argument_first_and_cached_without_dkdv(monkeypatch, dropout_p):
    """The family's plan and cached run on the CPU with the launches recorded (the Gluon
    kernel runs on an H200 only): every kernel argument is bound, also in a cached call that
    wants no dK/dV (runtime.backward binds none there; the fused kernel still writes them)."""
    from flexfa.runtime import binding
    L, E = 256, 64
    plan, call, x, k, v, launched = _recorded_run(monkeypatch, L, E, dropout_p)
    pre, kernel, post, zero = plan.steps
    # B = 1, Hkv = 2: the accumulator holds one kv head's rows, zeroed, then the kernel and
    # the postprocess run per head (GLUON_BWD_DQ_CHUNKS's default: a quarter of the pairs,
    # at least one)
    assert [step for step, _, _ in launched] == [pre] + [zero, kernel, post] * 2
    # (64 rows a zeroing program; one kv head of 2 x 128 keys a part, heads on the fast
    # axis; 32 rows of L_PAD = 256 a postprocess program)
    assert [grid for _, _, grid in launched][1:] == [(4,), (1, 2, 1), (8, 1, 1)] * 2
    starts = [dict(zip(step.binder.names, args)) for step, args, _ in launched[1:]
              if step is not zero]
    assert [(a["B0"], a.get("HKV0", a.get("H0"))) for a in starts] == [(0, 0), (0, 0), (0, 1),
                                                                         (0, 1)]
    for step, args, _ in launched:
        unset = [name for (i, name) in step.binder.slots if args[i] is None]
        assert not unset, (step, unset)
        assert all(a is not binding._UNSET for a in args), step  # every fixed value found
    # one program per (kv head, 128 keys, batch): the kernel reads head and batch as ids
    assert plan.steps[1].grid == (k.shape[1], 2, k.shape[0]), plan.steps[1].grid
    main = dict(zip(plan.steps[1].binder.names, launched[2][1]))
    assert main["HQ_CHUNK"] == 1 and main["DQ_DESC"].shape == [256, E]  # one head's rows
    assert main["DK"].shape == k.shape and main["DV"].shape == v.shape
    if dropout_p:  # the forward's seed tensor, round(p * 2**16) and 1 / (1 - p)
        assert main["DROPOUT_SEED"] is call.dropout.seed
        assert (main["dropout_threshold"], main["dropout_scale"]) == (32768, 2.0)
    else:
        assert "DROPOUT_SEED" not in main
    # lse2 and delta rows in dQ's memory: head bh's rows in its dQ bytes (L * E / 2 float32)
    for name, offset in (("LSE_DESC", 0), ("DELTA_DESC", 256)):
        desc = main[name]
        assert desc.base.untyped_storage().data_ptr() == x.dq.untyped_storage().data_ptr()
        assert desc.base.data_ptr() == x.dq.data_ptr() + 4 * offset
        assert desc.shape == [2, 256] and desc.strides == [L * E // 2, 1]


@pytest.mark.parametrize("L, E, delta_wanted, in_dq", [
    (256, 64, False, True),     # 2 x 256 float32 rows in 256 x 64 bf16: they fit
    (100, 64, False, True),     # l_pad 128: 4 * 128 <= 6400
    (256, 64, True, False),     # the caller wants delta after the postprocess
    (3, 8, False, False),       # l_pad 64 past a head's 3 x 8 values of dQ
])
def test_row_buffers_live_in_dq_where_they_fit(L, E, delta_wanted, in_dq):
    """The lse2 and delta rows take dQ's bytes where two [l_pad] float32 rows fit in each
    head's L x E values and nobody reads delta after the postprocess; else a buffer of
    their own. Either way [B * Hq, l_pad] views with 16-byte aligned rows."""
    B, Hq = 2, 3
    l_pad = -(-L // 64) * 64
    q = torch.zeros(B, Hq, L, E, dtype=torch.bfloat16)
    x = Inputs(q, q, q, q, torch.zeros(B, Hq, L), q, None, torch.empty_like(q), q, q, {},
               torch.empty(B, Hq, L) if delta_wanted else None)
    lse2, delta, got = gluon_bwd_module.row_buffers(x, l_pad)
    assert got == in_dq
    shared = lse2.untyped_storage().data_ptr() == x.dq.untyped_storage().data_ptr()
    assert shared == in_dq
    for rows in (lse2, delta):
        assert rows.shape == (B * Hq, l_pad) and rows.dtype == torch.float32
        assert rows.stride(1) == 1 and rows.stride(0) * 4 % 16 == 0
        assert rows.data_ptr() % 16 == 0
    if in_dq:  # head bh's rows inside head bh's dQ values
        assert lse2.stride(0) == L * E // 2 and delta.data_ptr() == lse2.data_ptr() + 4 * l_pad


@pytest.mark.parametrize("B, Hq, Hkv, options", [
    (1, 8, 2, {}),                                                   # GQA: 1 slot, 2 parts
    (2, 4, 4, {"GLUON_BWD_DQ_CHUNKS": 3, "GLUON_BWD_OVERLAP": False}),  # parts of 3 and 1
    (2, 4, 4, {"GLUON_BWD_DQ_CHUNKS": 3}),                           # 2 slots, 8 parts
    (2, 2, 2, {}),                                                   # 1 slot, 4 parts
])
def test_parts_flow_gives_every_head_its_own_dq(monkeypatch, B, Hq, Hkv, options):
    """The run's parts, slots and postprocess flags end to end, with the Gluon kernel
    emulated by its reduce-adds (each part adds its heads' dQ into its slot's rows, as
    bwd_gluon.tmpl's dQ writer does) and the pre- and postprocess run under the interpreter:
    every head's dQ is its own, whatever ran in the slot before it, and every part's kernel
    finds its heads' lse2 and delta rows as the preprocess wrote them, though they live in
    dQ's memory, which other parts' postprocesses write meanwhile."""
    from flexfa.runtime.launch import Step
    L, E, group = 200, 64, Hq // Hkv
    q, k = (torch.zeros(B, h, L, E, dtype=torch.bfloat16) for h in (Hq, Hkv))
    want = torch.randn(B, Hq, L, E)
    call = _call({**FORCED, **options}, None, None, gqa_group=group)
    x = Inputs(q, k, k, torch.randn_like(q), torch.randn(B, Hq, L), torch.randn_like(q),
               None, torch.empty_like(q), torch.empty_like(k), torch.empty_like(k), {})
    plan = GLUON_BWD.make_plan(call, x, SM90)
    l_pad = plan.fixed["l_pad"]
    pre, kernel, post, _ = plan.steps
    # the same postprocess and zeroing under the interpreter, over the plan's accumulator
    # heads (the slots come from torch.empty: only the zeroing makes them start at 0)
    hq_chunk = dict(zip(post.binder.names, post.binder.template))["HQ_CHUNK"]
    rows = RowsSpec(E, False, INTERPRETER.name)
    pre_cpu, post_cpu = row_steps(rows, x, l_pad, hq_chunk)
    zero_cpu = zero_step(rows, plan.fixed["acc_heads"] * l_pad)
    plan.steps = (pre, kernel, post_cpu, zero_cpu)
    real_launch = Step.launch

    def launch(self, args, device, grid=None, stream=None):
        named = dict(zip(self.binder.names, args))
        if self is pre_cpu or self is post_cpu or self is zero_cpu:
            return real_launch(self, args, device, grid)
        acc = named["DQ_DESC"].base.view(-1, named["HQ_CHUNK"], l_pad, E)
        nh, _, nb = grid
        b0, h0 = named["B0"], named["HKV0"]
        lse2_then, delta_then = rows_seen[0]
        for j in range(nb):
            for i in range(nh * group):
                bh = (b0 + j) * Hq + h0 * group + i
                assert torch.equal(named["LSE_DESC"].base[bh], lse2_then[bh]), bh
                assert torch.equal(named["DELTA_DESC"].base[bh], delta_then[bh]), bh
                acc[j, i, :L] += want[b0 + j, h0 * group + i] / 0.125
    monkeypatch.setattr(Step, "launch", launch)
    rows_seen, in_dq = [], []
    real_run_pre = gluon_bwd_module.run_pre

    def run_pre_cpu(pre, x, l_pad):  # the real preprocess, under the interpreter
        lse2, delta = real_run_pre(pre_cpu, x, l_pad)
        in_dq.append(lse2.untyped_storage().data_ptr() == x.dq.untyped_storage().data_ptr())
        rows_seen.append((lse2.clone(), delta.clone()))
        return lse2, delta
    monkeypatch.setattr(gluon_bwd_module, "run_pre", run_pre_cpu)
    GLUON_BWD.run(plan, call, x, False, True)
    assert in_dq == [True]  # the run's rows were in dQ's memory
    # within one bf16 rounding of want (the interpreter's cast need not round as torch's)
    torch.testing.assert_close(x.dq.float(), want, atol=1e-6, rtol=2 ** -7)


def test_a_ring_that_does_not_fit_is_refused_at_the_forward(monkeypatch):
    """A call that needs a gradient with GLUON_BWD_STAGES that do not fit ran its forward and
    was refused at the backward; the backward family's refusal comes before any launch.
    Without a gradient, or where the Gluon backward does not run, the option changes
    nothing."""
    from flexfa.runtime import launch
    launched = []
    real = launch.Step.launch
    monkeypatch.setattr(launch.Step, "launch",
                        lambda self, *a, **kw: launched.append(self) or real(self, *a, **kw))
    q, k, v = (torch.randn(1, 2, 64, 128, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    options = {"GLUON_EMULATE": True, "GLUON_BACKWARD": True, "GLUON_BWD_STAGES": 4}
    with pytest.raises(flexfa.InputError, match=r"GLUON_BWD_STAGES=4: .* stages that fit"):
        flexfa.flex_attention(q, k, v, kernel_options=options)
    assert launched == []
    with torch.no_grad():
        flexfa.flex_attention(q, k, v, kernel_options=options)
    assert launched
    flexfa.flex_attention(q, k, v, kernel_options={"GLUON_BWD_STAGES": 4})  # (no Gluon here)
