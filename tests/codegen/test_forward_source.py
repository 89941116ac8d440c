"""Generating the forward kernel source: template filling, names, keys, purity, builtins only."""
import dataclasses
import re

import pytest
import torch
from triton.runtime.jit import JITFunction
import triton.language as tl

from flexfa.codegen.forward import forward_kernel
from flexfa.codegen.spec import KernelSpec
from flexfa.codegen.template import fill
from flexfa.frontend import trace

SPEC = KernelSpec(dtype="bf16", head_dim=128, head_dim_v=128, block_m=64, block_n=32,
                  num_warps=4, num_stages=2, has_block_mask=True, has_full_blocks=True,
                  sparse_q=128, sparse_kv=128, even_l=False, even_s=True, return_lse=True,
                  gqa_group=2, input_precision="ieee", target="interpret")


def _mods(bias_shape=(4,)):
    bias = torch.randn(bias_shape)
    doc = torch.zeros(64, dtype=torch.int32)
    score = trace(lambda s, b, h, q, kv: s + bias[h % 4])
    mask = trace(lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv))
    return score, mask


def test_fill_checks_hooks_and_indents_blocks():
    text = "def f():\n    {{BODY}}\n    return {{NAME}}\n"
    assert fill(text, BODY="a = 1\nb = 2", NAME="b") == "def f():\n    a = 1\n    b = 2\n    return b\n"
    with pytest.raises(AssertionError, match="without values"):
        fill(text, BODY="")
    with pytest.raises(AssertionError, match="does not have"):
        fill(text, BODY="", NAME="", EXTRA="")


def test_kernel_name_is_readable_and_keyed_by_structure_not_values():
    score, mask = _mods()
    generated = forward_kernel(SPEC, score, mask)
    assert re.fullmatch(r"flexfa_fwd_d128_bf16_[0-9a-f]{12}", generated.name)
    assert f"def {generated.name}(" in generated.source
    same_structure = forward_kernel(SPEC, *_mods())  # new tensors, same shapes
    assert same_structure.key == generated.key and same_structure.source == generated.source
    assert forward_kernel(SPEC, *_mods((5,))).key != generated.key  # buffer shape
    assert forward_kernel(dataclasses.replace(SPEC, even_s=False), score, mask).key != generated.key
    assert forward_kernel(SPEC, None, mask).key != generated.key


def test_generated_source_calls_only_triton_builtins():
    """triton.language's own @jit helpers (tl.max, tl.zeros, ...) are decorated in one mode per
    process; generated kernels must run interpreted and compiled side by side."""
    score, mask = _mods()
    source = forward_kernel(SPEC, score, mask).source
    used = set(re.findall(r"\btl\.(\w+)\(", source))
    assert used, "no tl calls found"
    jitted = [name for name in used if isinstance(getattr(tl, name, None), JITFunction)
              or type(getattr(tl, name, None)).__name__ == "InterpretedFunction"]
    assert not jitted, f"generated source calls triton.language @jit functions {jitted}"


def test_score_mod_without_tile_dependence_is_broadcast():
    score = trace(lambda s, b, h, q, kv: s * 0.0 + h)  # simplification may drop s
    mask = trace(lambda b, h, q, kv: h == 0)
    source = forward_kernel(SPEC, score, mask).source
    assert "mask_mod_out = tl.full([BLOCK_M, BLOCK_N], 1, tl.int1) & (" in source
