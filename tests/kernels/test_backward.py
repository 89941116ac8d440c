"""The generated backward kernels under the Triton interpreter: named variants with learnable
biases, GQA, head dims, dtypes, block sizes, strides and lse gradients against autograd of
the float64 reference; gradcheck at tiny shapes."""
import pytest
import torch

import flexfa
from flexfa import mods
from flexfa.blockmask import create_block_mask
from backward_utils import check_backward
from forward_utils import dense_block_mask, make_qkv

B, H, L, S, E = 1, 2, 100, 72, 16
TILES = {"BLOCK_M": 32, "BLOCK_N": 32}


def _learnable(seed, *shape):
    generator = torch.Generator().manual_seed(seed)
    return (0.5 * torch.randn(*shape, generator=generator)).requires_grad_(True)


def _named_cases():
    """(score_mod, mask_mod, captured tensors that require grad) of the named suite."""
    rel = _learnable(1, L + S - 1)
    table = _learnable(2, H, L, S)
    scale = _learnable(3, H)
    gate = _learnable(4, H)

    def relative_bias(score, b, h, q_idx, kv_idx):
        return score + rel[q_idx - kv_idx + S - 1]

    def learnable_table(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx, kv_idx]

    def head_scale(score, b, h, q_idx, kv_idx):
        return scale[h] * score

    def gated_alibi(score, b, h, q_idx, kv_idx):
        return score - torch.sigmoid(gate[h]) * (q_idx - kv_idx)

    return {
        "causal": (None, mods.causal, ()),
        "sliding_window": (None, mods.sliding_window(24), ()),
        "prefix_lm": (None, mods.prefix_lm(30), ()),
        "document": (None, mods.document([30, 40, 30]), ()),
        "alibi_causal": (mods.alibi(H), mods.causal, ()),
        "softcap": (mods.softcap(5.0), None, ()),
        "relative_bias": (relative_bias, None, (rel,)),
        "learnable_bias_table": (learnable_table, mods.causal, (table,)),
        "head_scale": (head_scale, mods.sliding_window(40), (scale,)),
        "gated_alibi": (gated_alibi, mods.causal, (gate,)),
        "dilated": (None, mods.dilated_window(8, 3), ()),
    }


NAMED = _named_cases()


@pytest.mark.parametrize("name", sorted(NAMED))
def test_named_variant(name):
    score_mod, mask_mod, buffers = NAMED[name]
    q, k, v = make_qkv(B, H, H, L, S, E)
    block_mask = None
    if mask_mod is not None:
        block_mask = create_block_mask(mask_mod, None, None, L, S, device="cpu", BLOCK_SIZE=32)
    check_backward(q, k, v, score_mod, mask_mod, block_mask, buffers=buffers,
                   kernel_options=TILES)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_with_learnable_bias(dtype):
    score_mod, mask_mod, buffers = NAMED["learnable_bias_table"]
    q, k, v = make_qkv(B, H, H, L, S, E, dtype=dtype, seed=1)
    block_mask = create_block_mask(mask_mod, None, None, L, S, device="cpu", BLOCK_SIZE=32)
    check_backward(q, k, v, score_mod, mask_mod, block_mask, buffers=buffers)


@pytest.mark.parametrize("Hq,Hkv", [(4, 2), (4, 1)])
def test_gqa_sums_over_the_group(Hq, Hkv):
    rel = _learnable(5, L + S - 1)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + rel[q_idx - kv_idx + S - 1] * (h + 1)

    q, k, v = make_qkv(2, Hq, Hkv, L, S, E, Ev=24, seed=2)
    block_mask = create_block_mask(mods.causal, 2, Hq, L, S, device="cpu", BLOCK_SIZE=(32, 64))
    check_backward(q, k, v, score_mod, mods.causal, block_mask, enable_gqa=True,
                   buffers=(rel,))


def test_head_dims_differ_and_are_not_powers_of_two():
    q, k, v = make_qkv(B, H, H, 40, 100, 24, Ev=40, seed=3)
    check_backward(q, k, v, mods.softcap(3.0), None, None)


