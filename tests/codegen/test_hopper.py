"""The Hopper forward template under the interpreter, its selection, fast-math rendering,
and its sm_90 compile check (wgmma, TMA, tanh.approx)."""
from __future__ import annotations

import pytest
import torch

import flexfa
from flexfa.codegen.render import render
from flexfa.frontend.grad import derive
from flexfa.frontend.trace import SCORE_MOD, trace
from flexfa.memo import BoundedMemo, MaskedMemo
from flexfa.runtime import hopper

from kernels.forward_utils import check_forward, make_qkv


@pytest.fixture
def hopper_template(monkeypatch):
    monkeypatch.setenv("FLEXFA_FORWARD_TEMPLATE", "hopper")
    launched = []
    for name in ("run_hopper_forward", "run_planned"):  # a new signature, a cached one
        original = getattr(hopper, name)

        def spy(*args, original=original, **kwargs):
            result = original(*args, **kwargs)
            if result is not None:
                launched.append(True)
            return result
        monkeypatch.setattr(hopper, name, spy)
    return launched


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_40(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 40)


def softcap(score, b, h, q_idx, kv_idx):
    return 20.0 * torch.tanh(score / 20.0)


def gate(score, b, h, q_idx, kv_idx):
    return score * torch.sigmoid(score) + torch.exp(-0.01 * (q_idx - kv_idx).abs())


CASES = {
    # name: (B, Hq, Hkv, L, S, E, Ev, dtype, score_mod, mask_mod)
    "causal_ragged": (1, 2, 2, 100, 100, 64, 64, torch.bfloat16, None, causal),
    "softcap_gqa": (2, 4, 2, 232, 100, 32, 32, torch.float16, softcap, None),
    "sliding_wide_head": (1, 2, 1, 130, 232, 80, 48, torch.bfloat16, gate, sliding_40),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_hopper_matches_reference(name, hopper_template):
    B, Hq, Hkv, L, S, E, Ev, dtype, score_mod, mask_mod = CASES[name]
    q, k, v = make_qkv(B, Hq, Hkv, L, S, E, Ev, dtype=dtype, seed=len(name))
    block_mask = (flexfa.create_block_mask(mask_mod, B, None, L, S, device="cpu")
                  if mask_mod else None)
    check_forward(q, k, v, score_mod, mask_mod, block_mask, enable_gqa=Hq != Hkv)
    assert hopper_template, "the Hopper template did not run"


def test_ragged_last_mask_block_with_sub_tiles(hopper_template):
    # S = 192 with 128-wide mask blocks and 64-wide tiles: the last (full) block's second
    # sub-tile lies past S and must be masked, not read from the next head
    def everything(b, h, q_idx, kv_idx):
        return kv_idx >= 0
    q, k, v = make_qkv(2, 2, 2, 192, 192, 32, dtype=torch.float16)
    mask = flexfa.create_block_mask(everything, 2, None, 192, 192, device="cpu")
    check_forward(q, k, v, None, everything, mask)


def test_lazy_rescale_matches_reference(hopper_template, monkeypatch):
    from flexfa.codegen import hopper as codegen_hopper
    monkeypatch.setattr(codegen_hopper, "RESCALE_THRESHOLD", 8)
    monkeypatch.setattr(hopper, "_KERNELS", BoundedMemo(16))
    monkeypatch.setattr(hopper, "_PLANS", MaskedMemo(16, per_mask=4))
    q, k, v = make_qkv(1, 2, 2, 232, 232, 32, dtype=torch.float16, seed=5)
    q = q * 3  # spread the scores so that row maxima move between tiles
    block_mask = flexfa.create_block_mask(causal, 1, None, 232, 232, device="cpu")
    check_forward(q, k, v, softcap, causal, block_mask)


@pytest.mark.parametrize("template", ["ampere", "hopper"])
@pytest.mark.parametrize("scale", [0.0, -0.4])
def test_scale_at_or_below_zero_without_score_mod(template, scale, monkeypatch):
    # without a score_mod the kernels take the row max of the raw q.k and fold the scale into
    # exp2's FMA; that needs scale > 0, so a scale <= 0 must take the scores-first path (a
    # masked -inf times 0 would be NaN, and a negative scale would turn the max into a min)
    monkeypatch.setenv("FLEXFA_FORWARD_TEMPLATE", template)
    q, k, v = make_qkv(1, 2, 2, 100, 100, 32, dtype=torch.float16, seed=9)
    mask = flexfa.create_block_mask(causal, 1, None, 100, 100, device="cpu")
    check_forward(q, k, v, None, causal, mask, scale=scale)
    check_forward(q, k, v, None, None, None, scale=scale)


def test_hopper_equals_ampere_template(monkeypatch):
    q, k, v = make_qkv(1, 2, 2, 100, 232, 64, dtype=torch.bfloat16, seed=3)
    block_mask = flexfa.create_block_mask(causal, 1, None, 100, 232, device="cpu")
    results = {}
    for template in ("ampere", "hopper"):
        monkeypatch.setenv("FLEXFA_FORWARD_TEMPLATE", template)
        results[template] = flexfa.flex_attention(q, k, v, score_mod=softcap,
                                                  block_mask=block_mask, return_lse=True)
    for a, b in zip(results["ampere"], results["hopper"]):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=0)


