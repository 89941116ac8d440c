"""The FP8 forward kernel under the Triton interpreter (FP8 dots emulated) against float64.

Two references: attention on the *dequantized* inputs in float64 (what the kernel computes,
apart from P's e4m3 cast and the bf16 output: tight bounds), and attention on the original
inputs in float64 (the FP8 tolerance: relative RMSE of out, max error of lse).
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flexfa
from flexfa import mods
from flexfa.fp8 import flex_attention_fp8, quantize
from reference import reference_attention
from specialization import specialization_spy

B, H, L, S, E = 1, 2, 100, 232, 64


def _qkv(Hq=H, Hkv=H, L=L, S=S, E=E, Ev=None, dtype=torch.bfloat16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = ((B, Hq, L, E), (B, Hkv, S, E), (B, Hkv, S, Ev or E))
    return [torch.randn(s, generator=generator).to(dtype) for s in shapes]


def _rel_rmse(got, want):
    finite = torch.isfinite(want)
    diff = (got.double() - want.double())[finite]
    return float(diff.pow(2).mean().sqrt() / want.double()[finite].pow(2).mean().sqrt())


def check_fp8(q, k, v, score_mod=None, mask_mod=None, *, block_size=128, rotate=True,
              mask_block=64, enable_gqa=False, kernel_options=None, rel_rmse=0.08,
              lse_error=0.15, lse_dq_error=1e-4):
    block_mask = None
    if mask_mod is not None:
        block_mask = flexfa.create_block_mask(mask_mod, B, None, q.shape[2], k.shape[2],
                                              device="cpu", BLOCK_SIZE=mask_block)
    x = quantize(q, k, v, block_size=block_size, rotate=rotate)
    out, lse = flex_attention_fp8(x, score_mod=score_mod, block_mask=block_mask,
                                  enable_gqa=enable_gqa, return_lse=True,
                                  kernel_options=kernel_options)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert out.shape == (*q.shape[:3], v.shape[3]) and lse.shape == q.shape[:3]
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    scale = q.shape[-1] ** -0.5
    # 1. what the kernel computes: float64 attention on the dequantized inputs
    out_dq, lse_dq = reference_attention(*x.dequantize(unrotate=False), score_mod, mask_mod, scale=scale,
                                         enable_gqa=enable_gqa)
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_dq))
    finite = torch.isfinite(lse_dq)
    assert (lse - lse_dq)[finite].abs().max() < lse_dq_error  # P's cast does not touch lse
    # P in e4m3 rounds each weight by ~2**-3 / sqrt(12) = 3.6% RMS; with random V the
    # output is a sum of the same size as that noise, so ~2% relative error remains
    assert _rel_rmse(out, out_dq) < 0.04
    # 2. the FP8 tolerance: float64 attention on the original inputs
    out64, lse64 = reference_attention(q, k, v, score_mod, mask_mod, enable_gqa=enable_gqa)
    assert _rel_rmse(out, out64) < rel_rmse
    assert (lse - lse64)[finite].abs().max() < lse_error
    return out, lse


def _doc_lengths(n):
    return [n // 3, n - 2 * (n // 3), n // 3]


VARIANTS = {
    "dense": (None, None),
    "causal": (None, mods.causal),
    "alibi_causal": (mods.alibi(H), mods.causal),
    "softcap": (mods.softcap(5.0), None),
    "document": (None, mods.document(_doc_lengths(S))),
    "sliding_window": (None, mods.sliding_window(40)),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant(name):
    score_mod, mask_mod = VARIANTS[name]
    q, k, v = _qkv(L=S) if name == "document" else _qkv()  # documents need L == S
    check_fp8(q, k, v, score_mod, mask_mod)


def test_without_rotation_and_small_blocks():
    q, k, v = _qkv()
    check_fp8(q, k, v, None, mods.causal, block_size=(32, 16), rotate=False, mask_block=32)


def test_gqa_head_dims_and_fp16():
    """GQA (4 query heads per kv head), E = 48 (rotated: padded to 64), Ev = 40, fp16."""
    q, k, v = _qkv(Hq=4, Hkv=1, E=48, Ev=40, dtype=torch.float16, seed=3)
    check_fp8(q, k, v, mods.softcap(8.0), mods.causal, enable_gqa=True)


def test_kernel_options_pin_tiles():
    q, k, v = _qkv(seed=4)
    check_fp8(q, k, v, None, mods.causal, kernel_options={"BLOCK_M": 32, "BLOCK_N": 16})


@pytest.mark.parametrize("group", [1, 3])
def test_heads_in_groups_give_the_same_result(group):
    """kernel_options HEAD_GROUP reorders the programs under a block mask (4 query heads in
    groups of 1, or of 3 and 1; GQA 2): every (q tile, head) still runs once, against the
    references and bit-equal to every head in one group (the plain longest-first order)."""
    q, k, v = _qkv(Hq=4, Hkv=2, seed=10 + group)
    pins = {"BLOCK_M": 32, "BLOCK_N": 16}
    out, lse = check_fp8(q, k, v, None, mods.causal, enable_gqa=True,
                         kernel_options={**pins, "HEAD_GROUP": group})
    plain = check_fp8(q, k, v, None, mods.causal, enable_gqa=True,
                      kernel_options={**pins, "HEAD_GROUP": 4})
    torch.testing.assert_close(out, plain[0], atol=0, rtol=0)
    torch.testing.assert_close(lse, plain[1], atol=0, rtol=0)


def test_empty_rows_give_zero_and_minus_inf():
    def late_keys(b, h, q_idx, kv_idx):  # rows q_idx < 50 attend to nothing
        return (kv_idx < q_idx - 50) & (kv_idx >= 0)

    q, k, v = _qkv()
    out, lse = check_fp8(q, k, v, None, late_keys)
    assert (out[:, :, :51] == 0).all() and torch.isinf(lse[:, :, :51]).all()
    assert torch.isfinite(lse[:, :, 51:]).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_key_leaves_the_rows_that_do_not_read_it(bad):
    """Causal queries before a NaN / inf key give what they give without it: quantization keeps
    the key block's other values (an inf once zeroed them: NaN for every query of the block)."""
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 1, 64, 32, generator=generator).bfloat16() for _ in range(3))
    mask = flexfa.create_block_mask(mods.causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=16)
    clean = flex_attention_fp8(q, k, v, block_mask=mask, block_size=16, rotate=False)
    k[0, 0, 40, 3] = bad
    out = flex_attention_fp8(q, k, v, block_mask=mask, block_size=16, rotate=False)
    assert torch.equal(out[:, :, :40], clean[:, :, :40])


