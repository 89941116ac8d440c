"""int64 marks survive the rewrites between the range analysis and the rendering. The marks
(``wide_ints``) are node keys, structural hashes of a subtree, computed on the mod's graph;
two rewrites build new nodes above what they change: ``render.lift_float_casts`` (index math
cast to float computed in float32) and the fold of constant factors into the kernel's scales
(``fold.fold_scales`` / ``fold_joint``). Before, a ``.long()`` above either rendered in int32
and wrapped silently (1.3-4.5 off against the float64 reference; a render/evaluate mutation
audit's find)."""
import pytest
import torch

import flexfa
from flexfa.codegen.ranges import Domain, int64_nodes, mods_int64_nodes
from flexfa.codegen.render import Leaves, render
from flexfa.frontend import trace
from flexfa.reference import attention_reference
from kernels.backward_utils import check_backward


def _qkv(L=32, S=32, H=2, E=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, H, n, E, generator=g).to(dtype) for n in (L, S, S))


def _scaled_long(score, b, h, q_idx, kv_idx):
    # both factors fold (1e10 into the score's scale, 1e-10 into log2(e)); |score| * 1e10
    # leaves int32
    return (score * 1e10).long() * 1e-10


def test_wide_cast_above_a_lifted_float_cast_renders_in_int64():
    traced = trace(lambda s, b, h, q, kv: (s * (q + 1) * 1e9).long() * 1e-9 / (q + 1))
    wide = int64_nodes([traced.root], (), Domain(1, 2, 32, 32))
    assert any(mark.startswith("f:") for mark in wide)  # q + 1 is lifted to float
    rendered = render([traced.root], Leaves(), wide=wide)
    text = "\n".join(rendered.lines + rendered.values)
    assert ".to(tl.int64)" in text and ".to(tl.int32)" not in text, text


def test_mask_with_an_int64_cast_above_index_math_in_float():
    """((q - kv) * 1e9).long() reaches 3.1e10 over 32 positions."""
    q, k, v = _qkv()

    def mask(b, h, q_idx, kv_idx):
        return (((q_idx - kv_idx).float() * 1e9).long() % 7 == 0) | (q_idx == kv_idx)
    block_mask = flexfa.create_block_mask(mask, 1, 2, 32, 32, device="cpu", BLOCK_SIZE=16)
    out = flexfa.flex_attention(q, k, v, block_mask=block_mask)
    want = attention_reference(q, k, v, None, mask, dtype=torch.float64)
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)


def test_folded_factors_keep_their_int64_cast_forward_and_backward():
    q, k, v = _qkv()
    marks = mods_int64_nodes((trace(_scaled_long),), Domain(1, 2, 32, 32))
    assert len([m for m in marks if not m.startswith("f:")]) >= 2  # the mod's and the folded
    out = flexfa.flex_attention(q, k, v, score_mod=_scaled_long)
    want = attention_reference(q, k, v, _scaled_long, dtype=torch.float64)
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)
    check_backward(*(t.requires_grad_() for t in _qkv()), _scaled_long)


def test_folded_factors_keep_their_int64_cast_in_the_gluon_kernels():
    q, k, v = _qkv(L=100, S=130, E=64, dtype=torch.bfloat16)
    options = {"BACKEND": "GLUON", "GLUON_EMULATE": True}
    out = flexfa.flex_attention(q, k, v, score_mod=_scaled_long, kernel_options=options)
    want = attention_reference(q, k, v, _scaled_long, dtype=torch.float64)
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)


def _index_long_mask(b, h, q_idx, kv_idx):
    # ((q - kv) * 1e9).long() leaves int32 past three positions apart
    return (((q_idx - kv_idx).float() * 1e9).long() % 7 == 0) | (q_idx >= kv_idx)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("options", [
    None, {"BACKEND": "AMPERE"}, {"BACKEND": "HOPPER"},
    {"BACKEND": "GLUON", "GLUON_BACKWARD": True}], ids=["auto", "ampere", "hopper", "gluon"])
def test_int64_casts_above_the_rewrites_on_the_gpu(options, dtype):
    """The compiled kernels of each family (the interpreter tests above run the Triton ones
    and the Gluon emulator): a folded factor's int64 cast in the score_mod and an int64 cast
    above float index math in the mask, forward and gradients against float64."""
    g = torch.Generator().manual_seed(1)
    L, E = 2048, 128
    q, k, v = (torch.randn(1, 2, L, E, generator=g).to("cuda", dtype).requires_grad_()
               for _ in range(3))
    block_mask = flexfa.create_block_mask(_index_long_mask, 1, 2, L, L, device="cuda")
    check_backward(q, k, v, _scaled_long, _index_long_mask, block_mask, kernel_options=options)
