"""Mods that are bound methods of an nn.Module (``self.alibi``) or nn.Modules themselves,
inside torch.compile(fullgraph=True): outputs and gradients (the module's parameters' included)
equal eager flexfa's, a changed Python attribute of the module is seen, no graph break. Each
test runs under this torch's Dynamo and under torch 2.11's way of handing arguments to an
assume-constant function (``as_python_constant`` only: an nn.Module is no constant there;
2.13 hands over user objects), which failed on the GPU machine's torch 2.11."""
import pytest
import torch

import flexfa
from flexfa import mods

# pytest puts this folder on sys.path (it has no __init__.py)
from compile_utils import assert_same, make_inputs, run_step


class Biased(torch.nn.Module):
    """A bound-method score_mod reading a parameter and a Python float attribute, and a
    bound-method mask_mod reading a Python int attribute (``self.window``)."""

    def __init__(self, heads: int):
        super().__init__()
        self.slopes = torch.nn.Parameter(torch.linspace(0.05, 0.2, heads))
        self.scale, self.window = 1.0, 24

    def alibi(self, score, b, h, q_idx, kv_idx):
        return score * self.scale - self.slopes[h] * (q_idx - kv_idx).abs()

    def near(self, b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= self.window

    def forward(self, q, k, v):
        mask = flexfa.create_block_mask(self.near, None, None, q.shape[2], k.shape[2],
                                        device="cpu", BLOCK_SIZE=32)
        return flexfa.flex_attention(q, k, v, self.alibi, mask) * 2


class RelativeBias(torch.nn.Module):
    """An nn.Module that is itself the score_mod."""

    def __init__(self, heads: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor([0.1, -0.2])[:heads])

    def forward(self, score, b, h, q_idx, kv_idx):
        return score + self.weight[h] * (q_idx - kv_idx)


def _constants_only(tx, fn, name, args, kwargs):
    """torch 2.11's ``invoke_and_store_as_constant``: arguments as Python constants only."""
    from torch._dynamo.source import ConstantSource

    def convert(x):
        return x.get_real_value() if x.is_tensor() else x.as_python_constant()

    result = fn(*map(convert, args), **{k: convert(v) for k, v in kwargs.items()})
    return tx.output.register_attr_or_module(result, name, source=ConstantSource(name))


@pytest.fixture(params=["dynamo", "constants_only"])
def conversion(request, monkeypatch):
    """Dynamo as installed, or with torch 2.11's conversion of an assume-constant function's
    arguments (the module it lives in from 2.11 to 2.13 at least)."""
    if request.param == "constants_only":
        from torch._dynamo.variables import functions
        if not hasattr(functions, "invoke_and_store_as_constant"):
            pytest.skip("this torch's Dynamo has no invoke_and_store_as_constant to replace")
        monkeypatch.setattr(functions, "invoke_and_store_as_constant", _constants_only)
    torch._dynamo.reset()
    yield request.param
    torch._dynamo.reset()


def test_bound_methods_equal_eager_and_see_changed_attributes(conversion):
    model = Biased(2)
    inputs = make_inputs(100, seed=7)
    explained = torch._dynamo.explain(model)(*inputs)
    assert explained.graph_break_count == 0, [r.reason[:400] for r in explained.break_reasons]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    assert_same(run_step(compiled, inputs, [model.slopes]), run_step(model, inputs, [model.slopes]))
    before = run_step(model, inputs, [model.slopes])[0]
    model.window, model.scale = 56, 0.5  # Python attributes both mods read while traced
    after = run_step(compiled, inputs, [model.slopes])
    assert (after[0] - before).abs().max() > 1e-2
    assert_same(after, run_step(model, inputs, [model.slopes]))


def test_module_as_score_mod_equals_eager_with_its_parameter_gradient(conversion):
    bias = RelativeBias(2)
    mask = flexfa.create_block_mask(mods.causal, 1, None, 72, 72, device="cpu", BLOCK_SIZE=32)

    def layer(q, k, v):
        return torch.tanh(flexfa.flex_attention(q, k, v, bias, mask))

    inputs = make_inputs(72, seed=8)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    assert_same(run_step(compiled, inputs, [bias.weight]), run_step(layer, inputs, [bias.weight]))
    with torch.no_grad():
        bias.weight.mul_(-2.0)  # the optimizer's in-place update: read fresh
    assert_same(run_step(compiled, inputs, [bias.weight]), run_step(layer, inputs, [bias.weight]))
