"""flexfa inside torch.compile'd code (flexfa.eager): each entry point is a graph
break that runs eagerly, so a compiled model gets flexfa's results and gradients, including
those of captured tensors; fullgraph=True is rejected by Dynamo. The compiled regions use the
aot_eager backend (Dynamo + AOTAutograd, no C++ compiler needed)."""
import pytest
import torch

import flexfa
from flexfa import mods


def _inputs(seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, 64, 16, generator=generator, requires_grad=True) for _ in range(3)]


def _grads(fn, inputs, grad_out):
    out = fn(*inputs)
    out.backward(grad_out)
    grads = [t.grad.clone() for t in inputs]
    for t in inputs:
        t.grad = None
    return out.detach(), grads


def _run_both(layer, inputs, seed):
    grad_out = torch.randn(1, 2, 64, 16, generator=torch.Generator().manual_seed(seed))
    torch._dynamo.reset()
    eager = _grads(layer, inputs, grad_out)
    compiled = _grads(torch.compile(layer, backend="aot_eager"), inputs, grad_out)
    return eager, compiled


def test_a_compiled_model_calls_flexfa_eagerly_with_gradients():
    """Compiled ops before and after the call, a mask made outside, a softcap score_mod: the
    same output and q, k, v gradients as without torch.compile."""
    mask = flexfa.create_block_mask(mods.causal, 1, None, 64, 64, device="cpu", BLOCK_SIZE=32)

    def layer(q, k, v):
        return torch.tanh(flexfa.flex_attention(q * 2, k, v, mods.softcap(5.0), mask)) + 1

    (out, grads), (c_out, c_grads) = _run_both(layer, _inputs(0), seed=1)
    torch.testing.assert_close(c_out, out, rtol=1e-6, atol=1e-6)
    for name, got, want in zip("qkv", c_grads, grads):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"d{name}")


def test_block_mask_and_learnable_bias_inside_the_compiled_function():
    """create_block_mask called inside the compiled function, and a captured tensor that needs
    a gradient: its gradient reaches it through the graph break."""
    bias = torch.zeros(2, requires_grad=True)

    def learnable(score, b, h, q_idx, kv_idx):
        return score + bias[h] * (q_idx - kv_idx)

    def layer(q, k, v):
        mask = flexfa.create_block_mask(mods.causal, 1, None, 64, 64, device="cpu",
                                        BLOCK_SIZE=32)
        return flexfa.flex_attention(q, k, v, learnable, mask)

    inputs = _inputs(2)
    (out, _), (c_out, _) = _run_both(layer, inputs, seed=3)
    torch.testing.assert_close(c_out, out, rtol=1e-6, atol=1e-6)
    # _run_both ran backward twice (eager, compiled): bias.grad holds both, equal halves
    eager_grad = torch.autograd.grad(layer(*inputs).sum(), bias)[0]
    compiled_grad = torch.autograd.grad(torch.compile(layer, backend="aot_eager")(*inputs).sum(),
                                        bias)[0]
    assert eager_grad.abs().sum() > 0
    torch.testing.assert_close(compiled_grad, eager_grad, rtol=1e-6, atol=1e-6)


def test_fullgraph_rejects_the_graph_break():
    def layer(q, k, v):
        return flexfa.flex_attention(q, k, v)

    torch._dynamo.reset()
    with pytest.raises(Exception, match="disable"):
        torch.compile(layer, backend="aot_eager", fullgraph=True)(*_inputs(4))


def test_eager_calls_are_unchanged_by_the_check():
    """Outside torch.compile the entry points run as before (the check is one call)."""
    q, k, v = (t.detach() for t in _inputs(5))
    out = flexfa.flex_attention(q, k, v)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert flexfa.flex_attention.__name__ == "flex_attention"
    assert flexfa.create_block_mask.__doc__ and "mask_mod" in flexfa.create_block_mask.__doc__


def test_fp8_attention_inside_a_compiled_function():
    from flexfa.fp8 import flex_attention_fp8

    q, k, v = (t.detach().to(torch.bfloat16) for t in _inputs(6))

    def layer(q, k, v):
        return flex_attention_fp8(q, k, v, mods.softcap(5.0)) * 2

    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(layer, backend="aot_eager")(q, k, v), layer(q, k, v),
                               rtol=0, atol=0)
