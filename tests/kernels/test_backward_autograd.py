"""flex_attention inside torch's autograd machinery under the interpreter: activation
checkpointing (which recomputes the forward in the backward and hands each saved tensor out
once)."""
import pytest
import torch
from torch.utils.checkpoint import checkpoint

import flexfa
from forward_utils import make_qkv

B, H, L, S, E = 1, 2, 40, 56, 16


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_gives_the_plain_gradients(use_reentrant):
    """Non-reentrant checkpointing (torch's recommended mode) unpacks each saved tensor at
    most once: a backward that read ctx.saved_tensors twice raised CheckpointError. The
    recomputed forward must also draw the same dropout seed (checkpointing restores the RNG
    state), so the gradients are the plain run's, bit for bit."""
    bias = torch.randn(H, L, S, requires_grad=True)
    sinks = torch.randn(H, requires_grad=True)

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx, kv_idx]

    def attention(q, k, v):
        return flexfa.flex_attention(q, k, v, biased, sinks=sinks, dropout_p=0.3)

    q, k, v = (t.requires_grad_(True) for t in make_qkv(B, H, H, L, S, E))
    grad_out = torch.randn(B, H, L, E)
    inputs = (q, k, v, bias, sinks)
    torch.manual_seed(5)
    plain = torch.autograd.grad(attention(q, k, v), inputs, grad_out)
    torch.manual_seed(5)
    # (.backward: the reentrant mode refuses autograd.grad)
    checkpoint(attention, q, k, v, use_reentrant=use_reentrant).backward(grad_out)
    checkpointed = [t.grad for t in inputs]
    for name, want, got in zip(("dq", "dk", "dv", "dbias", "dsinks"), plain, checkpointed):
        assert torch.equal(want, got), name