def test_bf16_tensors_are_quantized_in_the_call():
    q, k, v = _qkv(seed=5)
    direct = flex_attention_fp8(q, k, v, rotate=True, block_size=64, seed=7)
    staged = flex_attention_fp8(quantize(q, k, v, block_size=64, rotate=True, seed=7))
    assert torch.equal(direct, staged)
    out64 = reference_attention(q, k, v)[0]
    assert _rel_rmse(direct, out64) < 0.08


def test_scale_and_zero_lengths():
    q, k, v = _qkv(seed=6)
    out = flex_attention_fp8(q, k, v, scale=0.05)
    assert _rel_rmse(out, reference_attention(q, k, v, scale=0.05)[0]) < 0.08
    empty, lse = flex_attention_fp8(q[:, :, :0], k, v, return_lse=True)
    assert empty.shape == (B, H, 0, E) and lse.shape == (B, H, 0)


def test_ragged_last_mask_block_with_even_tiles():
    """S = 224: a multiple of the 32-wide kernel tile but not of the 64-wide mask block, so
    the flat block loop visits a sub-tile past S, which must be masked."""
    q, k, v = _qkv(L=96, S=224, seed=8)
    check_fp8(q, k, v, None, mods.causal, block_size=64, kernel_options={"BLOCK_N": 32})


def _call(options=None, score=None, scale=1.0):
    from flexfa.runtime.call import AttentionCall
    from flexfa.runtime.options import parse_kernel_options

    return AttentionCall(score, None, None, scale, parse_kernel_options(options), 1)


