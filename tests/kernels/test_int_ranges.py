"""Integer math in mods that int32 would wrap (hashes, powers, int64 captured values): the
forward (both bf16 templates), the backward and a mask_mod match the int64 eager reference,
and a kernel rendered for lengths where int32 suffices is not reused where it wraps."""
import pytest
import torch

import flexfa
from flexfa.blockmask import create_block_mask
from flexfa.runtime.families.ampere import int64_nodes
from flexfa.runtime.pipeline import prepare_score_mod
from kernels.backward_utils import check_backward
from kernels.forward_utils import TEMPLATES, make_qkv
from reference import assert_close_to_reference, reference_pair

BIG = torch.tensor([3 * 10 ** 9, -(2 ** 40) + 5, 11, 2 ** 62 + 1], dtype=torch.int64)


def hashed(score, b, h, q_idx, kv_idx):
    # q_idx * 3000017 * kv_idx passes 2**31 from q_idx * kv_idx > 715; 2 ** 40 in int64
    mixed = (q_idx * 3000017 * kv_idx + BIG[kv_idx % 4] + 2 ** (kv_idx % 48)) % 7
    return score + 0.5 * mixed.float()


def hashed_mask(b, h, q_idx, kv_idx):
    return ((q_idx * 3000017 * kv_idx) % 3 != 0) | (q_idx == kv_idx)


@pytest.fixture(params=sorted(TEMPLATES))
def template(request):
    """The kernel_options that force the forward family."""
    return TEMPLATES[request.param]


def _check_forward(q, k, v, score_mod=None, mask_mod=None, block_mask=None,
                   kernel_options=None):
    out, lse = flexfa.flex_attention(q, k, v, score_mod, block_mask, return_lse=True,
                                     kernel_options=kernel_options)
    (out64, lse64), (eager_out, eager_lse) = reference_pair(q, k, v, score_mod, mask_mod)
    assert_close_to_reference(out, out64, eager_out)
    assert_close_to_reference(lse, lse64, eager_lse, name="lse")


def test_hash_score_mod_and_mask_mod_match_int64_reference(template):
    q, k, v = make_qkv(1, 2, 2, 72, 80, 16, dtype=torch.bfloat16)
    block_mask = create_block_mask(hashed_mask, 1, 2, 72, 80, device="cpu", BLOCK_SIZE=32)
    _check_forward(q, k, v, hashed, hashed_mask, block_mask, kernel_options=template)


def test_kernel_for_short_lengths_is_not_reused_where_int32_wraps():
    def product(score, b, h, q_idx, kv_idx):
        return score + ((q_idx * kv_idx * 1000003) % 5).float()

    prepared = prepare_score_mod(product)
    for length in (16, 64):  # 15 * 15 * 1000003 fits int32, 63 * 63 * 1000003 does not
        q, k, v = make_qkv(1, 1, 1, length, length, 16)
        _check_forward(q, k, v, product)
    from flexfa.runtime.call import AttentionCall
    from flexfa.runtime.options import KernelOptions
    call = AttentionCall(prepared, None, None, 0.25, KernelOptions(), 1)
    short = make_qkv(1, 1, 1, 16, 16, 16)
    long = make_qkv(1, 1, 1, 64, 64, 16)
    assert int64_nodes(short[0], short[1], call) == ()
    assert int64_nodes(long[0], long[1], call) != ()


def test_backward_of_hash_score_mod():
    bias = torch.randn(2, requires_grad=True)

    def hashed_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h] * ((q_idx * 3000017 * kv_idx) % 3).float()

    q, k, v = make_qkv(1, 2, 2, 48, 48, 16)
    check_backward(q, k, v, hashed_bias, buffers=(bias,))