def test_strided_inputs():
    q, k, v = make_qkv(B, H, H, L, S, E, seed=4)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # [B, L, H, E] memory
    k = torch.cat([k, k], dim=-1)[..., ::2]  # stride 2 along the head dim
    assert not q.is_contiguous() and not k.is_contiguous()
    check_backward(q, k, v, None, mods.causal,
                   create_block_mask(mods.causal, None, None, L, S, device="cpu", BLOCK_SIZE=32))


@pytest.mark.parametrize("scale", [-0.6, 0.0, 0.2])
def test_scale_of_any_sign_without_score_mod(scale):
    # without a score_mod the kernels fold scale * log2(e) into exp2's FMA on the raw q.k
    q, k, v = make_qkv(B, H, H, L, S, E, seed=8)
    check_backward(q, k, v, None, mods.causal,
                   create_block_mask(mods.causal, None, None, L, S, device="cpu", BLOCK_SIZE=32),
                   scale=scale, kernel_options=TILES)


def test_block_tables_without_full_blocks_and_wide_mask_blocks():
    """Only partial tables (mask code on every tile), blocks larger than the kernel tiles."""
    q, k, v = make_qkv(B, H, H, L, S, E, seed=5)
    mask_mod = mods.sliding_window(20)
    block_mask = dense_block_mask(mask_mod, 1, 1, L, S, 64, 64, full=False)
    check_backward(q, k, v, None, mask_mod, block_mask, kernel_options=TILES)


def test_gradient_through_lse():
    score_mod, mask_mod, buffers = NAMED["relative_bias"]
    q, k, v = make_qkv(B, H, H, L, S, E, seed=6)
    block_mask = create_block_mask(mods.causal, None, None, L, S, device="cpu", BLOCK_SIZE=32)
    check_backward(q, k, v, score_mod, mods.causal, block_mask, buffers=buffers, with_lse=True)


