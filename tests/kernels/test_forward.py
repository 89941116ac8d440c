"""The generated forward kernel under the Triton interpreter: named variants, block-sparse
iteration, GQA, head dims, dtypes and edge cases against the float64 reference."""
import math

import pytest
import torch

import flexfa
from flexfa import mods
from flexfa.blockmask import create_block_mask
from forward_utils import SMALL_TILES, check_forward, dense_block_mask, make_qkv, named_variants

B, H, L, S, E = 1, 2, 100, 232, 32


# ---- the named suite --------------------------------------------------------------------------

NAMED = named_variants(H, L, S)


@pytest.mark.parametrize("name", sorted(NAMED))
def test_named_variant(name):
    """Block tables built here from the dense mask: this tests the kernel, not the analysis."""
    score_mod, mask_mod = NAMED[name]
    q, k, v = make_qkv(B, H, H, L, S, E)
    block_mask = None
    if mask_mod is not None:
        block_mask = dense_block_mask(mask_mod, 1, 1, L, S, 64, 64)
    check_forward(q, k, v, score_mod, mask_mod, block_mask, kernel_options=SMALL_TILES)


@pytest.mark.parametrize("name", ["causal", "document", "alibi_causal", "dilated"])
def test_named_variant_with_create_block_mask(name):
    score_mod, mask_mod = NAMED[name]
    q, k, v = make_qkv(B, H, H, L, S, E, dtype=torch.float16)
    block_mask = create_block_mask(mask_mod, None, None, L, S, device="cpu", BLOCK_SIZE=64)
    check_forward(q, k, v, score_mod, mask_mod, block_mask)


def test_natten_2d():
    width, height = 12, 10  # 120 tokens: not a tile multiple
    mask_mod = mods.natten_2d(width, height, 5)
    n = width * height
    q, k, v = make_qkv(1, 2, 2, n, n, 16, dtype=torch.float16)
    block_mask = create_block_mask(mask_mod, None, None, n, n, device="cpu", BLOCK_SIZE=32)
    check_forward(q, k, v, None, mask_mod, block_mask, kernel_options={"BLOCK_M": 16, "BLOCK_N": 32})


# ---- block-sparse iteration -----------------------------------------------------------------

@pytest.mark.parametrize("full", [True, False])
@pytest.mark.parametrize("tiles", [(16, 16), (32, 32)])
def test_block_tables_from_a_dense_mask(full, tiles):
    """Tables built in the test, per batch and head, with blocks larger than the tiles."""
    def mask_mod(b, h, q_idx, kv_idx):
        return ((q_idx + 3 * h) // 20 == kv_idx // 50) | (kv_idx == b)

    q, k, v = make_qkv(2, 1, 1, 100, 150, 24, Ev=40, seed=3)
    block_mask = dense_block_mask(mask_mod, 2, 1, 100, 150, 32, 64, full=full)
    check_forward(q, k, v, None, mask_mod, block_mask,
                  kernel_options={"BLOCK_M": tiles[0], "BLOCK_N": tiles[1]})


def test_block_mask_with_score_mod_and_gqa():
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])

    def score_mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    q, k, v = make_qkv(1, 4, 2, 130, 130, 32, dtype=torch.bfloat16, seed=4)
    block_mask = create_block_mask(mods.sliding_window(50), 1, 4, 130, 130, device="cpu",
                                   BLOCK_SIZE=64)
    check_forward(q, k, v, score_mod, mods.sliding_window(50), block_mask, enable_gqa=True)


# ---- shapes, dtypes, GQA ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("Hq,Hkv", [(4, 1), (4, 2)])
def test_dtypes_and_gqa(dtype, Hq, Hkv):
    q, k, v = make_qkv(1, Hq, Hkv, 70, 45, 48, dtype=dtype, seed=5)
    check_forward(q, k, v, mods.softcap(20.0), enable_gqa=True, kernel_options=SMALL_TILES)


@pytest.mark.parametrize("E,Ev", [(8, 8), (80, 16), (256, 24), (12, 20)])
def test_head_dims_are_padded(E, Ev):
    q, k, v = make_qkv(1, 1, 1, 40, 33, E, Ev=Ev, seed=6)
    check_forward(q, k, v, kernel_options=SMALL_TILES)


def test_default_tiles_and_scale():
    q, k, v = make_qkv(2, 2, 2, 100, 100, 64, seed=7)
    check_forward(q, k, v, scale=0.3)
    check_forward(q, k, v, mods.alibi(2), scale=-1.0)


def test_strided_inputs_need_no_copies():
    base_q = torch.randn(1, 90, 3, 64)  # [B, L, H, E] memory, viewed as [B, H, L, E]
    q = base_q.transpose(1, 2)[..., ::2]  # E = 32 with stride 2
    kv = torch.randn(1, 2, 120, 2, 32)
    k, v = kv[:, 0].transpose(1, 2), kv[:, 1].transpose(1, 2)
    q = q[:, :2]
    assert not q.is_contiguous() and not k.is_contiguous()
    check_forward(q, k, v, mods.alibi(2), kernel_options=SMALL_TILES)


