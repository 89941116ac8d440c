"""Quantization to e4m3 with per-block scales: shapes, layout, round trips within e4m3
precision, per-tensor scales, zero blocks."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexfa.fp8 import FP8Inputs, quantize
from flexfa.fp8.hadamard import rotate
from flexfa.fp8.quantize import E4M3_MAX, FP8_DTYPE

HALF_ULP = 2.0 ** -4  # e4m3 keeps 3 mantissa bits: round to nearest is within 2**-4 relative
HALF_SUBNORMAL = 2.0 ** -10  # the subnormal step is 2**-9 (in scaled units)


def _inputs(B, Hq, Hkv, L, S, E, Ev, seed=0, dtype=torch.bfloat16):
    generator = torch.Generator().manual_seed(seed)
    shapes = ((B, Hq, L, E), (B, Hkv, S, E), (B, Hkv, S, Ev))
    return [(3.0 * torch.randn(s, generator=generator)).to(dtype) for s in shapes]


def _per_row(scale, block, rows):
    return scale.repeat_interleave(block, dim=-1)[..., :rows, None]


def _assert_within_e4m3(x8, scale, block, exact):
    """Every element of ``x8 * scale`` is within e4m3 rounding of ``exact``."""
    step = _per_row(scale, block, exact.shape[2])
    got = x8.float() * step
    bound = torch.maximum(HALF_ULP * exact.abs(), HALF_SUBNORMAL * step) * (1 + 1e-6)
    assert ((got - exact).abs() <= bound).all(), (got - exact).abs().max()


@settings(max_examples=8)
@given(L=st.integers(1, 130), S=st.integers(1, 130), E=st.sampled_from([16, 24, 64]),
       block_q=st.sampled_from([16, 32, 64]), block_kv=st.sampled_from([16, 64, 128]),
       group=st.sampled_from([1, 2]), rotated=st.booleans())
def test_round_trip_within_e4m3_precision(L, S, E, block_q, block_kv, group, rotated):
    q, k, v = _inputs(1, 2 * group, 2, L, S, E, Ev=40)
    x = quantize(q, k, v, block_size=(block_q, block_kv), rotate=rotated, seed=5)
    assert x.q.dtype == x.k.dtype == x.v.dtype == FP8_DTYPE
    assert (x.block_q, x.block_kv, x.head_dim, x.dtype) == (block_q, block_kv, E, torch.bfloat16)
    Ep = x.q.shape[-1]
    assert Ep == (max(32, 1 << (E - 1).bit_length()) if rotated else E)
    assert x.q_scale.shape == (1, 2 * group, -(-L // block_q))
    assert x.k_scale.shape == x.v_scale.shape == (1, 2, -(-S // block_kv))
    assert x.v.shape == v.shape and (S == 1 or x.v.stride(2) == 1)  # V: S contiguous
    # in the rotated basis, element by element
    exact_q, exact_k = (rotate(t, x.signs) if rotated else t.float() for t in (q, k))
    _assert_within_e4m3(x.q, x.q_scale, block_q, exact_q)
    _assert_within_e4m3(x.k, x.k_scale, block_kv, exact_k)
    _assert_within_e4m3(x.v, x.v_scale, block_kv, v.float())
    # back in the original basis: RMSE within e4m3 precision
    for got, want in zip(x.dequantize(), (q, k, v)):
        assert got.shape == want.shape
        rel = (got - want.float()).pow(2).mean().sqrt() / want.float().pow(2).mean().sqrt()
        assert rel < HALF_ULP


def test_scales_put_each_block_max_on_448():
    q, k, v = _inputs(2, 2, 2, 100, 232, 64, 64)
    x = quantize(q, k, v, block_size=32, rotate=False)
    blocks = torch.nn.functional.pad(q.float().abs(), (0, 0, 0, 28)).view(2, 2, 4, -1).amax(-1)
    assert torch.allclose(x.q_scale, blocks / E4M3_MAX)
    assert x.q.float().abs().amax() == E4M3_MAX


def test_per_tensor_has_one_scale():
    q, k, v = _inputs(1, 2, 2, 100, 100, 32, 32)
    x = quantize(q, k, v, block_size=32, rotate=False, per_tensor=True)
    for scale, t in ((x.q_scale, q), (x.k_scale, k), (x.v_scale, v)):
        assert (scale == scale.flatten()[0]).all()
        assert torch.allclose(scale.flatten()[0], t.float().abs().max() / E4M3_MAX)


def test_zero_blocks_get_scale_one():
    q, k, v = _inputs(1, 1, 1, 64, 64, 32, 32)
    q[:, :, :32] = 0
    x = quantize(q, k, v, block_size=32, rotate=True)
    assert x.q_scale[0, 0, 0] == 1.0 and x.q[:, :, :32].float().abs().max() == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("fused", [False, True])
def test_non_finite_entries_become_nan_and_leave_their_block_alone(bad, fused):
    """A NaN or inf entry is e4m3's NaN; the block's scale comes from its finite entries
    (an inf scale zeroed the others, a NaN one, 1, clamped them to +-448)."""
    q, k, v = _inputs(1, 1, 1, 32, 32, 32, 32)
    k = k * 100  # the block's largest values are far above 448
    clean = quantize(q, k, v, block_size=16, rotate=False, fused=fused)
    k[0, 0, 3, 5] = bad
    x = quantize(q, k, v, block_size=16, rotate=False, fused=fused)
    assert torch.equal(x.k_scale, clean.k_scale)
    bits, clean_bits = x.k.view(torch.uint8), clean.k.view(torch.uint8)
    assert bits[0, 0, 3, 5] == 0x7F  # e4m3's NaN
    bits[0, 0, 3, 5] = clean_bits[0, 0, 3, 5]
    assert torch.equal(bits, clean_bits)


def test_fp16_and_fp32_inputs_set_the_output_dtype():
    q, k, v = _inputs(1, 1, 1, 40, 40, 32, 32, dtype=torch.float16)
    assert quantize(q, k, v).dtype == torch.float16
    assert quantize(q.float(), k.float(), v.float()).dtype == torch.bfloat16


def test_fp8inputs_is_a_frozen_record():
    q, k, v = _inputs(1, 1, 1, 40, 40, 32, 32)
    x = quantize(q, k, v)
    assert isinstance(x, FP8Inputs)
    with pytest.raises(AttributeError):
        x.q = q


@pytest.mark.parametrize("dtype,E,rotated,block_size", [
    (torch.bfloat16, 64, True, 128), (torch.float16, 48, True, (32, 64)),
    (torch.float32, 40, False, 64), (torch.bfloat16, 24, False, (16, 256))])
def test_fused_kernel_matches_torch_bit_for_bit(dtype, E, rotated, block_size):
    """The Triton quantization kernel (interpreted here; the CUDA default) gives the same
    e4m3 values, scales and layout as the torch path, ties rounded to even."""
    q, k, v = _inputs(1, 2, 1, 100, 150, E, 24, seed=E, dtype=dtype)
    a = quantize(q, k, v, block_size=block_size, rotate=rotated, fused=False)
    b = quantize(q, k, v, block_size=block_size, rotate=rotated, fused=True)
    for name in ("q", "k", "v", "q_scale", "k_scale", "v_scale"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.shape == y.shape and x.stride() == y.stride() and x.dtype == y.dtype, name
        assert torch.equal(x.float(), y.float()), name


def test_fused_and_per_tensor_exclude_each_other():
    from flexfa.errors import InputError
    with pytest.raises(InputError, match="per_tensor=True"):
        quantize(*_inputs(1, 1, 1, 16, 16, 32, 32), per_tensor=True, fused=True)


def test_one_tensor_as_q_k_and_v():
    """Self-attention style calls pass one tensor three times: V is never rotated."""
    x = _inputs(1, 1, 1, 40, 40, 32, 32)[0]
    for fused in (False, True):
        quantized = quantize(x, x, x, rotate=True, fused=fused)
        assert torch.allclose(quantized.dequantize()[2], x.float(), rtol=HALF_ULP, atol=1e-3)


@pytest.mark.parametrize("per_tensor", [False, True])
def test_a_blhe_layout_at_a_multiple_of_the_block(per_tensor):
    """[B, L, H, E] tensors seen as [B, H, L, E] at lengths that are multiples of the scale
    block failed inside torch ('view size is not compatible'; the torch path: the CPU's
    default and every per_tensor call). They quantize as their contiguous copies do."""
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2)
               for t in _inputs(1, 2, 2, 128, 64, 32, 32))
    assert not q.is_contiguous()
    block = None if per_tensor else 64
    options = {"per_tensor": True} if per_tensor else {"block_size": block}
    a = quantize(q, k, v, rotate=False, **options)
    b = quantize(q.contiguous(), k.contiguous(), v.contiguous(), rotate=False, **options)
    for name in ("q", "k", "v", "q_scale", "k_scale", "v_scale"):
        assert torch.equal(getattr(a, name).float(), getattr(b, name).float()), name


def test_quantize_and_attend_under_inference_mode():
    """Descales made under inference_mode have no version counter: quantize failed reading it
    ('Inference tensors do not track version counter'); such descales are checked on every
    call instead of passing as written."""
    from flexfa.fp8 import flex_attention_fp8
    q, k, v = _inputs(1, 2, 2, 64, 64, 32, 32)
    with torch.no_grad():
        want = flex_attention_fp8(q, k, v)
    with torch.inference_mode():
        quantized = quantize(q, k, v)
        assert quantized.written == () and not quantized.scales_as_written()
        got = flex_attention_fp8(q, k, v)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