@pytest.mark.parametrize("name", ["dense", "alibi_causal"])
def test_tensor_descriptor_loads_match_pointer_loads(name):
    """kernel_options USE_TMA=True: the same kernel with Q, K, V^T tiles through tensor
    descriptors (zero fill past L, S and E instead of masked loads) gives bit-identical
    results."""
    from flexfa.runtime import plans
    from flexfa.runtime.families import fp8 as fp8_family
    from flexfa.runtime.target import INTERPRETER

    score_mod, mask_mod = VARIANTS[name]
    q, k, v = _qkv(E=48, seed=9)  # rotated: padded to 64 columns
    x = quantize(q, k, v, block_size=64, rotate=True)
    block_mask = (flexfa.create_block_mask(mask_mod, B, None, L, S, device="cpu", BLOCK_SIZE=64)
                  if mask_mod else None)
    plain = flex_attention_fp8(x, score_mod=score_mod, block_mask=block_mask, return_lse=True)
    assert not fp8_family.fp8_spec(x, _call(), INTERPRETER, False).use_tma
    assert fp8_family.fp8_spec(x, _call({"USE_TMA": True}), INTERPRETER, False).use_tma
    tma = flex_attention_fp8(x, score_mod=score_mod, block_mask=block_mask, return_lse=True,
                             kernel_options={"USE_TMA": True})
    ran = {p.spec.use_tma for p in plans.PLANS.values() if p.family is fp8_family.FP8
           and p.spec.head_dim == 64 and p.spec.has_block_mask == (mask_mod is not None)}
    assert ran >= {False, True}  # both plans exist: the options are part of the plan key
    assert torch.equal(plain[0], tma[0]) and torch.equal(plain[1], tma[1])
    unaligned = quantize(q[..., :40], k[..., :40], v, rotate=False)  # rows of 40 bytes
    assert not fp8_family.fp8_spec(unaligned, _call({"USE_TMA": True}), INTERPRETER,
                                   False).use_tma


def test_sub_tiles_past_s_read_descales_inside_the_table():
    """S = 160, K/V scale blocks of 32, mask blocks of 128: the last mask block's sub-tiles at
    192 and 224 lie past S; their descale index is clamped, so the NaN stored right after the
    scale tables (read by the last head if it were not) never reaches the output."""
    import dataclasses

    q, k, v = _qkv(L=64, S=160, seed=10)
    x = quantize(q, k, v, block_size=(64, 32))
    poisoned = {}
    for name in ("k_scale", "v_scale"):
        storage = torch.full((B * H * 5 + 8,), float("nan"))
        poisoned[name] = storage[:B * H * 5].view(B, H, 5)  # contiguous; NaN just past it
        poisoned[name].copy_(getattr(x, name))
    x = dataclasses.replace(x, **poisoned)
    block_mask = flexfa.create_block_mask(flexfa.noop_mask, B, None, 64, 160, device="cpu",
                                          BLOCK_SIZE=128)
    out = flex_attention_fp8(x, block_mask=block_mask)
    assert not torch.isnan(out).any()
    out64 = reference_attention(q, k, v)[0]
    assert _rel_rmse(out, out64) < 0.08


@settings(max_examples=6)
@given(L=st.integers(1, 150), S=st.integers(1, 150), E=st.sampled_from([16, 40, 64]),
       group=st.sampled_from([1, 2]), block_q=st.sampled_from([16, 32, 128]),
       block_kv=st.sampled_from([32, 64]), rotate=st.booleans(), causal=st.booleans())
def test_random_shapes(L, S, E, group, block_q, block_kv, rotate, causal):
    """Any lengths (not tile multiples), GQA, block sizes and head dims, with and without
    rotation, dense or a causal block mask: against both float64 references."""
    generator = torch.Generator().manual_seed(L * 1000 + S)
    q = torch.randn(1, 2 * group, L, E, generator=generator).to(torch.bfloat16)
    k, v = (torch.randn(1, 2, S, E, generator=generator).to(torch.bfloat16) for _ in range(2))
    mask_mod = mods.causal if causal else None
    block_mask = (flexfa.create_block_mask(mods.causal, 1, None, L, S, device="cpu",
                                           BLOCK_SIZE=64) if causal else None)
    x = quantize(q, k, v, block_size=(block_q, block_kv), rotate=rotate)
    out, lse = flex_attention_fp8(x, block_mask=block_mask, enable_gqa=True, return_lse=True)
    out_dq, lse_dq = reference_attention(*x.dequantize(unrotate=False), None, mask_mod,
                                         scale=E ** -0.5, enable_gqa=True)
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_dq))
    finite = torch.isfinite(lse_dq)
    assert (lse - lse_dq)[finite].abs().max() < 1e-4
    assert (out.double() - out_dq).abs().max() < 0.1 * out_dq.abs().max() + 1e-2
    assert not torch.isnan(out).any()


