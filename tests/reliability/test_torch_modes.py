"""flexfa under torch's global modes and with tensor subclasses: each call either runs as
with plain tensors or raises a flexfa error naming the limit, never a crash inside Triton or
a silently ignored setting (the subclass and modes audit of the forty-first session)."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.two_tensor import TwoTensor

import flexfa
from flexfa import mods
from flexfa.errors import InputError, InputTypeError
from .inputs import qkv


def test_wrapper_subclasses_are_refused_naming_the_argument():
    """A wrapper subclass (TwoTensor here; DTensor and MaskedTensor alike) has no storage of
    its own: the kernels failed inside Triton's interpreter ("data pointer on an invalid
    python storage")."""
    q, k, v = qkv()
    with pytest.raises(InputTypeError, match="query is a TwoTensor"):
        flexfa.flex_attention(TwoTensor(q, q), TwoTensor(k, k), TwoTensor(v, v))
    bias = TwoTensor(torch.zeros(56), torch.zeros(56))
    with pytest.raises(InputTypeError, match="captured tensor .* is a TwoTensor"):
        flexfa.flex_attention(q, k, v, lambda s, b, h, i, j: s + bias[j])


def test_fake_tensors_and_fake_mode_are_refused():
    """FakeTensorMode (shape inference without data): flex_attention failed inside Triton
    ("Cannot copy out of meta tensor"), create_block_mask with a message blaming captured
    tensors that the mask_mod did not have."""
    q = qkv()[0]
    with FakeTensorMode():
        fake = torch.randn(1, 2, 40, 16)
        with pytest.raises(InputTypeError, match="query is a FakeTensor"):
            flexfa.flex_attention(fake, fake, fake)
        with pytest.raises(InputError, match="cannot run under FakeTensorMode"):
            flexfa.create_block_mask(mods.causal, 1, 1, 40, 40, device="cpu")
    with pytest.raises(InputTypeError, match="query is a FakeTensor"):
        flexfa.flex_attention(*(FakeTensorMode().from_tensor(q) for _ in range(3)))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_deterministic_algorithms_take_the_deterministic_path(device, monkeypatch):
    """torch.use_deterministic_algorithms(True) was ignored: the captured tensor's gradient
    came from the float32 atomics (on a GPU their order varies between runs). Under the flag
    every call takes kernel_options deterministic's path, a call cached before it too (and
    on a GPU nothing flexfa runs meets torch's refusal of nondeterministic operations). The
    path is read from the backward's call (on a GPU the two paths' results may be equal:
    the forty-second session's H100 run gave bit-equal bias gradients, and the atomics' are
    not reproducible, so results alone cannot tell them apart there)."""
    import flexfa.autograd as autograd_module
    taken = []
    backward = autograd_module.run_backward

    def spy(*args, **kwargs):
        taken.append(args[7].options.deterministic)
        return backward(*args, **kwargs)
    monkeypatch.setattr(autograd_module, "run_backward", spy)
    q, k, v = (t.to(device).requires_grad_() for t in qkv(B=2, L=64, S=64))
    bias = (torch.linspace(-1, 1, 2 * 128, device=device).view(2, 128) * 0.3).requires_grad_()

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx + 64] * torch.tanh(score)

    def grads(**kwargs):
        out = flexfa.flex_attention(q, k, v, biased, **kwargs)
        return torch.autograd.grad(out.square().sum(), (q, k, v, bias))

    grads()  # (leaves the call cached)
    deterministic = grads(kernel_options={"deterministic": True})
    assert taken == [False, True]
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for got in (grads(), grads(kernel_options={"deterministic": False})):
            for name, g, want in zip(("dq", "dk", "dv", "dbias"), got, deterministic):
                assert torch.equal(g, want), name
    finally:
        torch.use_deterministic_algorithms(was)
    assert taken == [False, True, True, True]
    grads()
    assert taken[-1] is False