@pytest.mark.parametrize("L,S", [(1, 77), (77, 1), (1, 1), (16, 16)])
def test_tiny_lengths(L, S):
    q, k, v = make_qkv(1, 2, 2, L, S, 16, seed=8)
    check_forward(q, k, v, mods.softcap(3.0), kernel_options=SMALL_TILES)
    block_mask = create_block_mask(mods.causal, None, None, L, S, device="cpu", BLOCK_SIZE=32)
    check_forward(q, k, v, None, mods.causal, block_mask, kernel_options=SMALL_TILES)


# ---- empty rows: out 0, lse -inf, never NaN ---------------------------------------------------

def test_rows_with_nothing_to_attend():
    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx % 3 != 0) & (kv_idx < q_idx) & (h == 0)  # head 1: all rows empty

    q, k, v = make_qkv(1, 2, 2, 50, 60, 16, seed=9)
    block_mask = create_block_mask(mask_mod, None, 2, 50, 60, device="cpu", BLOCK_SIZE=16)
    out, lse = check_forward(q, k, v, None, mask_mod, block_mask,
                             kernel_options={"BLOCK_M": 16, "BLOCK_N": 16})
    assert torch.equal(out[0, 1], torch.zeros_like(out[0, 1]))
    assert torch.isneginf(lse[0, 1]).all() and torch.isneginf(lse[0, 0, ::3]).all()
    assert not out.isnan().any()


def test_score_mod_minus_inf_everywhere_in_a_row():
    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx % 4 == 1, float("-inf"), score)

    q, k, v = make_qkv(1, 1, 1, 40, 70, 16, seed=10)
    out, lse = check_forward(q, k, v, score_mod, kernel_options=SMALL_TILES)
    assert torch.equal(out[0, 0, 1::4], torch.zeros_like(out[0, 0, 1::4]))
    assert torch.isneginf(lse[0, 0, 1::4]).all()


def test_empty_block_mask_gives_zeros():
    q, k, v = make_qkv(1, 1, 1, 40, 40, 16)
    block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx < 0, None, None, 40, 40,
                                   device="cpu", BLOCK_SIZE=32)
    out, lse = flexfa.flex_attention(q, k, v, block_mask=block_mask, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_return_value_shape_without_lse():
    q, k, v = make_qkv(1, 2, 2, 20, 30, 16, Ev=24)
    out = flexfa.flex_attention(q, k, v)
    assert isinstance(out, torch.Tensor) and out.shape == (1, 2, 20, 24)


def test_captured_tensor_values_are_read_at_call_time():
    bias = torch.zeros(2)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[h]

    q, k, v = make_qkv(1, 2, 2, 20, 30, 16)
    before = flexfa.flex_attention(q, k, v, score_mod=score_mod, return_lse=True)[1]
    bias.fill_(1.5)
    after = flexfa.flex_attention(q, k, v, score_mod=score_mod, return_lse=True)[1]
    torch.testing.assert_close(after, before + 1.5)


def test_requires_grad_goes_through_autograd_function():
    q, k, v = make_qkv(1, 1, 1, 20, 20, 16)
    q.requires_grad_()
    out = flexfa.flex_attention(q, k, v)
    assert out.grad_fn is not None and "FlexAttention" in type(out.grad_fn).__name__
    with torch.no_grad():
        assert flexfa.flex_attention(q, k, v).grad_fn is None
    assert math.isfinite(out.sum().item())


def test_tf32_option_is_its_own_kernel():
    from flexfa.runtime import plans
    q, k, v = make_qkv(1, 1, 1, 30, 30, 16)
    ieee = flexfa.flex_attention(q, k, v)
    tf32 = flexfa.flex_attention(q, k, v, kernel_options={"fp32_precision": "tf32"})
    torch.testing.assert_close(tf32, ieee, atol=2e-3, rtol=2e-3)  # the interpreter has no tf32
    precisions = {getattr(plan.spec, "input_precision", None) for plan in plans.PLANS.values()}
    assert {"ieee", "tf32"} <= precisions


def test_empty_sizes():
    q, k, v = make_qkv(1, 2, 2, 10, 0, 16)
    out, lse = flexfa.flex_attention(q, k, v, return_lse=True)  # no keys: every row empty
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    q, k, v = make_qkv(0, 2, 2, 10, 5, 16)
    assert flexfa.flex_attention(q, k, v).shape == (0, 2, 10, 16)


def test_torch_block_mask_is_accepted():
    """A BlockMask from torch.nn.attention.flex_attention works as a drop-in."""
    torch_flex = pytest.importorskip("torch.nn.attention.flex_attention")
    mask_mod = mods.sliding_window(30)
    block_mask = torch_flex.create_block_mask(mask_mod, None, None, 100, 150, device="cpu",
                                              BLOCK_SIZE=64)
    q, k, v = make_qkv(1, 2, 2, 100, 150, 32)
    check_forward(q, k, v, None, mask_mod, block_mask)