@pytest.mark.parametrize("option, target, expected", [
    (None, "interpret", False), (None, "cuda:90", True), (None, "cuda:89", False),
    (None, "cuda:100", False), ("AUTO", "cuda:90", True), (False, "cuda:90", False),
    (True, "interpret", True), (True, "cuda:89", True)])
@pytest.mark.parametrize("key", ["USE_TMA", "fwd_USE_TMA"])
def test_tma_loads_are_the_default_on_sm90_only(option, target, expected, key):
    from flexfa.runtime.families import fp8 as fp8_family
    from flexfa.runtime.target import parse_target

    x = quantize(*_qkv(L=64, S=64))
    assert fp8_family.tma_layout_ok(x)
    options = None if option is None else {key: option}
    assert fp8_family.use_tma(_call(options), parse_target(target), x) is expected


def test_sm90_default_tiles_fit_three_programs_per_sm_and_pins_override_the_cap():
    """E = 128 with tensor descriptors on sm_90: 64 x 128 tiles, 4 warps, 2 stages, 168
    registers (three programs per SM); tiles pinned through kernel_options drop the default
    cap, a pinned maxnreg wins. Specs only: nothing is launched."""
    from flexfa.runtime.families import fp8 as fp8_family
    from flexfa.runtime.target import Target

    sm90 = Target("cuda", 9, 0)
    assert fp8_family.default_tiles(128, sm90, use_tma=True) == (64, 128, 4, 2, 168)
    assert fp8_family.default_tiles(128, sm90, use_tma=False)[4] == 0
    assert fp8_family.default_tiles(64, sm90, use_tma=True)[4] == 0
    x = quantize(*_qkv(E=128, L=256, S=256))
    assert fp8_family.tma_layout_ok(x)

    def spec(options):
        return fp8_family.fp8_spec(x, _call(options), sm90, False)
    default = spec(None)
    assert (default.block_m, default.block_n, default.num_warps, default.num_stages,
            default.max_registers) == (64, 128, 4, 2, 168)
    assert default.launch_options() == {"num_warps": 4, "num_stages": 2, "maxnreg": 168}
    assert spec({"num_warps": 8}).max_registers == 0
    assert spec({"BLOCK_M": 128, "maxnreg": 200}).max_registers == 200
    assert spec({"maxnreg": 0}).max_registers == 0
    assert spec({"USE_TMA": False}).max_registers == 0  # pointer loads: no cap


def test_scale_fold_needs_positive_descales_a_positive_scale_and_no_score_mod():
    """quantize's descales are > 0 (positive_scales): without a score_mod and with scale > 0
    the kernel scales q.k inside exp2's FMA; a score_mod, a scale <= 0 or inputs built by
    hand (positive_scales False) keep the separate multiply."""
    import dataclasses

    from flexfa.runtime.families import fp8 as fp8_family
    from flexfa.runtime.pipeline import prepare_score_mod
    from flexfa.runtime.target import INTERPRETER

    x = quantize(*_qkv())
    assert x.positive_scales and quantize(*_qkv(), rotate=False).positive_scales
    assert bool((x.q_scale > 0).all() and (x.k_scale > 0).all())

    def fold(x, score=None, scale=0.125):
        return fp8_family.fp8_spec(x, _call(score=score, scale=scale), INTERPRETER,
                                   False).fold_qk_scale
    assert fold(x)
    assert not fold(x, prepare_score_mod(lambda s, b, h, i, j: s * 2.0))
    assert not fold(x, scale=-0.125) and not fold(x, scale=0.0)
    assert not fold(dataclasses.replace(x, positive_scales=False))
    # a numpy bool is a bool (check_bool); the spec holds Python's, as every other call's
    numpy = pytest.importorskip("numpy")
    assert fold(dataclasses.replace(x, positive_scales=numpy.True_)) is True


