"""flex_attention under autograd's other modes, under the interpreter: saved-tensor hooks
(activation offloading), checkpointing that recomputes without restoring the RNG, forward-mode
AD and torch.func's transforms. Each either gives the gradients of one consistent forward or
raises an InputError naming the limitation, never a silently wrong result."""
import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.utils.checkpoint import checkpoint

import flexfa
from flexfa.errors import InputError
from flexfa.reference import attention_reference
from forward_utils import make_qkv

B, H, L, E = 1, 2, 32, 16


def _relative(table):
    def relative(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + L - 1]
    return relative


def _reference_grads(table, q, k, v, weights):
    """Float64 gradients (dq, dtable) of (out * weights).sum() with ``table``'s values."""
    t = table.detach().double().requires_grad_()
    q64 = q.detach().double().requires_grad_()
    out = attention_reference(q64, k.double(), v.double(), score_mod=_relative(t))
    (out * weights.double()).sum().backward()
    return q64.grad, t.grad


def _close(got, want):
    return ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-4


# (save_on_cpu keeps a CPU tensor itself: the next test)
@pytest.mark.parametrize("hooks, device", [
    ("clone", "cpu"), pytest.param("clone", "cuda", marks=pytest.mark.gpu),
    pytest.param("save_on_cpu", "cuda", marks=pytest.mark.gpu)])
def test_saved_tensor_hooks_that_copy_give_the_forwards_gradients(hooks, device):
    """Under hooks that copy (save_on_cpu offloading of a GPU tensor) the backward reads the
    saved copies: the call's own captured tensor, edited in place after the forward (an
    optimizer step), gave dq 0.35 and the bias gradient 0.27 off before, since the backward
    read it."""
    q, k, v = make_qkv(B, H, H, L, L, E, device=device)
    table = torch.nn.Parameter(torch.randn(H, 2 * L - 1, device=device) * 0.5)
    weights = torch.randn(B, H, L, E, device=device)
    want_q, want_table = _reference_grads(table, q, k, v, weights)
    q.requires_grad_()
    saving = (torch.autograd.graph.save_on_cpu() if hooks == "save_on_cpu" else
              torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t))
    with saving:
        out = flexfa.flex_attention(q, k, v, score_mod=_relative(table))
    with torch.no_grad():
        table.mul_(0.5)
    (out * weights).sum().backward()
    assert _close(q.grad, want_q) and _close(table.grad, want_table)


def test_saved_tensor_hooks_that_keep_the_tensor_refuse_an_edit():
    """A hook that keeps the tensor itself (save_on_cpu of a CPU tensor): torch checks no
    version there, so flexfa does: an InputError instead of the gradients of new values."""
    q, k, v = make_qkv(B, H, H, L, L, E)
    table = torch.nn.Parameter(torch.randn(H, 2 * L - 1) * 0.5)
    q.requires_grad_()
    with torch.autograd.graph.save_on_cpu():
        out = flexfa.flex_attention(q, k, v, score_mod=_relative(table))
    with torch.no_grad():
        table.mul_(0.5)
    with pytest.raises(InputError, match="score_mod captures .* edited in place"):
        out.sum().backward()


def test_checkpointing_without_the_rng_state_uses_one_dropout_mask():
    """Non-reentrant checkpointing with preserve_rng_state=False recomputes out and lse with
    a new dropout seed: the backward drew its mask from the first forward's seed (ctx.call)
    and its delta from the recomputed out, so dq and dk matched neither mask (0.3-1.4 off).
    The seed is a saved tensor now: every gradient is the recomputation's, as the reentrant
    mode (and torch's own dropout) give."""
    p = 0.3
    q0, k0, v0 = make_qkv(B, H, H, L, L, E)
    weights = torch.randn(B, H, L, E)
    results = {}
    for reentrant in (True, False):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        torch.manual_seed(7)
        out = checkpoint(lambda q, k, v: flexfa.flex_attention(q, k, v, dropout_p=p), q, k, v,
                         use_reentrant=reentrant, preserve_rng_state=False)
        (out * weights).sum().backward()
        results[reentrant] = (q.grad, k.grad, v.grad)
    torch.manual_seed(7)
    torch.randint(0, 2 ** 63 - 1, (2,))  # the forward's draw; the recomputation's comes next
    seed, offset = torch.randint(0, 2 ** 63 - 1, (2,)).tolist()
    keep = flexfa.dropout_mask((seed, offset % 2 ** 32), B, H, L, L, p)
    q, k, v = (t.double().requires_grad_() for t in (q0, k0, v0))
    (attention_reference(q, k, v, dropout_mask=keep, dropout_p=p)
     * weights.double()).sum().backward()
    for reentrant, grads in results.items():
        for name, got, want in zip("qkv", grads, (q.grad, k.grad, v.grad)):
            assert _close(got, want), (reentrant, name)


