"""sm_90 GPU: at a ragged S and L (multiples of no tile) a key tile past S must not read
the next head's (or, heads side by side, the next batch's) first keys and values, where an
inf or NaN turns this head's P @ V, or dQ = dS @ K in the backward, into NaN (P and dS are 0
there, 0 * inf is not). The CPU twin is tests/reliability/test_numerics.py (the Hopper
family and the Triton backward under the interpreter); these run every sm_90 family:
the Hopper and Gluon forwards and the Triton and Gluon backwards (the Gluon kernels read K
and V through [B * H * S, E] row views: written in the twentieth session, not yet run).
    timeout 600 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_next_head_inf_gpu.py
"""
from __future__ import annotations

import math

import pytest
import torch

import flexfa
from flexfa.reference import attention_reference

pytestmark = pytest.mark.gpu

S, L, E = 1000, 250, 128
FORWARD = {"hopper": {"BACKEND": "HOPPER"}, "gluon": {"BACKEND": "GLUON"},
           "gluon_dynamic": {"BACKEND": "GLUON", "GLUON_PERSISTENT": "DYNAMIC"}}
BACKWARD = {"triton": {"BACKEND": "HOPPER", "GLUON_BACKWARD": False},
            "gluon": {"BACKEND": "GLUON", "GLUON_BACKWARD": True}}


def _inputs(layout: str):
    gen = torch.Generator(device="cuda").manual_seed(3)
    shapes = [(2, n, 2, E) if layout == "strided" else (2, 2, n, E) for n in (L, S, S)]
    q, k, v = (torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)
               for shape in shapes)
    if layout == "strided":  # [B, S, H, E] memory read as [B, H, S, E]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    # the first key and value of every (batch, head) but (0, 0)
    k[1, 1, 0, 0], v[1, 1, 0, 1], v[0, 1, 0, 2], v[1, 0, 0, 3] = math.inf, math.inf, \
        math.nan, -math.inf
    k[0, 1, 0, 5] = math.inf
    return q, k, v


@pytest.mark.parametrize("layout", ["heads", "strided"])
@pytest.mark.parametrize("name", sorted(FORWARD))
def test_forward_keeps_the_next_heads_inf_out(name, layout):
    q, k, v = _inputs(layout)
    block_mask = flexfa.create_block_mask(flexfa.mods.causal, None, None, L, S, device="cuda")
    for mask in (None, block_mask):
        out = flexfa.flex_attention(q, k, v, block_mask=mask, kernel_options=FORWARD[name])
        assert torch.isfinite(out[0, 0]).all(), f"{name} {layout} mask={mask is not None}"
        reference = attention_reference(q[:1, :1], k[:1, :1], v[:1, :1],
                                        mask_mod=flexfa.mods.causal if mask else None)
        torch.testing.assert_close(out[:1, :1].float(), reference.float(), atol=2e-2,
                                   rtol=2e-2)


@pytest.mark.parametrize("name", sorted(BACKWARD))
def test_backward_keeps_the_next_heads_inf_out(name):
    q, k, v = (t.requires_grad_() for t in _inputs("heads"))
    out = flexfa.flex_attention(q, k, v, kernel_options=BACKWARD[name])
    grad_out = torch.randn_like(out)
    grad_out[0, 1, :, 0] = math.inf  # and in the next head's upstream gradient
    out.backward(grad_out)
    for label, grad in (("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert torch.isfinite(grad[0, 0]).all(), f"{name}: {label} of head (0, 0)"
