"""Attention sinks and dropout compiled on the GPU: forward and gradients against the float64
reference (the interpreter tests in tests/kernels/test_sinks.py and test_dropout.py cover the
same code under TRITON_INTERPRET)."""
import pytest
import torch

import flexfa
from flexfa.reference import attention_reference

pytestmark = pytest.mark.gpu


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sinks_and_dropout_match_the_reference(dtype):
    B, Hq, Hkv, L, E = 2, 8, 2, 1000, 128
    q = torch.randn(B, Hq, L, E, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(B, Hkv, L, E, device="cuda", dtype=dtype, requires_grad=True)
            for _ in range(2))
    sinks = torch.randn(Hq, device="cuda", requires_grad=True)
    mask = flexfa.create_block_mask(causal, None, None, L, L, device="cuda")
    out, lse = flexfa.flex_attention(q, k, v, block_mask=mask, enable_gqa=True, return_lse=True,
                                     sinks=sinks, dropout_p=0.2, dropout_seed=11)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, sinks), grad)
    keep = flexfa.dropout_mask(11, B, Hq, L, L, 0.2, device="cuda")
    inputs = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    want_out, want_lse = attention_reference(*inputs[:3], mask_mod=causal, enable_gqa=True,
                                             return_lse=True, sinks=inputs[3],
                                             dropout_mask=keep, dropout_p=0.2)
    want = torch.autograd.grad(want_out, inputs, grad.double())
    tolerance = 3e-2 if dtype == torch.bfloat16 else 5e-3
    torch.testing.assert_close(out.double(), want_out, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-3, rtol=1e-3)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        scale = w.abs().max().item()
        assert (g.double() - w).abs().max().item() <= 4 * tolerance * max(scale, 1.0), name
