"""kernel_options inside torch.compile: the compiled graph runs the options the call has
now, however the dict changed since it was compiled (Dynamo guards on its keys and values)."""
import pytest
import torch

import flexfa
import flexfa.ops
from flexfa.errors import InputError
from flexfa.runtime.options import parse_kernel_options

OPTIONS = {"BACKEND": "AMPERE"}  # a global dict the compiled code reads


def _layer(q, k, v):
    return flexfa.flex_attention(q, k, v, kernel_options=OPTIONS)


def _given(q, k, v, options):
    return flexfa.flex_attention(q, k, v, kernel_options=options)


@pytest.fixture
def ran(monkeypatch):
    """The parsed kernel_options of each forward the operator runs."""
    seen, real = [], flexfa.ops.run_forward

    def run_forward(query, key, value, call, *args, **kwargs):
        seen.append(call.options)
        return real(query, key, value, call, *args, **kwargs)
    monkeypatch.setattr(flexfa.ops, "run_forward", run_forward)
    return seen


def _inputs():
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, 40, 16, generator=generator).half() for _ in range(3)]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_key_added_to_the_options_dict_is_not_ignored(ran, backend, monkeypatch):
    """Dynamo guarded the dict's values but not its keys: a key added after the first call
    (BLOCK_M, SPLIT_KV) or removed kept running the options of the first."""
    monkeypatch.setattr(__import__(__name__), "OPTIONS", {"BACKEND": "AMPERE"})
    torch._dynamo.reset()
    layer, q_k_v = torch.compile(_layer, backend=backend, fullgraph=True), _inputs()
    want = flexfa.flex_attention(*q_k_v)
    steps = [("BACKEND", "HOPPER"), ("BLOCK_M", 16), ("SPLIT_KV", 3), ("BLOCK_M", None)]
    for key, value in [(None, None), *steps]:
        if key is not None:
            OPTIONS.pop(key) if value is None else OPTIONS.__setitem__(key, value)
        torch.testing.assert_close(layer(*q_k_v), want, atol=2e-3, rtol=0)
        got = ran[-1]
        assert (got.backend, got.block_m, got.split_kv) == (
            OPTIONS["BACKEND"], OPTIONS.get("BLOCK_M"), OPTIONS.get("SPLIT_KV")), OPTIONS
    OPTIONS.update({"BACKEND": "HOPPER", "USE_TMA": False})  # a forced family that cannot run
    with pytest.raises(InputError, match="BACKEND='HOPPER' cannot run this call: .*USE_TMA"):
        layer(*q_k_v)


def test_options_passed_in_are_the_calls(ran):
    """A dict with one more key ran the first dict's options; an int option that changed
    (BLOCK_M 16, then 32) became symbolic and failed to compile."""
    torch._dynamo.reset()
    layer, q_k_v = torch.compile(_given, backend="eager", fullgraph=True), _inputs()
    for options in ({"BACKEND": "HOPPER"}, {"BACKEND": "HOPPER", "BLOCK_M": 16}, {"BLOCK_M": 32},
                    {"BLOCK_M": 32, "fwd_BLOCK_M": 16}, {"DS_MAX_BYTES": 2 ** 40},
                    {"DS_MAX_BYTES": 2 ** 41, "deterministic": True}, None):
        layer(*q_k_v, options)
        assert ran[-1] == parse_kernel_options(options), options
    with pytest.raises(InputError, match=r"kernel_options\[.BLOCK_M.\] = 24 is not"):
        layer(*q_k_v, {"BLOCK_M": 24})


def _from_shapes(q, k, v):
    # bools computed from the shapes: SymBools under dynamic shapes
    return flexfa.flex_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1],
                                 kernel_options={"deterministic": q.shape[2] > 40})


@pytest.mark.parametrize("dynamic", [True, None])
def test_bools_computed_from_symbolic_shapes(ran, dynamic):
    """enable_gqa and a bool option computed from the shapes are SymBools under dynamic
    shapes; they reached an assume-constant function, which Dynamo failed inside
    ("assume_constant_result argument conversion failed"). Each value compiles its graph."""
    compiled = torch.compile(_from_shapes, backend="eager", fullgraph=True, dynamic=dynamic)
    generator = torch.Generator().manual_seed(1)
    for hq, hkv, length in ((4, 2, 32), (4, 1, 32), (2, 2, 48), (4, 4, 56), (4, 2, 24)):
        q = torch.randn(1, hq, length, 16, generator=generator)
        k, v = (torch.randn(1, hkv, length, 16, generator=generator) for _ in range(2))
        out = compiled(q, k, v)
        assert ran[-1].deterministic == (length > 40)
        torch.testing.assert_close(out, _from_shapes(q, k, v))