def test_another_default_device():
    """Internal tensors were made on torch's default device, not the call's: under a meta
    default (standing in for a CUDA one with CPU inputs) create_block_mask(device="cpu")
    failed, and so did ALiBi slopes for the CPU and a dropout seed."""
    q, k, v = qkv(L=64, S=64)
    torch.set_default_device("meta")
    try:
        mask = flexfa.create_block_mask(mods.causal, 1, 1, 64, 64, device="cpu",
                                        BLOCK_SIZE=32)
        alibi = mods.alibi(2, device="cpu")
        out = flexfa.flex_attention(q, k, v, alibi, block_mask=mask, dropout_p=0.1,
                                    dropout_seed=3)
    finally:
        torch.set_default_device(None)
    assert mask.kv_num_blocks.device.type == "cpu" and alibi.slopes.device.type == "cpu"
    want = flexfa.flex_attention(q, k, v, mods.alibi(2), dropout_p=0.1, dropout_seed=3,
                                 block_mask=flexfa.create_block_mask(
                                     mods.causal, 1, 1, 64, 64, device="cpu", BLOCK_SIZE=32))
    assert torch.equal(out, want)


def test_an_operator_call_with_mods_of_another_process_says_so():
    """A torch.export program saved and loaded in a new process names mods that process never
    registered: the error blamed 4096 mods compiled since."""
    from flexfa.ops import mods_entry
    with pytest.raises(InputError, match="traced in another process"):
        mods_entry("0123456789abcdef0123456789abcdef")


def test_a_captured_tensor_made_in_inference_mode():
    """A score_mod reading a table made under torch.inference_mode (needing no gradient) in a
    call that needs one: the forward saved every captured tensor for the backward, which
    torch refuses for inference tensors ("cannot be saved for backward")."""
    from flexfa.reference import attention_reference
    q, k, v = qkv()
    with torch.inference_mode():
        table = torch.linspace(-1, 1, 56)

    def biased(score, b, h, q_idx, kv_idx):
        return score + table[kv_idx]

    q.requires_grad_()
    (dq,) = torch.autograd.grad(flexfa.flex_attention(q, k, v, biased).square().sum(), q)
    q64 = q.detach().double().requires_grad_()
    clone = table.clone()
    attention_reference(q64, k.double(), v.double(),
                        lambda s, b, h, i, j: s + clone.double()[j]).square().sum().backward()
    torch.testing.assert_close(dq.double(), q64.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mod", ["score_mod", "mask_mod"])
def test_an_inference_tensor_edited_before_the_backward_does_not_change_the_gradients(mod):
    """Regression (an audit's find): a captured tensor made under inference_mode has no
    version counter, so editing it in place inside inference_mode between the forward and
    the backward went unseen and the backward read the new values (another forward's
    gradients). The backward reads a copy the forward kept: the gradients of the forward."""
    q, k, v = qkv()
    with torch.inference_mode():
        table = torch.linspace(-1, 1, 56)
        docs = torch.tensor([0] * 20 + [1] * 36)

    def biased(score, b, h, q_idx, kv_idx):
        return score + table[kv_idx]

    def same_document(b, h, q_idx, kv_idx):
        return docs[q_idx] == docs[kv_idx]
    score_mod, mask_mod = (biased, None) if mod == "score_mod" else (None, same_document)
    grad_out = torch.randn(1, 2, 40, 16, generator=torch.Generator().manual_seed(1))

    def gradients(edit):
        inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        mask = None if mask_mod is None else flexfa.create_block_mask(
            mask_mod, None, None, 40, 56, device="cpu", BLOCK_SIZE=16)
        out = flexfa.flex_attention(*inputs, score_mod, mask)
        with torch.inference_mode():
            saved = (table.clone(), docs.clone())
            edit()
        grads = torch.autograd.grad((out * grad_out).sum(), inputs)
        with torch.inference_mode():
            table.copy_(saved[0])
            docs.copy_(saved[1])
        return grads

    unedited = gradients(lambda: None)
    edited = gradients(lambda: table.add_(5.0).mul_(3.0) if mod == "score_mod"
                       else docs.zero_())
    for a, b in zip(unedited, edited):
        assert torch.equal(a, b)