def test_empty_rows_give_zero_and_minus_inf(hopper_template):
    def nothing_before_50(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx >= 50)
    q, k, v = make_qkv(1, 1, 1, 100, 100, 32, dtype=torch.float16)
    mask = flexfa.create_block_mask(nothing_before_50, 1, 1, 100, 100, device="cpu")
    out, lse = flexfa.flex_attention(q, k, v, block_mask=mask, return_lse=True)
    assert hopper_template
    assert torch.all(out[0, 0, :50] == 0) and torch.all(lse[0, 0, :50] == float("-inf"))
    assert torch.isfinite(out).all() and torch.isfinite(lse[0, 0, 50:]).all()


def test_plan_is_reused_and_new_mask_gets_a_new_plan(hopper_template):
    q, k, v = make_qkv(1, 2, 2, 64, 64, 32, dtype=torch.float16)
    hopper._PLANS.clear()
    mask = flexfa.create_block_mask(causal, 1, None, 64, 64, device="cpu")
    first = flexfa.flex_attention(q, k, v, block_mask=mask)
    assert len(hopper._PLANS) == 1
    again = flexfa.flex_attention(q, k, v, block_mask=mask)
    assert len(hopper._PLANS) == 1
    torch.testing.assert_close(first, again, atol=0, rtol=0)
    other = flexfa.create_block_mask(sliding_40, 1, None, 64, 64, device="cpu")
    flexfa.flex_attention(q, k, v, block_mask=other)
    assert len(hopper._PLANS) == 2


def test_cached_plan_is_skipped_when_the_template_or_alignment_changes(hopper_template,
                                                                       monkeypatch):
    """run_planned (the cached path) launches a plan only for the template setting it was
    made under and for 16-byte aligned base pointers; otherwise the call takes the template
    use_hopper picks, with the same result."""
    q, k, v = make_qkv(1, 2, 2, 64, 64, 32, dtype=torch.float16)
    hopper._PLANS.clear()
    first = flexfa.flex_attention(q, k, v, score_mod=softcap)
    assert flexfa.flex_attention(q, k, v, score_mod=softcap) is not None
    assert len(hopper_template) == 2  # the plan's first launch, then the cached path
    for setting in ("ampere", "auto"):  # on the CPU "auto" is the Ampere-class template
        monkeypatch.setenv("FLEXFA_FORWARD_TEMPLATE", setting)
        ampere = flexfa.flex_attention(q, k, v, score_mod=softcap)
        assert len(hopper_template) == 2
        torch.testing.assert_close(ampere, first, atol=2e-3, rtol=2e-3)
    monkeypatch.setenv("FLEXFA_FORWARD_TEMPLATE", "hopper")
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape)  # 2-byte offset
    shifted.copy_(q)
    assert shifted.stride() == q.stride() and shifted.data_ptr() % 16
    assert hopper.run_planned(shifted, k, v, _call(softcap), False) is None
    torch.testing.assert_close(flexfa.flex_attention(shifted, k, v, score_mod=softcap), first,
                               atol=2e-3, rtol=2e-3)
    assert len(hopper_template) == 2