def test_gradient_through_lse_only():
    q, k, v = (t.requires_grad_(True) for t in make_qkv(B, H, H, 40, 48, E, seed=7))
    _, lse = flexfa.flex_attention(q, k, v, return_lse=True)
    lse.sum().backward()
    q64, k64 = q.detach().double().requires_grad_(True), k.detach().double().requires_grad_(True)
    scores = q64 @ k64.transpose(-1, -2) / E ** 0.5
    torch.logsumexp(scores, -1).sum().backward()
    torch.testing.assert_close(q.grad.double(), q64.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(k.grad.double(), k64.grad, atol=1e-5, rtol=1e-4)
    assert torch.count_nonzero(v.grad) == 0


def test_query_gradient_alone_with_lse():
    """Key and value need no gradient: the dK/dV kernel is skipped and the dQ kernel, which
    computes delta = rowsum(dO * O) - dlse itself, runs alone (ragged length, causal, an
    upstream gradient on lse too)."""
    q, k, v = make_qkv(B, H, H, L, S, E, seed=8)
    q.requires_grad_(True)
    block_mask = create_block_mask(mods.causal, None, None, L, S, device="cpu", BLOCK_SIZE=32)
    out, lse = flexfa.flex_attention(q, k, v, block_mask=block_mask, return_lse=True,
                                     kernel_options=TILES)
    generator = torch.Generator().manual_seed(9)
    grad_out, grad_lse = torch.randn(out.shape, generator=generator), \
        torch.randn(lse.shape, generator=generator)
    torch.autograd.backward((out, lse), (grad_out, grad_lse))
    q64 = q.detach().double().requires_grad_(True)
    scores = (q64 @ k.double().transpose(-1, -2)) / E ** 0.5
    keep = torch.arange(L)[:, None] >= torch.arange(S)[None, :]
    scores = scores.masked_fill(~keep, float("-inf"))
    out64 = torch.softmax(scores, -1) @ v.double()
    torch.autograd.backward((out64, torch.logsumexp(scores, -1)),
                            (grad_out.double(), grad_lse.double()))
    assert k.grad is None and v.grad is None
    torch.testing.assert_close(q.grad.double(), q64.grad, atol=1e-5, rtol=1e-4)


GRADCHECK_MODS = {
    # name: (score_mod(score, b, h, q_idx, kv_idx, param), parameter shape, mask_mod)
    "gated_tanh_bias_table": (lambda s, b, h, q, kv, p: torch.tanh(s) * torch.sigmoid(p[0, 0, h])
                              + p[1 + h, q, kv], (3, 10, 12), mods.causal),
    "relative_bias": (lambda s, b, h, q, kv, p: s + p[q - kv + 11], (22,), None),
    "learnable_alibi_window": (lambda s, b, h, q, kv, p: s - p[h] * (q - kv),
                               (2,), mods.sliding_window(6)),
}


@pytest.mark.parametrize("name", sorted(GRADCHECK_MODS))
def test_gradcheck_tiny_shapes(name):
    """torch.autograd.gradcheck in float64 (inputs and Jacobians, out and lse): the kernels
    compute in float32, so the finite-difference step and tolerances suit float32 rounding."""
    mod, param_shape, mask_mod = GRADCHECK_MODS[name]
    mask = None if mask_mod is None else create_block_mask(mask_mod, None, None, 10, 12,
                                                           device="cpu", BLOCK_SIZE=16)

    def attention(q, k, v, param):
        param32 = param.float()

        def score_mod(score, b, h, q_idx, kv_idx):
            return mod(score, b, h, q_idx, kv_idx, param32)

        out, lse = flexfa.flex_attention(q.float(), k.float(), v.float(), score_mod, mask,
                                         return_lse=True)
        return out.double(), lse.double()

    generator = torch.Generator().manual_seed(8)
    inputs = [torch.randn(*shape, generator=generator, dtype=torch.float64).requires_grad_(True)
              for shape in ((1, 2, 10, 16), (1, 2, 12, 16), (1, 2, 12, 16), param_shape)]
    assert torch.autograd.gradcheck(attention, inputs, eps=1e-3, atol=2e-3, rtol=2e-2,
                                    fast_mode=True)


def test_full_blocks_run_no_mask_code():
    """Tables that list every tile as full, with a causal mask_mod attached: a kernel that ran
    mask code on full tiles would drop the upper triangle; the gradients must be dense ones."""
    from forward_utils import tables_from_dense

    q, k, v = make_qkv(B, H, H, 64, 64, E, seed=9)
    everything = torch.ones(1, 1, 64, 64, dtype=torch.bool)
    block_mask = tables_from_dense(everything, 32, 32, mods.causal, full=True)
    assert int(block_mask.kv_num_blocks.sum()) == 0  # no partial tile at all
    check_backward(q, k, v, None, None, block_mask, kernel_options=TILES)


def test_one_parameter_read_at_two_index_sets():
    """Both loads scatter into the same gradient (rows by q_idx, columns by kv_idx)."""
    pos = _learnable(9, max(L, S))

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + pos[q_idx] * pos[kv_idx] - pos[kv_idx]

    q, k, v = make_qkv(B, H, H, L, S, E, seed=10)
    check_backward(q, k, v, score_mod, None, None, buffers=(pos,), kernel_options=TILES)


def test_learnable_exponent_read_per_head():
    """d base**gamma[h] / d gamma is 0 where the base is 0 (torch's convention, relu's zeros
    here); the derivative's select on that case took the AND of a tile and a comparison of
    the scalar gamma[h], which the Triton interpreter fails on (InterpreterError)."""
    gamma = (0.5 + torch.rand(H)).requires_grad_(True)

    def relu_power(score, b, h, q_idx, kv_idx):
        return score + torch.pow(torch.relu(score), gamma[h])

    q, k, v = make_qkv(B, H, H, L, S, E, seed=11)
    check_backward(q, k, v, relu_power, None, None, buffers=(gamma,), kernel_options=TILES)


def test_clamp_between_learnable_bounds_read_per_head():
    """torch.clamp(score, lo[h], hi[h]): the bounds' gradients, and none for either bound
    where they are equal and the score below them (head 1), as torch; that case's select took
    the AND of a tile and the comparison lo[h] == hi[h], which the Triton interpreter fails
    on (InterpreterError in the forward and the backward)."""
    low = torch.tensor([-0.5, 0.1], requires_grad=True)
    high = torch.tensor([0.5, 0.1], requires_grad=True)

    def clamped(score, b, h, q_idx, kv_idx):
        return torch.clamp(score, min=low[h], max=high[h])

    q, k, v = make_qkv(B, H, H, L, S, E, seed=12)
    check_backward(q, k, v, clamped, None, None, buffers=(low, high), kernel_options=TILES)
