"""The Hopper forward template under the interpreter, its selection, fast-math rendering,
and its sm_90 compile check (wgmma, TMA, tanh.approx)."""
from __future__ import annotations

import types

import pytest
import torch

import flexfa
from flexfa.codegen.render import render
from flexfa.codegen.template import load_template
from flexfa.frontend.grad import derive
from flexfa.frontend.trace import SCORE_MOD, trace
from flexfa.runtime import plans, registry
from flexfa.runtime.families import hopper
from flexfa.runtime.families.hopper import HOPPER
from flexfa.runtime.options import parse_kernel_options
from flexfa.runtime.target import INTERPRETER, Target

from kernels.forward_utils import check_forward, make_qkv

FORCED = {"BACKEND": "HOPPER"}  # under the interpreter the family runs only when forced


@pytest.fixture
def hopper_template(monkeypatch):
    """The Hopper family's launches: "first" for a new signature, "run" for a cached one."""
    launched = []
    for name in ("first_call", "run"):
        original = getattr(HOPPER, name)

        def spy(*args, original=original, name=name, **kwargs):
            launched.append("first" if name == "first_call" else "run")
            return original(*args, **kwargs)
        monkeypatch.setattr(HOPPER, name, spy)
    return launched


def hopper_plans():
    return [p for p in plans.PLANS.values() if p.family is HOPPER]


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
    check_forward(q, k, v, score_mod, mask_mod, block_mask, enable_gqa=Hq != Hkv,
                  kernel_options=FORCED)
    assert hopper_template, "the Hopper template did not run"


def test_ragged_last_mask_block_with_sub_tiles(hopper_template):
    # S = 192 with 128-wide mask blocks and 64-wide tiles: the last (full) block's second
    # sub-tile lies past S and must be masked, not read from the next head
    def everything(b, h, q_idx, kv_idx):
        return kv_idx >= 0
    q, k, v = make_qkv(2, 2, 2, 192, 192, 32, dtype=torch.float16)
    mask = flexfa.create_block_mask(everything, 2, None, 192, 192, device="cpu")
    check_forward(q, k, v, None, everything, mask, kernel_options=FORCED)


@pytest.mark.parametrize("template", ["ampere", "hopper"])
@pytest.mark.parametrize("scale", [0.0, -0.4])
def test_scale_at_or_below_zero_without_score_mod(template, scale):
    # without a score_mod the kernels take the row max of the raw q.k and fold the scale into
    # exp2's FMA; that needs scale > 0, so a scale <= 0 must take the scores-first path (a
    # masked -inf times 0 would be NaN, and a negative scale would turn the max into a min)
    options = {"BACKEND": template.upper()}
    q, k, v = make_qkv(1, 2, 2, 100, 100, 32, dtype=torch.float16, seed=9)
    mask = flexfa.create_block_mask(causal, 1, None, 100, 100, device="cpu")
    check_forward(q, k, v, None, causal, mask, scale=scale, kernel_options=options)
    check_forward(q, k, v, None, None, None, scale=scale, kernel_options=options)


def test_hopper_equals_ampere_template():
    q, k, v = make_qkv(1, 2, 2, 100, 232, 64, dtype=torch.bfloat16, seed=3)
    block_mask = flexfa.create_block_mask(causal, 1, None, 100, 232, device="cpu")
    results = {}
    for template in ("ampere", "hopper"):
        results[template] = flexfa.flex_attention(q, k, v, score_mod=softcap,
                                                  block_mask=block_mask, return_lse=True,
                                                  kernel_options={"BACKEND": template.upper()})
    for a, b in zip(results["ampere"], results["hopper"]):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=0)


def test_empty_rows_give_zero_and_minus_inf(hopper_template):
    def nothing_before_50(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx >= 50)
    q, k, v = make_qkv(1, 1, 1, 100, 100, 32, dtype=torch.float16)
    mask = flexfa.create_block_mask(nothing_before_50, 1, 1, 100, 100, device="cpu")
    out, lse = flexfa.flex_attention(q, k, v, block_mask=mask, return_lse=True,
                                     kernel_options=FORCED)
    assert hopper_template
    assert torch.all(out[0, 0, :50] == 0) and torch.all(lse[0, 0, :50] == float("-inf"))
    assert torch.isfinite(out).all() and torch.isfinite(lse[0, 0, 50:]).all()


