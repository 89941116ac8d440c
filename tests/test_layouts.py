"""Input layouts, degenerate shapes and autograd plumbing of the public entry points.

Layouts the kernels read through strides (slices with storage offsets, a last dim of stride
2, stride-0 expanded dims, overlapping ``as_strided`` views, permuted memory) must give the
contiguous call's values, and their gradients must reach the tensor the view was made of
(autograd sums an expanded input's). References: the float64 reference for gradients (torch's
eager flex_attention has no CPU backward), bitwise equality with the contiguous call where
the kernels see the same values.
"""
from __future__ import annotations

import pytest
import torch

import flexfa
from flexfa.errors import InputError
from reference import assert_close_to_reference, reference_pair

B, H, L, S, E = 2, 2, 20, 12, 8


def _views():
    """name -> (bases, make): ``make(bases)`` gives q, k, v as views of the bases."""
    def sliced(n):
        return lambda t: t[1:, 1:, 3:3 + n, 2:2 + E]

    def overlapping(n):  # rows and heads overlap in memory
        return lambda t: t.as_strided((B, H, n, E), (3, 5, 1, 1), 7)

    def same(make_q, make_kv):
        return make_q, make_kv, make_kv
    return {
        "sliced": ([(B + 1, H + 1, L + 3, E + 4), (B + 1, H + 1, S + 3, E + 4)],
                   same(sliced(L), sliced(S))),
        "last_dim_stride_2": ([(B, H, L, 2 * E), (B, H, S, 2 * E)],
                              same(lambda t: t[..., ::2], lambda t: t[..., ::2])),
        "expanded_batch_and_heads": ([(1, 1, L, E), (1, 1, S, E)],
                                     same(lambda t: t.expand(B, H, L, E),
                                          lambda t: t.expand(B, H, S, E))),
        "expanded_rows": ([(B, H, 1, E), (B, H, 1, E)],
                          same(lambda t: t.expand(B, H, L, E), lambda t: t.expand(B, H, S, E))),
        "expanded_head_dim": ([(B, H, L, 1), (B, H, S, 1)],
                              same(lambda t: t.expand(B, H, L, E),
                                   lambda t: t.expand(B, H, S, E))),
        "overlapping": ([(300,), (300,)], same(overlapping(L), overlapping(S))),
        "permuted": ([(L, B, H, E), (S, B, H, E)],
                     same(lambda t: t.permute(1, 2, 0, 3), lambda t: t.permute(1, 2, 0, 3))),
    }


VIEWS = _views()


@pytest.mark.parametrize("name", list(VIEWS))
def test_strided_views_give_the_reference_values_and_gradients(name):
    (q_shape, kv_shape), (make_q, make_k, make_v) = VIEWS[name]
    generator = torch.Generator().manual_seed(0)
    bases = [torch.randn(shape, generator=generator, requires_grad=True)
             for shape in (q_shape, kv_shape, kv_shape)]
    q, k, v = make_q(bases[0]), make_k(bases[1]), make_v(bases[2])
    grad_out = torch.randn(B, H, L, E, generator=generator)
    out = flexfa.flex_attention(q, k, v)
    got = torch.autograd.grad(out, bases, grad_out)
    contiguous = flexfa.flex_attention(*(t.detach().contiguous() for t in (q, k, v)))
    assert torch.equal(out, contiguous)
    (out64, _), (ref, _) = reference_pair(q, k, v)
    assert_close_to_reference(out, out64, ref)
    want64 = torch.autograd.grad(out64, bases, grad_out.double())
    want = torch.autograd.grad(ref, bases, grad_out.to(ref.dtype))
    for g, w64, w in zip(got, want64, want):
        assert g.shape == w64.shape
        assert_close_to_reference(g, w64, w)


# ---- forward-only entry points --------------------------------------------------------------

@pytest.mark.parametrize("needing", ["query", "key", "value", "sinks", "a score_mod captured"])
def test_flex_decode_refuses_inputs_that_require_grad(needing):
    """flex_decode has no backward: an input that requires grad would silently get no
    gradient from its output (a loss adding it to other terms gave no error); refused, as
    flexfa.fp8's forward refuses them. Under no_grad the same call runs."""
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(shape, generator=generator)
               for shape in ((1, 2, 3, E), (1, 2, S, E), (1, 2, S, E)))
    tensors = {"query": q, "key": k, "value": v, "sinks": torch.zeros(2),
               "a score_mod captured": torch.zeros(2)}
    tensors[needing] = tensors[needing].clone().requires_grad_()
    bias = tensors["a score_mod captured"]

    def head_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h]
    args = (tensors["query"], tensors["key"], tensors["value"], head_bias)
    with pytest.raises(InputError, match=f"flex_decode is inference only.*{needing}.* requires "
                                         "grad"):
        flexfa.flex_decode(*args, sinks=tensors["sinks"])
    with torch.no_grad():
        out = flexfa.flex_decode(*args, sinks=tensors["sinks"])
    want = flexfa.flex_attention(*(t.detach() for t in args[:3]), head_bias,
                                 sinks=tensors["sinks"].detach())
    torch.testing.assert_close(out, want.detach(), atol=1e-5, rtol=1e-5)
