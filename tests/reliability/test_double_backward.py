"""Double backward is refused, loudly: a gradient taken with create_graph=True raises when it
is differentiated again (a gradient penalty), instead of silently having no second
derivative; first-order gradients are unchanged."""
import pytest
import torch

import flexfa
from flexfa.autograd import DOUBLE_BACKWARD_MESSAGE
from flexfa.reference import attention_reference
from .inputs import qkv

MATCH = "flex_attention does not support double backward"


def _inputs():
    return [t.requires_grad_() for t in qkv(L=24, S=40)]


def _with_bias():
    """A score_mod reading a captured tensor that needs a gradient, and that tensor."""
    bias = torch.linspace(-1, 1, 40).requires_grad_()

    def add_bias(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]

    return add_bias, bias


def test_gradient_penalty_through_autograd_grad_raises():
    q, k, v = _inputs()
    out = flexfa.flex_attention(q, k, v)
    (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    penalty = dq.pow(2).sum()
    with pytest.raises(RuntimeError, match=MATCH) as info:
        penalty.backward()
    assert "create_graph=True" in str(info.value) and "without create_graph" in str(info.value)


def test_second_backward_after_backward_with_create_graph_raises():
    q, k, v = _inputs()
    flexfa.flex_attention(q, k, v).sum().backward(create_graph=True)
    assert q.grad is not None and k.grad is not None
    with pytest.raises(RuntimeError, match=MATCH):
        torch.autograd.grad(k.grad.sum(), v)


def test_gradient_of_a_captured_tensor_raises_when_differentiated():
    q, k, v = _inputs()
    add_bias, bias = _with_bias()
    out = flexfa.flex_attention(q, k, v, score_mod=add_bias)
    (dbias,) = torch.autograd.grad(out.square().sum(), bias, create_graph=True)
    with pytest.raises(RuntimeError, match=MATCH):
        dbias.sum().backward()


def test_first_order_gradients_with_create_graph_equal_the_plain_ones():
    q, k, v = _inputs()
    add_bias, bias = _with_bias()
    inputs = (q, k, v, bias)
    plain = torch.autograd.grad(flexfa.flex_attention(q, k, v, score_mod=add_bias).sum(), inputs)
    graphed = torch.autograd.grad(flexfa.flex_attention(q, k, v, score_mod=add_bias).sum(),
                                  inputs, create_graph=True)
    for a, b in zip(plain, graphed):
        assert not a.requires_grad and b.requires_grad
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)


def test_plain_backward_and_grad_match_the_reference():
    q, k, v = _inputs()
    flexfa.flex_attention(q, k, v).sum().backward()
    grads = (q.grad, k.grad, v.grad)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    attention_reference(*ref).sum().backward()
    for got, want in zip(grads, (t.grad for t in ref)):
        assert not got.requires_grad
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    again = torch.autograd.grad(flexfa.flex_attention(q, k, v).sum(), (q, k, v))
    for a, b in zip(again, grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_message_says_how_to_get_first_order_gradients():
    assert "flex_attention" in DOUBLE_BACKWARD_MESSAGE
    for words in ("gradient penalty", "higher-order", "loss.backward()", "detach"):
        assert words in DOUBLE_BACKWARD_MESSAGE


def test_differentiating_with_respect_to_the_incoming_gradient_raises():
    """The double-backward form of a Jacobian-vector product differentiates the gradients with
    respect to grad_outputs: that path reached no raising node (the incoming gradient was not
    among its inputs), so functional.jvp silently returned zeros."""
    q, k, v = _inputs()
    out = flexfa.flex_attention(q, k, v)
    grad_out = torch.zeros_like(out, requires_grad=True)
    (dq,) = torch.autograd.grad(out, q, grad_out, create_graph=True)
    with pytest.raises(RuntimeError, match=MATCH):
        torch.autograd.grad((dq * torch.randn_like(dq)).sum() + grad_out.sum(), grad_out)
    q = q.detach()
    with pytest.raises(RuntimeError, match=MATCH):
        torch.autograd.functional.jvp(lambda x: flexfa.flex_attention(x, k.detach(),
                                                                      v.detach()),
                                      q, torch.randn_like(q))
