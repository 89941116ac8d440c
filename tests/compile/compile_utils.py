"""Helpers of the torch.compile tests: inputs, one forward and backward, and the comparison
of its output and gradients with eager flexfa's."""
import torch


def make_inputs(length: int, seed: int = 0) -> list:
    """q, k, v of shape [1, 2, length, 16] that require grad."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, length, 16, generator=generator, requires_grad=True)
            for _ in range(3)]


def run_step(fn, inputs, params) -> tuple:
    """(output, gradients of ``inputs`` and ``params``) of one forward and backward."""
    out = fn(*inputs)
    out.backward(torch.ones_like(out))
    grads = [t.grad.clone() for t in (*inputs, *params)]
    for t in (*inputs, *params):
        t.grad = None
    return out.detach(), grads


def assert_same(got, want) -> None:
    """Equal outputs and gradients; the last parameter got a gradient."""
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    for index, (g, w) in enumerate(zip(got[1], want[1])):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=f"gradient {index}")
    assert want[1][-1].abs().sum() > 0
