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