def test_plan_is_reused_and_new_mask_gets_a_new_plan(hopper_template):
    q, k, v = make_qkv(1, 2, 2, 64, 64, 32, dtype=torch.float16)
    plans.PLANS.clear()
    mask = flexfa.create_block_mask(causal, 1, None, 64, 64, device="cpu")
    first = flexfa.flex_attention(q, k, v, block_mask=mask, kernel_options=FORCED)
    assert len(hopper_plans()) == 1
    again = flexfa.flex_attention(q, k, v, block_mask=mask, kernel_options=FORCED)
    assert len(hopper_plans()) == 1 and hopper_template == ["first", "run"]
    torch.testing.assert_close(first, again, atol=0, rtol=0)
    other = flexfa.create_block_mask(sliding_40, 1, None, 64, 64, device="cpu")
    flexfa.flex_attention(q, k, v, block_mask=other, kernel_options=FORCED)
    assert len(hopper_plans()) == 2 and hopper_template == ["first", "run", "first"]


def test_unaligned_inputs_or_another_backend_take_the_ampere_family(hopper_template):
    """A plan exists only for the layout (16-byte alignment included) and options it was made
    for: other options or an unaligned base pointer plan again, on the family that applies,
    with the same result."""
    q, k, v = make_qkv(1, 2, 2, 64, 64, 32, dtype=torch.float16)
    plans.PLANS.clear()
    first = flexfa.flex_attention(q, k, v, score_mod=softcap, kernel_options=FORCED)
    assert flexfa.flex_attention(q, k, v, score_mod=softcap, kernel_options=FORCED) is not None
    assert hopper_template == ["first", "run"]
    for options in ({"BACKEND": "AMPERE"}, None):  # on the CPU "AUTO" is the Ampere family
        ampere = flexfa.flex_attention(q, k, v, score_mod=softcap, kernel_options=options)
        assert hopper_template == ["first", "run"]
        torch.testing.assert_close(ampere, first, atol=2e-3, rtol=2e-3)
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape)  # 2-byte offset
    shifted.copy_(q)
    assert shifted.stride() == q.stride() and shifted.data_ptr() % 16
    with pytest.raises(flexfa.InputError, match="16-byte aligned rows"):
        flexfa.flex_attention(shifted, k, v, score_mod=softcap, kernel_options=FORCED)
    torch.testing.assert_close(flexfa.flex_attention(shifted, k, v, score_mod=softcap), first,
                               atol=2e-3, rtol=2e-3)
    assert hopper_template == ["first", "run"]


