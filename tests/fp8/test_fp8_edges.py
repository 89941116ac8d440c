"""Edges of the FP8 path from a mutation audit (the forty-ninth session's): each test fails
under a rule changed with every other test passing (quantize's fused kernel, the rotation's
seed, block-size limits, FP8Inputs checks, descale layouts), or under the defect it found: a
float32 block of subnormals got descale 0 (NaN rows). References are plain float64 torch,
not flexfa's own helpers."""
import dataclasses

import pytest
import torch

import flexfa
from flexfa.codegen.fp8 import DESCALE_MIN, FOLD_MIN_SCALE
from flexfa.errors import InputError, InputTypeError
from flexfa.fp8 import flex_attention_fp8, quantize, random_signs, rotate



def _qkv(L=64, S=64, E=32, Ev=None, H=2, dtype=torch.bfloat16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = ((1, H, L, E), (1, H, S, E), (1, H, S, Ev or E))
    return [torch.randn(s, generator=generator).to(dtype) for s in shapes]


def _attention64(q, k, v, scale, causal=False):
    """Plain float64 softmax attention (no flexfa code)."""
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if causal:
        L, S = s.shape[-2:]
        s = s.masked_fill(torch.ones(L, S, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v.double()


def _rel_rmse(got, want):
    diff = got.double() - want.double()
    return float(diff.pow(2).mean().sqrt() / want.double().pow(2).mean().sqrt())


# ---- quantize: fused kernel vs torch path metadata (M14, M15, M20) -------------------------

def test_fused_quantize_keeps_head_dim_output_dtype_and_positive_scales():
    """The fused quantization kernel (CUDA's default) must describe its output exactly as the
    torch path does: head_dim is the *unpadded* E (the default softmax scale is
    1/sqrt(head_dim)), the output dtype of float32 inputs is bf16, and the descales are
    marked positive. Only the tensors were compared before."""
    q, k, v = _qkv(L=40, S=40, E=48, dtype=torch.float32)
    a = quantize(q, k, v, block_size=16, rotate=True, fused=False)
    b = quantize(q, k, v, block_size=16, rotate=True, fused=True)
    assert b.q.shape[-1] == 64
    assert (b.head_dim, b.dtype, b.positive_scales) == (48, torch.bfloat16, True)
    assert (a.head_dim, a.dtype, a.positive_scales) == (b.head_dim, b.dtype, b.positive_scales)


def test_fused_quantize_attention_uses_the_unpadded_default_scale():
    """End to end: attention on fused-quantized rotated inputs (E = 48, padded to 64) uses
    scale 1/sqrt(48) by default: bit-equal to the torch path's (same e4m3 values and
    descales) and close to float64 attention on the original inputs."""
    q, k, v = _qkv(L=32, S=32, E=48, H=1, seed=1)
    fused = quantize(q, k, v, block_size=16, rotate=True, fused=True)
    plain = quantize(q, k, v, block_size=16, rotate=True, fused=False)
    with torch.no_grad():
        out, lse = flex_attention_fp8(fused, return_lse=True)
        want_out, want_lse = flex_attention_fp8(plain, return_lse=True)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert _rel_rmse(out, _attention64(q, k, v, 48 ** -0.5)) < 0.08


# ---- quantize: seed and block-size contract (M18, M41, M42, M34) ---------------------------

def test_the_seed_chooses_the_rotation_signs():
    """quantize(seed=s) rotates with random_signs(d, s): the seed was not checked anywhere
    (every test passed the same seed to both sides of a comparison)."""
    q, k, v = _qkv(E=64)
    for seed in (0, 5):
        x = quantize(q, k, v, rotate=True, seed=seed)
        assert torch.equal(x.signs, random_signs(64, seed))
    assert not torch.equal(quantize(q, k, v, seed=5).q.float(), quantize(q, k, v, seed=0).q.float())
    x = quantize(q, k, v, block_size=64, rotate=True, seed=5)
    back = rotate(q, random_signs(64, 5))
    dq = x.dequantize(unrotate=False)[0]
    assert _rel_rmse(dq, back) < 2.0 ** -4


@pytest.mark.parametrize("block_size", [8, (16, 8), (8, 16)])
def test_block_sizes_below_16_are_refused(block_size):
    """The kernel's tiles are at least 16 rows: quantize refuses smaller scale blocks with an
    InputError naming block_size (8 was never tried)."""
    with pytest.raises(InputError, match="block_size"):
        quantize(*_qkv(L=40, S=40), block_size=block_size)


def test_the_largest_block_size_and_rotation_are_accepted():
    """2**16 is the documented upper bound of a scale block and of a rotation (inclusive)."""
    x = quantize(*_qkv(L=40, S=40), block_size=(16, 2 ** 16), rotate=False)
    assert x.k_scale.shape == (1, 2, 1) and x.block_kv == 2 ** 16
    assert random_signs(2 ** 16).shape == (2 ** 16,)


# ---- quantize: numerical edge cases (M96, real bug 1) --------------------------------

def test_fused_quantize_gives_an_all_zero_block_descale_one():
    """The fused kernel's zero-block rule (descale 1, values 0), as the torch path: a zero
    descale would turn the block's zeros into 0/0 = NaN."""
    q, k, v = _qkv(L=64, S=64, dtype=torch.float32)
    k[:, :, 16:32] = 0
    x = quantize(q, k, v, block_size=16, rotate=False, fused=True)
    assert (x.k_scale[:, :, 1] == 1.0).all()
    assert (x.k[:, :, 16:32].float() == 0).all()


def test_fused_quantize_takes_the_amax_of_every_chunk_of_a_long_block():
    """A 256-row scale block is quantized in 128-row chunks: the block's largest value in its
    second chunk must set the descale (not be clipped to 448), as the torch path does."""
    q, k, v = _qkv(L=16, S=256, E=32, H=1, dtype=torch.float32, seed=2)
    k[0, 0, 200, 3] = 50.0
    fused = quantize(q, k, v, block_size=(16, 256), rotate=False, fused=True)
    plain = quantize(q, k, v, block_size=(16, 256), rotate=False, fused=False)
    torch.testing.assert_close(fused.k_scale, torch.full_like(fused.k_scale, 50.0 / 448))
    assert torch.equal(fused.k_scale, plain.k_scale)
    assert torch.equal(fused.k.float(), plain.k.float())


@pytest.mark.parametrize("fused", [False, True])
def test_tiny_float32_blocks_get_a_positive_descale(fused):
    """A block of nonzero float32 values below 448 * 2**-149 got descale 0 (NaN values on the
    torch path) while quantize marked the scales positive; with a causal mask the kernel's
    folded scaling then computed -inf * 0 = NaN rows. Descales are now at least DESCALE_MIN
    (2**-60). float64 attention is finite."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 32, 32, generator=g) for _ in range(3))
    k[:, :, :16] = 1e-44
    x = quantize(q, k, v, block_size=16, rotate=False, fused=fused)
    mask = flexfa.create_block_mask(lambda b, h, i, j: i >= j, None, None, 32, 32,
                                    device="cpu", BLOCK_SIZE=16)
    with torch.no_grad():
        out = flex_attention_fp8(x, block_mask=mask)
    want = _attention64(q, k, v, 32 ** -0.5, causal=True)
    assert bool((x.k_scale >= DESCALE_MIN).all())
    assert not out.isnan().any()
    assert _rel_rmse(out, want) < 0.08


# ---- FP8Inputs checks (M52, M54, M55) ----------------------------------------------------

def test_fp8inputs_output_dtype_must_be_bf16_or_fp16():
    """A hand-built FP8Inputs with dtype float32 is an InputTypeError naming FP8Inputs.dtype,
    not a failure inside the kernel spec."""
    x = quantize(*_qkv(L=40, S=40))
    with pytest.raises(InputTypeError, match="FP8Inputs.dtype"):
        flex_attention_fp8(dataclasses.replace(x, dtype=torch.float32))


@pytest.mark.parametrize("bad", [0.0, float("inf")])
def test_zero_or_infinite_descales_are_refused_under_positive_scales(bad):
    """positive_scales=True promises every descale finite and > 0: a replaced descale table
    holding 0 or inf is refused. (A zero K descale with a block mask gives NaN rows through
    the kernel's -inf * 0.)"""
    x = quantize(*_qkv(L=64, S=64), block_size=32)
    k_scale = x.k_scale.clone()
    k_scale[0, 0, 0] = bad
    with pytest.raises(InputError, match="positive_scales is True but k_scale holds"):
        flex_attention_fp8(dataclasses.replace(x, k_scale=k_scale))


# ---- descale layout (M63) ---------------------------------------------------------------

def test_a_q_descale_view_with_a_non_unit_last_stride():
    """q_scale as a strided view (every other element of a larger buffer): the kernel reads
    the last dim with stride 1, so it must be copied to standard strides first."""
    x = quantize(*_qkv(L=64, S=64), block_size=16)
    buffer = torch.full((*x.q_scale.shape[:2], 2 * x.q_scale.shape[2]), 1e3)
    buffer[..., ::2] = x.q_scale
    strided = buffer[..., ::2]
    assert strided.stride()[-1] == 2
    with torch.no_grad():
        got = flex_attention_fp8(dataclasses.replace(x, q_scale=strided))
        want = flex_attention_fp8(x)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


# ---- hadamard: the documented matrix and seeds (M27, M40) ---------------------------------

def test_hadamard_matrix_is_sylvesters():
    """hadamard_matrix(d) is documented as the Sylvester matrix: entry (i, j) is
    (-1)**popcount(i & j). Other +-1 orthogonal matrices (another sign pattern) pass the
    orthogonality tests but break reproducing a rotation outside flexfa."""
    from flexfa.fp8.hadamard import hadamard_matrix
    d = 16
    i = torch.arange(d)
    parity = torch.tensor([[bin(a & b).count("1") % 2 for b in range(d)] for a in range(d)])
    assert torch.equal(hadamard_matrix(d), 1.0 - 2.0 * parity.float())
    assert i.numel() == d


def test_negative_seeds_are_seeds_of_their_own():
    """Seeds -2**63 .. 2**64 - 1 are all accepted: -3 and 3 give different rotations."""
    assert not torch.equal(random_signs(64, -3), random_signs(64, 3))
    assert torch.equal(quantize(*_qkv(E=64), seed=-3).signs, random_signs(64, -3))


# ---- more argument checks (M43, M44, M48) -------------------------------------------------

@pytest.mark.parametrize("block_size", [True, (16, False)])
def test_bool_block_sizes_are_type_errors(block_size):
    """A bool is not a block size (True == 1): an InputTypeError, as for other non-ints."""
    with pytest.raises(InputTypeError, match="block_size must be an int or a pair of ints"):
        quantize(*_qkv(L=40, S=40), block_size=block_size)


def test_quantize_names_a_tensor_on_another_device():
    """key on another device (meta here: no GPU needed) is an InputError naming key."""
    q, k, v = _qkv(L=40, S=40)
    with pytest.raises(InputError, match="key is on meta but query is on cpu"):
        quantize(q, k.to("meta"), v)
    with pytest.raises(InputError, match="value is on meta but query is on cpu"):
        quantize(q, k, v.to("meta"))


def test_a_descale_on_another_device_is_named():
    x = quantize(*_qkv(L=40, S=40))
    with pytest.raises(InputError, match="k_scale is on meta but query is on cpu"):
        flex_attention_fp8(dataclasses.replace(x, k_scale=x.k_scale.to("meta")))


# ---- kernel: TMA layout gate and the interpreter's P cast (M80, M88, M110) ----------------

def test_tensor_descriptors_are_not_used_for_a_value_tensor_without_unit_s_stride():
    """A hand-built FP8Inputs whose V rows are every other row of S-contiguous storage
    (stride 2 along S, 16-byte aligned otherwise) must not take the tensor-descriptor path,
    which loads V^T rows along S with unit stride: USE_TMA=True gives the pointer path's
    result."""
    x = quantize(*_qkv(L=64, S=64, E=32), block_size=64, rotate=False)
    B, H, S, Ev = x.v.shape
    storage = torch.zeros(B, H, Ev, 2 * S, dtype=x.v.dtype)
    every_other = storage.transpose(-1, -2)[:, :, ::2, :]
    every_other.copy_(x.v)
    assert every_other.stride(2) == 2 and every_other.stride(3) % 16 == 0
    y = dataclasses.replace(x, v=every_other)
    with torch.no_grad():
        want = flex_attention_fp8(x)
        got = flex_attention_fp8(y, kernel_options={"USE_TMA": True})
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def _query_on_the_first_key(keys: int, E: int = 32):
    """bf16 q [1, 1, 1, E] and k [1, 1, keys, E], zeros but q's and the first key's channel
    0 (1.0): the first key's score is the scale, every other key's 0."""
    q = torch.zeros(1, 1, 1, E, dtype=torch.bfloat16)
    k = torch.zeros(1, 1, keys, E, dtype=torch.bfloat16)
    q[..., 0] = 1.0
    k[..., 0, 0] = 1.0
    return q, k


def test_p_rounding_carries_into_the_next_power_of_two():
    """One query, two keys whose weights are 256 and 125 after P's 2**8 shift: e4m3 rounds
    125 up to 128 (a carry across a power of two, which the interpreter's plain float32 ->
    e4m3 cast drops at odd exponents, giving 64). With V all ones the output is
    sum(round(p)) / sum(p), within e4m3's 2**-4 of 1 (0.84 without the emulated rounding).
    Inputs are exactly representable: q = k0 = e0, k1 = 0."""
    q, k = _query_on_the_first_key(2)
    v = torch.ones(1, 1, 2, 32, dtype=torch.bfloat16)
    scale = float(torch.log(torch.tensor(256.0 / 125.0, dtype=torch.float64)))
    with torch.no_grad():
        out = flex_attention_fp8(q, k, v, scale=scale, rotate=False, block_size=16)
    assert (out.float() - 1).abs().max() < 2.0 ** -4


def test_the_largest_weight_is_not_clipped_by_the_e4m3_range():
    """P is cast as P * 2**P_SHIFT: the largest weight (2**P_SHIFT) must stay within e4m3's
    448 (with a shift of 9 it is 512, saturated to 448: 12.5% low). One dominant key (score
    4 above the 15 others), V one-hot on it: out is its softmax weight, as float64 says,
    within e4m3's 2**-4."""
    q, k = _query_on_the_first_key(16)
    v = torch.zeros(1, 1, 16, 32, dtype=torch.bfloat16)
    v[..., 0, 0] = 1.0
    with torch.no_grad():
        out = flex_attention_fp8(q, k, v, scale=4.0, rotate=False, block_size=16)
    want = _attention64(q, k, v, 4.0)
    assert abs(out[0, 0, 0, 0].item() - want[0, 0, 0, 0].item()) < 2.0 ** -4 * want[0, 0, 0, 0].item()


@pytest.mark.parametrize("scale", [0.3, FOLD_MIN_SCALE, FOLD_MIN_SCALE / 4, 1e-30])
def test_tiny_descales_and_scales_keep_masked_scores_out(scale):
    """q and k blocks at DESCALE_MIN (values of 1e-20) under a causal mask: the folded score
    scale q_descale * k_descale * scale * log2(e) must not underflow to 0 (a masked -inf
    score times 0 is NaN). quantize's floor keeps the descales' product at 2**-120 and the
    fold needs scale >= FOLD_MIN_SCALE; smaller scales run the separate multiply. The same
    inputs at each scale, in one process: the plan is keyed on the fold."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 1, 32, 32, generator=g) for _ in range(3))
    q, k = q * 1e-20, k * 1e-20
    x = quantize(q, k, v, block_size=16, rotate=False)
    assert bool((x.q_scale == DESCALE_MIN).all()) and bool((x.k_scale == DESCALE_MIN).all())
    mask = flexfa.create_block_mask(lambda b, h, i, j: i >= j, None, None, 32, 32,
                                    device="cpu", BLOCK_SIZE=16)
    for call_scale in (0.3, scale):
        with torch.no_grad():
            out = flex_attention_fp8(x, block_mask=mask, scale=call_scale)
        want = _attention64(q, k, v, call_scale, causal=True)
        assert not out.isnan().any(), call_scale
        assert _rel_rmse(out, want) < 0.08, call_scale


def test_hand_built_descales_below_the_floor_are_refused_under_positive_scales():
    """positive_scales=True on descales below DESCALE_MIN (whose products can underflow the
    folded scale to 0) is an InputError naming the table and the floor."""
    x = quantize(*_qkv(L=64, S=64), block_size=32)
    k_scale = x.k_scale.clone()
    k_scale[0, 0, 0] = DESCALE_MIN / 2
    with pytest.raises(InputError, match="k_scale holds .* at least"):
        flex_attention_fp8(dataclasses.replace(x, k_scale=k_scale))
    with torch.no_grad():  # positive_scales=False runs them
        out = flex_attention_fp8(dataclasses.replace(x, k_scale=k_scale, positive_scales=False))
    assert not out.isnan().any()
