"""Mods that are bound methods of an nn.Module (``self.alibi``) or nn.Modules themselves,
inside torch.compile(fullgraph=True), under torch 2.11's way of handing arguments to an
assume-constant function (``as_python_constant`` only: an nn.Module is no constant there; 2.13
hands over user objects), which failed on the GPU machine's torch 2.11. The cases are
examples/compile_probe.py's (tests/test_examples.py runs it under this torch's own Dynamo):
no graph break, outputs and gradients (the module's parameters' included) equal eager flexfa's,
and after a Python attribute (``self.window``) or a parameter changes, they still do."""
import importlib.util
import pathlib

import pytest
import torch

import flexfa
from flexfa.errors import InputError

PROBE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "compile_probe.py"


def _probe():
    spec = importlib.util.spec_from_file_location("example_compile_probe", PROBE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _constants_only(tx, fn, name, args, kwargs):
    """torch 2.11's ``invoke_and_store_as_constant``: arguments as Python constants only."""
    from torch._dynamo.source import ConstantSource

    def convert(x):
        return x.get_real_value() if x.is_tensor() else x.as_python_constant()

    result = fn(*map(convert, args), **{k: convert(v) for k, v in kwargs.items()})
    return tx.output.register_attr_or_module(result, name, source=ConstantSource(name))


@pytest.mark.parametrize("case", ["bound_methods", "module_mod"])
def test_module_mods_compile_whole_with_torch_2_11_conversion(case, monkeypatch):
    from torch._dynamo.variables import functions  # where it lives from 2.11 to 2.13 at least
    if not hasattr(functions, "invoke_and_store_as_constant"):
        pytest.skip("this torch's Dynamo has no invoke_and_store_as_constant to replace")
    monkeypatch.setattr(functions, "invoke_and_store_as_constant", _constants_only)
    probe = _probe()
    try:
        rows = probe.probe(getattr(probe, case), 2, 100, 16, torch.device("cpu"),
                           torch.float32, "aot_eager", 1e-5)
    finally:
        torch._dynamo.reset()
    assert [check for _, check, _, _ in rows] == ["graph breaks", "equal to eager",
                                                  "after a change"], rows
    assert all(passed for _, _, passed, _ in rows), rows


class _Tanh(torch.nn.Module):
    def forward(self, x):
        return torch.tanh(x)


class _ParametrizedBias(torch.nn.Module):
    def __init__(self, in_forward: bool):
        super().__init__()
        self.bias = torch.nn.Parameter(0.5 * torch.randn(2, 63))
        self.in_forward = in_forward

    def score(self, s, b, h, i, j):
        return s + self.bias[h, i - j + 31]

    def forward(self, q, k, v):
        if not self.in_forward:
            return flexfa.flex_attention(q, k, v, self.score)
        bias = self.bias  # (a parametrized read: computed once, in the graph)

        def score(s, b, h, i, j):
            return s + bias[h, i - j + 31]
        return flexfa.flex_attention(q, k, v, score)


def test_a_parametrized_parameter_is_named_with_the_way_out():
    """A parametrized attribute (torch.nn.utils.parametrize) computes a new tensor on each
    read, which no path from the mod reaches: the refusal said to capture it in a module
    attribute (it is one); it names the parametrization now, and its way out (read it in
    forward, define the mod there) compiles with the eager gradients."""
    from torch.nn.utils import parametrize
    from compile_utils import assert_same, make_inputs, run_step
    for in_forward in (False, True):
        layer = _ParametrizedBias(in_forward)
        parametrize.register_parametrization(layer, "bias", _Tanh())
        torch._dynamo.reset()
        compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
        inputs = make_inputs(32, seed=8)
        if not in_forward:
            with pytest.raises(InputError, match=r"bias is parametrized .*read it in forward"):
                compiled(*inputs)
            continue
        original = layer.parametrizations.bias.original
        assert_same(run_step(compiled, inputs, [original]), run_step(layer, inputs, [original]))