@pytest.mark.parametrize("dual", ["query", "table"])
def test_forward_mode_ad_is_refused(dual):
    """A dual tensor's tangent was dropped silently where nothing required grad (the output
    had no tangent); torch's flex_attention raises there too."""
    q, k, v = make_qkv(B, H, H, L, L, E)
    table = torch.randn(H, 2 * L - 1)
    with fwAD.dual_level():
        if dual == "query":
            q = fwAD.make_dual(q, torch.randn_like(q))
        else:
            table = fwAD.make_dual(table, torch.randn_like(table))
        with pytest.raises(InputError, match="forward-mode AD"):
            flexfa.flex_attention(q, k, v, score_mod=_relative(table))
        with pytest.raises(InputError, match="forward-mode AD"):
            flexfa.flex_decode(q[:, :, :4], k, v, score_mod=_relative(table))
    # (no dual level open: the same call runs)
    assert flexfa.flex_attention(q, k, v, score_mod=_relative(table)).shape == (B, H, L, E)


def test_torch_func_transforms_are_refused_before_any_work():
    """torch.func's wrapped tensors and the older vmap of batched gradients have no storage:
    the calls failed deep inside the host code with torch's storage errors."""
    q, k, v = make_qkv(B, H, H, L, L, E)
    transforms = {
        "grad": lambda: torch.func.grad(lambda x: flexfa.flex_attention(x, k, v).sum())(q),
        "vmap": lambda: torch.func.vmap(lambda x: flexfa.flex_attention(x, k, v))(q[None]),
        "decode vmap": lambda: torch.func.vmap(lambda x: flexfa.flex_decode(x, k, v))(
            q[None, :, :, :4]),
    }
    for name, run in transforms.items():
        with pytest.raises(InputError, match="torch.func's transforms"):
            run()
    q.requires_grad_()
    out = flexfa.flex_attention(q, k, v)
    with pytest.raises(InputError, match="torch.func's transforms"):
        torch.autograd.grad(out, q, torch.randn(3, *out.shape), is_grads_batched=True)


def test_compiled_autograd_over_an_eager_forward():
    """Compiled autograd has Dynamo trace the backward of an eager call (or of a graph break
    such as varlen_attention's): Dynamo went down into the kernel launch and failed inside
    Triton (a fake uint64 tensor). The kernels run outside its graph now, and the gradients
    are the eager backward's."""
    from torch._dynamo import compiled_autograd
    table = (0.1 * torch.randn(H, 2 * L - 1)).requires_grad_()
    sinks = torch.tensor([0.5, -1.0], requires_grad=True)
    q, k, v = (t.requires_grad_() for t in make_qkv(B, H, H, L, L, E, seed=41))
    weights = torch.randn(B, H, L, E)

    def grads(compiled: bool):
        for t in (q, k, v, table, sinks):
            t.grad = None
        out = flexfa.flex_attention(q, k, v, _relative(table), sinks=sinks)
        torch._dynamo.reset()
        if compiled:
            with compiled_autograd._enable(torch.compile(backend="eager")):
                (out * weights).sum().backward()
        else:
            (out * weights).sum().backward()
        return [t.grad.clone() for t in (q, k, v, table, sinks)]

    for got, want in zip(grads(True), grads(False)):
        torch.testing.assert_close(got, want)