def test_a_repeated_call_reuses_its_plan_and_sees_new_state(hopper_template):
    """A repeated call finds its plan under the block mask; a new scale or new
    kernel_options make new plans; a changed closure value is traced again (the trace's
    guard) and its new value is used; a cleared plan table makes a new plan."""
    from flexfa.runtime import cache

    cache.clear_memo()
    q, k, v = make_qkv(1, 2, 2, 64, 64, 32, dtype=torch.float16, seed=4)
    mask = flexfa.create_block_mask(causal, 1, None, 64, 64, device="cpu")
    cap = 20.0

    def capped(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    first = flexfa.flex_attention(q, k, v, capped, mask)
    (plan,) = hopper._PLANS.values()
    again = flexfa.flex_attention(q, k, v, capped, mask)
    torch.testing.assert_close(again, first, atol=0, rtol=0)
    assert hopper._PLANS.values() == [plan] and len(hopper_template) == 2
    hopper._PLANS.clear()
    flexfa.flex_attention(q, k, v, capped, mask)
    assert len(hopper._PLANS) == 1 and hopper._PLANS.values()[0] is not plan
    flexfa.flex_attention(q, k, v, capped, mask, scale=0.3)  # same plan: scale is an argument
    flexfa.flex_attention(q, k, v, capped, mask, kernel_options={"num_stages": 1})
    assert len(hopper._PLANS) == 2
    cap = 5.0  # a new closure value: a new trace, a new kernel, the new value used
    fresh = flexfa.flex_attention(q, k, v, capped, mask)
    assert len(hopper._PLANS) == 3
    check_forward(q, k, v, capped, causal, mask)
    assert (fresh - first).abs().max() > 1e-3


def _call(score_mod):
    from flexfa.runtime.forward import AttentionCall
    from flexfa.runtime.options import DEFAULT_OPTIONS
    from flexfa.runtime.pipeline import prepare_score_mod
    return AttentionCall(prepare_score_mod(score_mod), None, None, 32 ** -0.5, DEFAULT_OPTIONS, 1)


@pytest.mark.parametrize("make, expected", [
    (lambda: torch.randn(1, 2, 64, 32, dtype=torch.float16), True),
    (lambda: torch.randn(1, 64, 2, 32, dtype=torch.float16).transpose(1, 2), False),
    (lambda: torch.randn(1, 2, 64, 32), False),  # fp32 stays on the Ampere template
    (lambda: torch.randn(1, 2, 64, 36, dtype=torch.bfloat16)[..., :4], False),
    (lambda: torch.randn(1, 2, 64, 36, dtype=torch.bfloat16)[..., :32], False),  # 72-byte rows
    (lambda: torch.randn(1, 2, 64, 256, dtype=torch.bfloat16), False),  # wide heads: Ampere
    (lambda: torch.randn(1, 2, 64, 128, dtype=torch.bfloat16), True),
])
def test_use_hopper_needs_flat_aligned_rows(make, expected, monkeypatch):
    monkeypatch.setenv("FLEXFA_FORWARD_TEMPLATE", "hopper")
    t = make()
    assert hopper.use_hopper(t, t, t) is expected


def test_use_hopper_is_off_for_cpu_by_default_and_when_forced_off(monkeypatch):
    t = torch.randn(1, 2, 64, 32, dtype=torch.float16)
    monkeypatch.delenv("FLEXFA_FORWARD_TEMPLATE", raising=False)
    assert not hopper.use_hopper(t, t, t)
    monkeypatch.setenv("FLEXFA_FORWARD_TEMPLATE", "ampere")
    assert not hopper.use_hopper(t, t, t)


# ---- fast transcendentals --------------------------------------------------------------------

def test_fast_math_renders_hardware_helpers_only_when_asked():
    traced = trace(gate, SCORE_MOD)
    exact = render([traced.root], fast_math=False)
    fast = render([traced.root], fast_math=True)
    exact_text, fast_text = "\n".join((*exact.lines, *exact.values)), "\n".join((*fast.lines, *fast.values))
    assert "flexfa_fast_sigmoid(" in fast_text and "flexfa_fast_exp(" in fast_text
    assert "flexfa_fast" not in exact_text and "flexfa_sigmoid(" in exact_text


def test_tanh_derivative_reuses_the_forward_value():
    joint = derive(trace(softcap, SCORE_MOD))
    rendered = render([joint.forward, joint.dscore], fast_math=True)
    text = "\n".join((*rendered.lines, *rendered.values))
    assert text.count("flexfa_fast_tanh(") == 1, text


def test_generated_gpu_kernel_uses_fast_tanh_and_interpreted_one_is_exact():
    from flexfa.codegen.hopper import hopper_kernel
    from flexfa.codegen.spec import KernelSpec

    score = trace(softcap, SCORE_MOD)
    fields = dict(dtype="bf16", head_dim=64, head_dim_v=64, block_m=128, block_n=128,
                  num_warps=8, num_stages=2, has_block_mask=False, has_full_blocks=False,
                  sparse_q=128, sparse_kv=128, even_l=True, even_s=True, return_lse=False,
                  gqa_group=1, input_precision="ieee", template="fwd_hopper")
    gpu = hopper_kernel(KernelSpec(**fields, target="cuda:90"), score, None)
    cpu = hopper_kernel(KernelSpec(**fields, target="interpret"), score, None)
    assert "flexfa_fast_tanh(" in gpu.source and "flexfa_fast_tanh(" not in cpu.source
    assert gpu.key != cpu.key and gpu.name.startswith("flexfa_fwd_hopper_d64_bf16_")


# ---- compile-only checks for sm_90 -----------------------------------------------------------

def test_sm90_hopper_kernel_has_wgmma_tma_and_fast_tanh():
    from flexfa.codegen.compile_check import compile_job
    from flexfa.codegen.hopper import hopper_job

    result = compile_job("hopper_softcap_causal", 90,
                         hopper_job(128, "bf16", score_mod=softcap, mask_mod=causal))
    assert result.ok, result.error
    assert result.wgmma and not result.mma_sync
    assert "cp.async.bulk.tensor" in result.ptx  # TMA loads
    assert "tanh.approx.f32" in result.ptx
    if result.spill_bytes is not None:
        assert result.spill_bytes == 0


def test_sm90_register_cap_reaches_ptxas():
    from flexfa.codegen.compile_check import compile_job
    from flexfa.codegen.hopper import hopper_job

    capped = compile_job("capped", 90, hopper_job(128, "bf16", mask_mod=causal, block_n=64,
                                                  max_registers=128))
    assert capped.ok, capped.error
    assert ".maxnreg 128" in capped.ptx and capped.wgmma
    if capped.registers is not None:
        assert capped.registers <= 128


def test_pinned_register_cap_runs_under_the_interpreter(hopper_template):
    q, k, v = make_qkv(1, 2, 2, 100, 100, 32, dtype=torch.bfloat16, seed=2)
    mask = flexfa.create_block_mask(causal, 1, None, 100, 100, device="cpu")
    check_forward(q, k, v, softcap, causal, mask, kernel_options={"maxnreg": 128})
    (plan,) = [p for p in hopper._PLANS.values() if p.spec.max_registers]
    assert plan.spec.max_registers == 128 and hopper_template


def _out_of_shared_memory_above(monkeypatch, max_stages: int, max_block_n: int = 1024):
    """Make launches with more stages (or wider key tiles) than given fail as a GPU whose
    shared memory is too small does (Triton's OutOfResources at the first launch)."""
    from triton.runtime.errors import OutOfResources

    tried = []
    original = hopper._launch_plan

    def launch(plan, *args):
        tried.append((plan.spec.block_n, plan.spec.num_stages))
        if plan.spec.num_stages > max_stages or plan.spec.block_n > max_block_n:
            raise OutOfResources(245816, 232448, "shared memory")
        return original(plan, *args)
    monkeypatch.setattr(hopper, "_launch_plan", launch)
    monkeypatch.setattr(hopper, "choose_config", lambda *a: (64, 64, 4, 3, 0))
    return tried


def test_tiles_that_do_not_fit_fall_back_to_fewer_stages(hopper_template, monkeypatch):
    # on the H200 a bias-table score_mod at E = 64 needs 245,816 bytes with 3 stages
    tried = _out_of_shared_memory_above(monkeypatch, max_stages=2)
    hopper._PLANS.clear()
    q, k, v = make_qkv(1, 2, 2, 100, 100, 32, dtype=torch.bfloat16)
    bias = torch.randn(199)

    def relative_bias(score, b, h, q_idx, kv_idx):
        return score + bias[q_idx - kv_idx + 99]
    check_forward(q, k, v, relative_bias)
    assert tried[:2] == [(64, 3), (64, 2)]
    (plan,) = hopper._PLANS.values()
    assert plan.spec.num_stages == 2
    tried.clear()
    check_forward(q, k, v, relative_bias)  # the plan that fits is kept: no retry
    assert tried == [(64, 2)]


def test_key_tiles_halve_when_no_stage_count_fits(hopper_template, monkeypatch):
    tried = _out_of_shared_memory_above(monkeypatch, max_stages=1, max_block_n=32)
    hopper._PLANS.clear()
    q, k, v = make_qkv(1, 2, 2, 100, 100, 32, dtype=torch.float16)
    check_forward(q, k, v, softcap)
    assert tried[-1] == (32, 1) and (64, 1) in tried


def test_pinned_tiles_that_do_not_fit_are_a_clear_error(hopper_template, monkeypatch):
    _out_of_shared_memory_above(monkeypatch, max_stages=0)
    hopper._PLANS.clear()
    q, k, v = make_qkv(1, 2, 2, 64, 64, 32, dtype=torch.float16)
    with pytest.raises(flexfa.InputError, match="does not fit this GPU.*kernel_options"):
        flexfa.flex_attention(q, k, v, kernel_options={"num_stages": 3, "BLOCK_N": 64})
