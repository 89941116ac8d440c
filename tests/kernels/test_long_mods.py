"""Long mods (hundreds of chained terms) generate kernels Python can compile: the renderer
names values nested deeper than MAX_INLINE_DEPTH (before, 200 terms failed with
"SyntaxError: too many nested parentheses"); a generated source that still fails is a
CodegenError naming the mods and the file."""
import re

import pytest
import torch

import flexfa
from flexfa.codegen.forward import GeneratedKernel
from flexfa.codegen.render import MAX_INLINE_DEPTH, buffer_args, render
from flexfa.errors import CodegenError
from flexfa.frontend import trace
from flexfa.runtime.kernels import load_generated
from kernels.backward_utils import check_backward
from kernels.forward_utils import make_qkv
from reference import assert_close_to_reference, reference_pair


def chained_bias(terms: int):
    bias = torch.randn(terms) * 0.05

    def chained(score, b, h, q_idx, kv_idx):
        s = score
        for i in range(terms):
            s = s + bias[(kv_idx + i) % terms]
        return s
    return chained


def nested_where(depth: int):
    def nested(score, b, h, q_idx, kv_idx):
        s = score
        for i in range(depth):  # each level reads s once: one expression, nested depth deep
            s = torch.where(q_idx - kv_idx > i % 7, s * 0.999, score + 0.001 * i)
        return s
    return nested


def _check(score_mod, L=20, S=24):
    q, k, v = make_qkv(1, 1, 1, L, S, 16)
    out = flexfa.flex_attention(q, k, v, score_mod)
    (out64, _), (eager, _) = reference_pair(q, k, v, score_mod)
    assert_close_to_reference(out, out64, eager)


@pytest.mark.parametrize("terms", [200, 1000])
def test_chained_terms_run(terms):
    _check(chained_bias(terms))


def test_nested_where_chain_runs():
    _check(nested_where(200))


def test_backward_of_a_long_chain():
    q, k, v = make_qkv(1, 1, 1, 20, 24, 16)
    check_backward(q, k, v, nested_where(200))


def _paren_depth(line: str) -> int:
    depth = deepest = 0
    for char in re.sub(r'"[^"]*"', "", line):
        depth += char == "("
        depth -= char == ")"
        deepest = max(deepest, depth)
    return deepest


def test_inlined_expressions_nest_boundedly():
    traced = trace(chained_bias(300))
    rendered = render([traced.root], buffers=[buffer_args(0, 1)])
    deepest = max(_paren_depth(line) for line in rendered.lines)
    assert deepest <= 60, deepest  # Python refuses 200
    assert MAX_INLINE_DEPTH <= 20 and len(rendered.lines) >= 300 // MAX_INLINE_DEPTH


def test_uncompilable_source_is_a_codegen_error(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXFA_CACHE_DIR", str(tmp_path))
    generated = GeneratedKernel("0" * 64, "flexfa_broken_probe", "def broken(:\n    pass\n",
                                "score_mod 'chained', mask_mod 'causal'")
    with pytest.raises(CodegenError, match=r"score_mod 'chained', mask_mod 'causal'.*"
                                           r"SyntaxError.*flexfa_broken_probe\.py") as error:
        load_generated(generated, interpret=True)
    assert isinstance(error.value.__cause__, SyntaxError)
