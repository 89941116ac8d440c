"""sm_90 GPU: at a ragged S and L (multiples of no tile) a key tile past S must not read
the next head's (or, heads side by side, the next batch's) first keys and values, where an
inf or NaN turns this head's P @ V, or dQ = dS @ K in the backward, into NaN (P and dS are 0
there, 0 * inf is not). The CPU twins are tests/reliability/test_numerics.py and
test_isolation.py (the Hopper family and the Triton backward under the interpreter); these
run every sm_90 family: the Hopper and Gluon forwards (heads stacked, with GQA, and for
the Hopper family side by side: the Gluon family takes only stacked heads) and the Triton
and Gluon backwards. The Gluon kernels read the tiles past a head's end through
[heads, n, dim] views (gluon_common.tmpl's flexfa_gluon_load_rows).
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
    # "gqa": 4 query heads on the 2 kv heads
    shapes = [(2, n, 2, E) if layout == "strided" else (2, 4 if layout == "gqa" and n == L
                                                         else 2, n, E) for n in (L, S, S)]
    q, k, v = (torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)
               for shape in shapes)
    if layout == "strided":  # [B, S, H, E] memory read as [B, H, S, E]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    # the first key and value of every (batch, head) but (0, 0)
    k[1, 1, 0, 0], v[1, 1, 0, 1], v[0, 1, 0, 2], v[1, 0, 0, 3] = math.inf, math.inf, \
        math.nan, -math.inf
    k[0, 1, 0, 5] = math.inf
    # and the first query of every query head but the clean ones (GQA: 0 and 1 of batch 0)
    q[0, _clean(layout):, 0, 4], q[1, :, 0, 4] = math.inf, math.nan
    return q, k, v


def _clean(layout: str) -> int:
    """Batch 0's query heads that read only finite inputs: those of kv head 0."""
    return 2 if layout == "gqa" else 1


@pytest.mark.parametrize("name, layout", [(name, layout) for name in sorted(FORWARD)
                                          for layout in ("heads", "strided", "gqa")
                                          if layout != "strided" or name == "hopper"])
def test_forward_keeps_the_next_heads_inf_out(name, layout):
    q, k, v = _inputs(layout)
    block_mask = flexfa.create_block_mask(flexfa.mods.causal, None, None, L, S, device="cuda")
    for mask in (None, block_mask):
        out = flexfa.flex_attention(q, k, v, block_mask=mask, kernel_options=FORWARD[name],
                                    enable_gqa=layout == "gqa")
        heads = _clean(layout)
        assert torch.isfinite(out[0, :heads]).all(), f"{name} {layout} mask={mask is not None}"
        reference = attention_reference(q[:1, :heads], k[:1, :1].expand(1, heads, S, E),
                                        v[:1, :1].expand(1, heads, S, E),
                                        mask_mod=flexfa.mods.causal if mask else None)
        torch.testing.assert_close(out[:1, :heads].float(), reference.float(), atol=2e-2,
                                   rtol=2e-2)


@pytest.mark.parametrize("layout", ["heads", "gqa"])
@pytest.mark.parametrize("name", sorted(BACKWARD))
def test_backward_keeps_the_next_heads_inf_out(name, layout):
    q, k, v = (t.requires_grad_() for t in _inputs(layout))
    out = flexfa.flex_attention(q, k, v, kernel_options=BACKWARD[name],
                                enable_gqa=layout == "gqa")
    grad_out = torch.randn_like(out)
    clean = _clean(layout)
    grad_out[0, clean:, :, 0] = math.inf  # and in the other heads' upstream gradient
    out.backward(grad_out)
    # the clean heads' gradients, alone in float64
    rq, rk, rv = (t[:1, :heads].detach().double().requires_grad_()
                  for t, heads in ((q, clean), (k, 1), (v, 1)))
    attention_reference(rq, rk.expand(1, clean, S, E), rv.expand(1, clean, S, E)).backward(
        grad_out[:1, :clean].double())
    for label, grad, reference in (("dq", q.grad[0, :clean], rq.grad[0]),
                                   ("dk", k.grad[0, 0], rk.grad[0, 0]),
                                   ("dv", v.grad[0, 0], rv.grad[0, 0])):
        assert torch.isfinite(grad).all(), f"{name} {layout}: {label} of the clean heads"
        error = (grad.double() - reference).norm() / reference.norm()
        assert error < 2e-2, f"{name} {layout}: {label} relative error {error:.3g}"
