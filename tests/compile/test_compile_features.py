"""Attention sinks and dropout inside torch.compile(fullgraph=True): the flexfa:: operators
carry them (sinks an input with its gradient, dropout's seed an int64 tensor drawn in the
graph), so outputs and gradients equal eager flexfa's with no graph break."""
import pytest
import torch

import flexfa
from flexfa import mods
from flexfa.compiled import describe, unbound
from flexfa.errors import InputError

# pytest puts this folder on sys.path (it has no __init__.py)
from compile_utils import assert_same, make_inputs, run_step


def test_sinks_fullgraph_equal_eager_with_their_gradient():
    mask = flexfa.create_block_mask(mods.causal, 1, None, 40, 40, device="cpu", BLOCK_SIZE=32)
    bias = torch.tensor([0.1, -0.2], requires_grad=True)
    sinks = torch.tensor([0.5, -1.0], requires_grad=True)

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[h] * (q_idx - kv_idx)

    def layer(q, k, v, sinks, bias):
        return flexfa.flex_attention(q, k, v, biased, mask, sinks=sinks) * 2

    torch._dynamo.reset()
    tensors = [*make_inputs(40, seed=0), sinks, bias]
    got = run_step(torch.compile(layer, backend="aot_eager", fullgraph=True), tensors, [])
    want = run_step(layer, tensors, [])
    assert_same(got, want)  # d sinks and d bias included
    assert want[1][3].abs().min() > 0  # d sinks is there
    no_sinks = flexfa.flex_attention(*(t.detach() for t in tensors[:3]), biased, mask) * 2
    assert (no_sinks - got[0]).abs().max() > 1e-3  # the sinks change the output


def test_dropout_fullgraph_equals_eager_at_a_fixed_seed():
    def layer(q, k, v):
        return flexfa.flex_attention(q, k, v, None,
                                     dropout_p=0.3, dropout_seed=(11, 3)) + 1

    torch._dynamo.reset()
    tensors = make_inputs(48, seed=1)
    got = run_step(torch.compile(layer, backend="aot_eager", fullgraph=True), tensors, [])
    want = run_step(layer, tensors, [])
    assert_same(got, want)
    plain = flexfa.flex_attention(*(t.detach() for t in tensors)) + 1
    assert (plain - got[0]).abs().max() > 1e-2  # dropout was applied


def test_dropout_seed_drawn_in_the_graph_from_torch_generator():
    """dropout_seed=None: the graph draws the seed from torch's generator each run, as eager
    does, so torch.manual_seed reproduces eager's output and two runs differ."""
    def layer(q, k, v):
        return flexfa.flex_attention(q, k, v, dropout_p=0.5)

    torch._dynamo.reset()
    q, k, v = (t.detach() for t in make_inputs(32, seed=2))
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    torch.manual_seed(5)
    first = compiled(q, k, v)
    torch.manual_seed(5)
    torch.testing.assert_close(first, layer(q, k, v), rtol=0, atol=0)
    assert (compiled(q, k, v) - first).abs().max() > 1e-3


def test_opcheck_forward_with_sinks_and_bad_feature_inputs():
    key, *_ = describe(*unbound(None), *unbound(None), False, None)
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 16, 16, generator=generator) for _ in range(3))
    args = (q.requires_grad_(), k, v, key, None, False, [], [], [], [],
            torch.tensor([0.2, -0.4], requires_grad=True))
    torch.library.opcheck(torch.ops.flexfa.flex_attention.default, args)
    q = q.detach()
    with pytest.raises(InputError, match="dropout_seed must be an int64 tensor"):
        torch.ops.flexfa.flex_attention(q, k, v, key, None, False, [], [], [], [], None, 0.25,
                                        torch.tensor([1.0, 0.0]))
    with pytest.raises(InputError, match="sinks has shape"):
        torch.ops.flexfa.flex_attention(q, k, v, key, None, False, [], [], [], [],
                                        torch.zeros(3))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("made", ["separate_full_blocks=False", "from_kv_blocks"])
def test_gradients_through_a_mask_without_full_block_tables(backend, made):
    """A block mask without full-block tables hands the operator a list of tables holding
    Nones: its backward's gradient for that list had another structure, and torch's custom-op
    autograd failed ('Expected the return from backward to be of the same structure')."""
    if made == "from_kv_blocks":
        mask = flexfa.BlockMask.from_kv_blocks(
            torch.tensor([[[1, 2]]], dtype=torch.int32),
            torch.tensor([[[[0, 1], [0, 1]]]], dtype=torch.int32),
            BLOCK_SIZE=16, mask_mod=mods.causal, seq_lengths=(32, 32))
    else:
        mask = flexfa.create_block_mask(mods.causal, None, None, 32, 32, device="cpu",
                                        BLOCK_SIZE=16, separate_full_blocks=False)
    assert mask.full_kv_num_blocks is None

    def layer(q, k, v):
        return flexfa.flex_attention(q, k, v, block_mask=mask)

    torch._dynamo.reset()
    tensors = make_inputs(32, seed=3)
    got = run_step(torch.compile(layer, backend=backend, fullgraph=True), tensors, [])
    assert_same(got, run_step(layer, tensors, []))


def test_bad_dropout_arguments_raise_flexfa_errors_inside_compile():
    """A dropout_p Dynamo made symbolic (its second value) and out of range, or a tensor
    dropout_p / dropout_seed: formatting flexfa's message failed inside Dynamo
    (BUILD_STRING, repr() on a tensor); the messages show the value's type there."""
    q, k, v = make_inputs(16, seed=3)
    q, k, v = (t.detach() for t in (q, k, v))

    def call(q, p, seed=1):
        return flexfa.flex_attention(q, k, v, dropout_p=p, dropout_seed=seed)

    torch._dynamo.reset()
    compiled = torch.compile(call, backend="aot_eager", fullgraph=True)
    compiled(q, 0.1)
    compiled(q, 0.2)  # p is symbolic from here
    for p in (1.0, -0.2):
        with pytest.raises(InputError, match=r"dropout_p must be in \[0, 1\), got a float "
                                             r"traced by torch.compile"):
            compiled(q, p)
    with pytest.raises(flexfa.InputTypeError, match=r"dropout_p must be a float in \[0, 1\), "
                                                    r"got a Tensor traced by torch.compile"):
        compiled(q, torch.tensor(0.1))
    with pytest.raises(flexfa.InputTypeError, match=r"dropout_seed must be None, .*got a "
                                                    r"Tensor traced by torch.compile"):
        compiled(q, 0.1, torch.tensor(3))