@pytest.mark.parametrize("mask_mod", [None, mods.causal])
def test_descales_of_any_sign_without_the_fold(mask_mod):
    """Inputs built by hand may carry negative descales (the same dequantized K as values and
    descales both negated): with positive_scales False the result equals quantize's own,
    which runs the fold; the scale fold (max(x) * c = max(x * c)) needs c > 0."""
    import dataclasses

    q, k, v = _qkv(L=128, S=128)
    x = quantize(q, k, v)
    flipped = dataclasses.replace(x, k=(-x.k.float()).to(x.k.dtype), k_scale=-x.k_scale,
                                  positive_scales=False)
    block_mask = flexfa.create_block_mask(mask_mod, None, None, 128, 128, device="cpu") \
        if mask_mod else None
    want, want_lse = flex_attention_fp8(x, block_mask=block_mask, return_lse=True)
    got, got_lse = flex_attention_fp8(flipped, block_mask=block_mask, return_lse=True)
    assert torch.allclose(got.float(), want.float(), atol=1e-2, rtol=0)
    assert torch.allclose(got_lse, want_lse, atol=1e-5)


def test_replaced_descales_that_break_positive_scales_are_refused():
    """quantize's output with a descale replaced or edited but positive_scales left True: a
    negative descale gave a wrong result (0.17 relative) and a NaN one NaN rows, with no
    error (an audit's probe). Descales quantize wrote pass unchecked; others are checked
    (one host synchronisation) and refused unless every one is finite and > 0."""
    import dataclasses

    q, k, v = _qkv(L=64, S=64)
    x = quantize(q, k, v)
    assert x.scales_as_written()
    flipped = dataclasses.replace(x, k=(-x.k.float()).to(x.k.dtype), k_scale=-x.k_scale)
    assert not flipped.scales_as_written()
    with pytest.raises(flexfa.InputError, match="positive_scales is True but k_scale holds -"):
        flex_attention_fp8(flipped)
    edited = quantize(q, k, v)
    edited.v_scale[0, 0, 0] = float("nan")
    with pytest.raises(flexfa.InputError, match="v_scale holds nan"):
        flex_attention_fp8(edited)
    # positive ones replaced: checked, and run with the fold
    doubled = dataclasses.replace(x, k=(x.k.float() / 2).to(x.k.dtype), k_scale=x.k_scale * 2)
    torch.testing.assert_close(flex_attention_fp8(doubled).float(),
                               flex_attention_fp8(x).float(), atol=2e-2, rtol=0)


def test_descales_with_any_strides_of_size_one_dimensions():
    """A contiguous descale whose size-1 dimension has an unusual stride (as_strided) failed
    an assertion (K's and V's scales must share strides); such scales are copied to standard
    strides now."""
    import dataclasses

    x = quantize(*_qkv(L=40, S=40, E=32), block_size=64)  # one scale block: [B, H, 1]
    odd = torch.zeros(64).as_strided(x.k_scale.shape, (x.k_scale.shape[1], 1, 7))
    odd.copy_(x.k_scale)
    assert odd.is_contiguous() and odd.stride() != x.v_scale.stride()
    torch.testing.assert_close(flex_attention_fp8(dataclasses.replace(x, k_scale=odd)),
                               flex_attention_fp8(x), atol=0, rtol=0)


def test_descales_at_other_alignments_get_their_own_plan(monkeypatch):
    """Descale tensors at an address that is not 16-byte aligned (views into a larger
    buffer) must not reuse a plan whose GPU kernel was compiled for aligned ones
    (``tests/specialization.py``); the result is the same."""
    import dataclasses

    launched, changed = specialization_spy(monkeypatch)
    x = quantize(*_qkv(L=64, S=64, E=32))

    def unaligned(t):
        buffer = torch.zeros(t.numel() + 1, dtype=t.dtype)
        buffer[1:] = t.flatten()
        return buffer[1:].view(t.shape)
    out = [flex_attention_fp8(x) for _ in range(2)]
    moved = dataclasses.replace(x, q_scale=unaligned(x.q_scale), k_scale=unaligned(x.k_scale),
                                v_scale=unaligned(x.v_scale))
    assert moved.q_scale.data_ptr() % 16 and moved.q_scale.stride() == x.q_scale.stride()
    torch.testing.assert_close(flex_attention_fp8(moved), out[0], atol=0, rtol=0)
    assert launched and not changed, f"specialized otherwise than at first: {changed}"