def test_a_repeated_call_reuses_its_plan_and_sees_new_state(hopper_template):
    """A repeated call finds its plan under the block mask; a new scale keeps it (an argument),
    new kernel_options make a new one; a changed closure value is traced again (the trace's
    guard) and its new value is used; a cleared plan table makes a new plan."""
    from flexfa.runtime import cache

    cache.clear_memo()
    q, k, v = make_qkv(1, 2, 2, 64, 64, 32, dtype=torch.float16, seed=4)
    mask = flexfa.create_block_mask(causal, 1, None, 64, 64, device="cpu")
    cap = 20.0

    def capped(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    first = flexfa.flex_attention(q, k, v, capped, mask, kernel_options=FORCED)
    (plan,) = hopper_plans()
    again = flexfa.flex_attention(q, k, v, capped, mask, kernel_options=FORCED)
    torch.testing.assert_close(again, first, atol=0, rtol=0)
    assert hopper_plans() == [plan] and hopper_template == ["first", "run"]
    plans.PLANS.clear()
    flexfa.flex_attention(q, k, v, capped, mask, kernel_options=FORCED)
    assert len(hopper_plans()) == 1 and hopper_plans()[0] is not plan
    flexfa.flex_attention(q, k, v, capped, mask, scale=0.3, kernel_options=FORCED)
    assert len(hopper_plans()) == 1
    flexfa.flex_attention(q, k, v, capped, mask, kernel_options={**FORCED, "num_stages": 1})
    assert len(hopper_plans()) == 2
    cap = 5.0  # a new closure value: a new trace, a new kernel, the new value used
    fresh = flexfa.flex_attention(q, k, v, capped, mask, kernel_options=FORCED)
    assert len(hopper_plans()) == 3
    check_forward(q, k, v, capped, causal, mask, kernel_options=FORCED)
    assert (fresh - first).abs().max() > 1e-3


def _call(options=None):
    from flexfa.runtime.call import AttentionCall
    return AttentionCall(None, None, None, 32 ** -0.5, parse_kernel_options(options), 1)


def _bf16(*shape):
    return torch.randn(*shape, dtype=torch.bfloat16)


@pytest.mark.parametrize("make, flat, strided", [
    (lambda: torch.randn(1, 2, 64, 32, dtype=torch.float16), True, True),
    # heads side by side ([B, L, H, E] / packed [total, H, E] views), batches in rows
    (lambda: torch.randn(2, 64, 2, 32, dtype=torch.float16).transpose(1, 2), False, True),
    (lambda: _bf16(100, 3, 4, 64)[:, 1].transpose(0, 1).unsqueeze(0), False, True),  # fused qkv
    (lambda: _bf16(1, 64, 2, 48).transpose(1, 2), False, False),  # side by side, E != E_PAD
    (lambda: _bf16(1, 64, 2, 8).transpose(1, 2), False, False),  # 8: E_PAD 16, E != E_PAD
    (lambda: _bf16(1, 2, 100, 48)[:, :, :64], False, False),  # a gap after each head's rows
    (lambda: _bf16(1, 2, 100, 48)[:, :1, :64], True, True),
    (lambda: _bf16(3, 2, 100, 48)[1:].transpose(0, 1), False, True),  # heads, then batches
    (lambda: torch.randn(1, 2, 64, 32), False, False),  # fp32 stays on the Ampere template
    (lambda: _bf16(1, 2, 64, 36)[..., :4], False, False),
    (lambda: _bf16(1, 2, 64, 36)[..., :32], False, False),  # 72-byte rows
    (lambda: _bf16(1, 2, 64, 256), True, True),  # wide heads too
    (lambda: _bf16(1, 2, 64, 272)[..., :264], False, False),  # past 256
    (lambda: _bf16(1, 2, 64, 128), True, True),
])
def test_hopper_needs_aligned_rows_flat_or_strided(make, flat, strided):
    t = make()
    assert hopper.descriptor_layout_ok(t, t, t) is flat
    assert hopper.strided_ok(t, t, t) is strided
    assert (HOPPER.why_not(Target("cuda", 9, 0), _call(), t, t, t) is None) is strided


def test_the_refusal_of_heads_side_by_side_states_the_head_dim_rule():
    """An audit's find: heads side by side at E = 8 (a power of two) were refused with a
    message asking for power-of-two head dims; the rule is E == E_PAD, 16 or more."""
    t = _bf16(1, 64, 2, 8).transpose(1, 2)
    assert "power-of-two head dims of 16 or more" in HOPPER.why_not(
        Target("cuda", 9, 0), _call(), t, t, t)


def test_matrices_past_int32_rows_take_the_pointer_kernels():
    """Tensor descriptors take int32 coordinates: a [B * H * n, d] view of 2**31 rows (q of
    32 GiB at d = 8) ran the Hopper family, whose heads' first rows (off_bh * L) wrapped to
    other rows. Such layouts now fail the check (meta tensors: nothing allocated), flat and
    strided alike, one row less passes."""
    def flat(batch):
        return torch.empty(batch, 1, 2 ** 20, 8, dtype=torch.bfloat16, device="meta")

    def side_by_side(batch):  # [B, n, H, d] seen as [B, H, n, d]: B * n rows of H * d
        return torch.empty(batch, 2 ** 20, 2, 16, dtype=torch.bfloat16,
                           device="meta").transpose(1, 2)
    sm90 = Target("cuda", 9, 0)
    for make in (flat, side_by_side):
        below, past = make(2047), make(2048)
        assert hopper.strided_ok(below, below, below)
        assert not hopper.strided_ok(past, past, past)
        assert HOPPER.why_not(sm90, _call(), below, below, below) is None
        assert "fewer than 2**31 rows" in HOPPER.why_not(sm90, _call(), past, past, past)
    assert hopper.descriptor_layout_ok(flat(2047), flat(2047), flat(2047))
    assert not hopper.descriptor_layout_ok(flat(2048), flat(2047), flat(2047))


def test_hopper_is_chosen_on_sm90_only_and_when_forced():
    t = torch.randn(1, 2, 64, 32, dtype=torch.float16)
    sm90, sm80, sm100 = Target("cuda", 9, 0), Target("cuda", 8, 0), Target("cuda", 10, 0)
    assert registry.choose("forward", sm90, _call(), t, t, t) is HOPPER
    for target in (sm80, sm100, INTERPRETER):
        assert registry.choose("forward", target, _call(), t, t, t).name == "ampere"
    assert registry.choose("forward", INTERPRETER, _call(FORCED), t, t, t) is HOPPER
    assert registry.choose("forward", INTERPRETER, _call({"USE_TMA": True}), t, t, t) is HOPPER
    assert registry.choose("forward", sm90, _call({"USE_TMA": False}), t, t, t).name == "ampere"
    assert registry.choose("forward", sm90, _call({"BACKEND": "AMPERE"}), t, t, t).name == \
        "ampere"
    with pytest.raises(flexfa.InputError, match="BACKEND='HOPPER'.*sm_90"):
        registry.choose("forward", sm80, _call(FORCED), t, t, t)
    # the Hopper family splits too (tests/kernels/test_hopper_split.py)
    assert registry.choose("forward", INTERPRETER, _call({**FORCED, "SPLIT_KV": 2}), t, t,
                           t) is HOPPER


# ---- strided q, k, v (STRIDED_QKV) ---------------------------------------------------------

def _packed(total, heads, dim, generator):
    """A [1, H, total, E] view of a packed [total, H, E] tensor (varlen_attention's)."""
    return torch.randn(total, heads, dim, generator=generator).to(torch.bfloat16) \
        .transpose(0, 1).unsqueeze(0)


def _strided_layouts(name, generator):
    if name == "packed_gqa":  # packed documents, 2 query heads per key head
        return (_packed(150, 4, 32, generator), _packed(150, 2, 32, generator),
                _packed(150, 2, 16, generator))
    if name == "bshd_batches":  # [B, L, H, E] inputs, batches in rows, heads side by side
        return [torch.randn(2, n, 2, 32, generator=generator).to(torch.float16).transpose(1, 2)
                for n in (100, 70, 70)]
    # a fused projection's q, k, v slices ([L, 3, H, E])
    fused = torch.randn(100, 3, 2, 64, generator=generator).to(torch.bfloat16)
    return [fused[:, i].transpose(0, 1).unsqueeze(0) for i in range(3)]


@pytest.mark.parametrize("name,mask_mod,score_mod", [("packed_gqa", causal, None),
                                                     ("bshd_batches", sliding_40, softcap),
                                                     ("fused_qkv", None, gate)])
def test_strided_inputs_equal_the_contiguous_call_bit_for_bit(name, mask_mod, score_mod,
                                                              hopper_template):
    """q, k, v that are no [B * H * len, dim] matrices run the Hopper template in place
    (STRIDED_QKV), with exactly the results of the same call on contiguous copies and within
    the reference's tolerance."""
    q, k, v = _strided_layouts(name, torch.Generator().manual_seed(5))
    assert not hopper.descriptor_layout_ok(q, k, v)
    B, L, S = q.shape[0], q.shape[2], k.shape[2]
    mask = flexfa.create_block_mask(mask_mod, B, None, L, S, device="cpu") if mask_mod else None
    gqa = q.shape[1] != k.shape[1]
    plans.PLANS.clear()
    out, lse = check_forward(q, k, v, score_mod, mask_mod, mask, enable_gqa=gqa,
                             kernel_options=FORCED)
    assert [p.spec.strided_qkv for p in hopper_plans()] == [True]
    copies = [t.contiguous() for t in (q, k, v)]
    flat_out, flat_lse = flexfa.flex_attention(*copies, score_mod=score_mod, block_mask=mask,
                                               enable_gqa=gqa, return_lse=True,
                                               kernel_options=FORCED)
    assert sorted(p.spec.strided_qkv for p in hopper_plans()) == [False, True]
    assert torch.equal(out, flat_out) and torch.equal(lse, flat_lse)


def test_strided_descriptors_cover_exactly_the_tensor():
    """The descriptor over a packed [total, H, E] tensor is its [total, H * E] matrix; over
    [B, L, H, E] inputs the [B * L, H * E] one; over a fused projection's slice its own
    columns of the [L, 3 * H * E] rows."""
    packed = torch.zeros(150, 4, 32, dtype=torch.bfloat16).transpose(0, 1).unsqueeze(0)
    assert hopper.strided_geometry(packed, 64, 32) == ([150, 128], [128, 1], [64, 32])
    bshd = torch.zeros(2, 100, 3, 64, dtype=torch.float16).transpose(1, 2)
    assert hopper.strided_geometry(bshd, 64, 64) == ([200, 192], [192, 1], [64, 64])
    fused = torch.zeros(100, 3, 2, 64, dtype=torch.bfloat16)[:, 1].transpose(0, 1).unsqueeze(0)
    assert hopper.strided_geometry(fused, 64, 64) == ([100, 128], [384, 1], [64, 64])


def test_sm90_strided_hopper_kernel_compiles_with_wgmma_and_tma():
    from flexfa.compile_check import compile_job
    from flexfa.compile_check.jobs import hopper_job

    result = compile_job("hopper_strided", 90, hopper_job(128, "bf16", mask_mod=causal,
                                                          strided_qkv=True))
    assert result.ok, result.error
    assert result.wgmma and "cp.async.bulk.tensor" in result.ptx
    assert result.spill_bytes in (None, 0), result.spill_bytes


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
    from flexfa.compile_check import compile_job
    from flexfa.compile_check.jobs import hopper_job

    result = compile_job("hopper_softcap_causal", 90,
                         hopper_job(128, "bf16", score_mod=softcap, mask_mod=causal))
    assert result.ok, result.error
    assert result.wgmma and not result.mma_sync
    assert "cp.async.bulk.tensor" in result.ptx  # TMA loads
    assert "tanh.approx.f32" in result.ptx
    if result.spill_bytes is not None:
        assert result.spill_bytes == 0


def test_sm90_register_cap_reaches_ptxas():
    from flexfa.compile_check import compile_job
    from flexfa.compile_check.jobs import hopper_job

    capped = compile_job("capped", 90, hopper_job(128, "bf16", mask_mod=causal, block_n=64,
                                                  max_registers=128))
    assert capped.ok, capped.error
    assert ".maxnreg 128" in capped.ptx and capped.wgmma
    if capped.registers is not None:
        assert capped.registers <= 128


def test_pinned_register_cap_runs_under_the_interpreter(hopper_template):
    q, k, v = make_qkv(1, 2, 2, 100, 100, 32, dtype=torch.bfloat16, seed=2)
    mask = flexfa.create_block_mask(causal, 1, None, 100, 100, device="cpu")
    check_forward(q, k, v, softcap, causal, mask, kernel_options={**FORCED, "maxnreg": 128})
    (plan,) = [p for p in hopper_plans() if p.spec.max_registers]
    assert plan.spec.max_registers == 128 and hopper_template


def _out_of_shared_memory_above(monkeypatch, max_stages: int, max_block_n: int = 1024):
    """Make launches with more stages (or wider key tiles) than given fail as a GPU whose
    shared memory is too small does (Triton's OutOfResources at the first launch)."""
    from triton.runtime.errors import OutOfResources

    tried = []
    original = HOPPER.launch

    def launch(plan, *args):
        tried.append((plan.spec.block_n, plan.spec.num_stages))
        if plan.spec.num_stages > max_stages or plan.spec.block_n > max_block_n:
            raise OutOfResources(245816, 232448, "shared memory")
        return original(plan, *args)
    monkeypatch.setattr(HOPPER, "launch", launch)
    monkeypatch.setattr(HOPPER, "choose_config", lambda *a: (64, 64, 4, 3, 0))
    return tried


def test_tiles_that_do_not_fit_fall_back_to_fewer_stages(hopper_template, monkeypatch):
    # on the H200 a bias-table score_mod at E = 64 needs 245,816 bytes with 3 stages
    tried = _out_of_shared_memory_above(monkeypatch, max_stages=2)
    plans.PLANS.clear()
    q, k, v = make_qkv(1, 2, 2, 100, 100, 32, dtype=torch.bfloat16)
    bias = torch.randn(199)

    def relative_bias(score, b, h, q_idx, kv_idx):
        return score + bias[q_idx - kv_idx + 99]
    check_forward(q, k, v, relative_bias, kernel_options=FORCED)
    assert tried[:2] == [(64, 3), (64, 2)]
    (plan,) = hopper_plans()
    assert plan.spec.num_stages == 2
    tried.clear()
    check_forward(q, k, v, relative_bias, kernel_options=FORCED)  # the plan that fits is kept
    assert tried == [(64, 2)]


def test_key_tiles_halve_when_no_stage_count_fits(hopper_template, monkeypatch):
    tried = _out_of_shared_memory_above(monkeypatch, max_stages=1, max_block_n=32)
    plans.PLANS.clear()
    q, k, v = make_qkv(1, 2, 2, 100, 100, 32, dtype=torch.float16)
    check_forward(q, k, v, softcap, kernel_options=FORCED)
    assert tried[-1] == (32, 1) and (64, 1) in tried


def test_pinned_tiles_that_do_not_fit_are_a_clear_error(hopper_template, monkeypatch):
    _out_of_shared_memory_above(monkeypatch, max_stages=0)
    plans.PLANS.clear()
    q, k, v = make_qkv(1, 2, 2, 64, 64, 32, dtype=torch.float16)
    with pytest.raises(flexfa.InputError, match="does not fit this GPU.*kernel_options"):
        flexfa.flex_attention(q, k, v, kernel_options={**FORCED, "num_stages": 3,
                                                       "BLOCK_N": 64})


@pytest.mark.parametrize("name", ["fwd_hopper_d128_bf16_causal_split",
                                  "fwd_hopper_d128_bf16_softcap_split",
                                  "fwd_hopper_combine_d128_bf16_sinks_max"])
def test_sm90_split_hopper_kernel_compiles_without_spills(name):
    """Split-KV (SPLIT_KV: a share of the live blocks, the workspace slice) at the default
    128 x 64 tiles without the register cap: wgmma, TMA, no spills; the combine kernel (128
    rows, with sinks and row maxima) without spills."""
    from flexfa import compile_check
    from flexfa.compile_check import compile_job

    result = compile_job(name, 90, compile_check.REGISTRY[name])
    assert result.ok, result.error
    if "combine" not in name:
        assert result.wgmma and "cp.async.bulk.tensor" in result.ptx
    assert result.spill_bytes in (None, 0), result.spill_bytes


@pytest.mark.parametrize("group", [1, 4])
def test_heads_in_groups_give_the_same_result(group, hopper_template):
    """kernel_options HEAD_GROUP reorders the programs under a block mask (B * H = 6 heads in
    groups of 1, or of 4 and 2); every (q tile, head) still runs once: against the reference
    and bit-equal to the default order."""
    q, k, v = make_qkv(2, 3, 3, 300, 300, 32, 32, dtype=torch.bfloat16, seed=group)
    mask = flexfa.create_block_mask(causal, None, None, 300, 300, device="cpu",
                                    BLOCK_SIZE=64)
    out = check_forward(q, k, v, None, causal, mask, kernel_options={**FORCED,
                                                                     "HEAD_GROUP": group})[0]
    assert [p.spec.template for p in hopper_plans()] and hopper_template
    default = flexfa.flex_attention(q, k, v, block_mask=mask, kernel_options=FORCED)
    torch.testing.assert_close(out, default, atol=0, rtol=0)


@pytest.mark.parametrize("heads, q_tiles, group", [(6, 5, 1), (6, 5, 4), (6, 5, 6), (6, 5, 9),
                                                   (7, 3, 2), (1, 4, 1)])
def test_longest_first_order_takes_the_heads_in_groups(heads, q_tiles, group):
    """fwd_common.tmpl's flexfa_longest_first run as Python over a (B * H, q tiles) grid in
    dispatch order: every (q tile, head) once; each group's programs together, its heads'
    last q tiles first; a group of at least B * H heads is the order before (every head's
    last tile, then the one before)."""
    source = load_template("fwd_common.tmpl")
    body = "\n\n".join(source[start:source.index("\n\n\n", start)] for start in (
        source.index(f"def {name}(") for name in ("flexfa_head_groups", "flexfa_longest_first")))
    order = []
    for pid1 in range(q_tiles):
        for pid0 in range(heads):
            tl = types.SimpleNamespace(program_id=lambda axis: (pid0, pid1)[axis],
                                       num_programs=lambda axis: (heads, q_tiles)[axis],
                                       constexpr=object)
            namespace = {"HAS_BLOCK_MASK": True, "tl": tl}
            exec(body, namespace)
            start_m, off_bh, _, _ = namespace["flexfa_longest_first"](1, group, True)
            order.append((start_m, off_bh))
    assert order == [(m, bh) for first in range(0, heads, group)
                     for m in range(q_tiles - 1, -1, -1)
                     for bh in range(first, min(first + group, heads))]
    if group >= heads:
        assert order == [(q_tiles - 1 - p1, p0) for p1 in range(q_tiles) for p0 in range(heads)]
