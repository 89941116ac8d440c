"""Kernel parameters described once (flexfa/codegen/params.py) and flags emitted once per
generated module: the generated ``def``s, ``GeneratedKernel.params``, the compile-only
signatures and the module flags all come from the description, and a launch whose
constexprs differ from the module's flags fails at compile time instead of running helpers
that read other values."""
import ast
import dataclasses
import re

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flexfa.codegen.backward import BackwardSpec, backward_flags, backward_kernel
from flexfa.codegen.forward import LAUNCH_FLAGS, forward_kernel, forward_signature
from flexfa.codegen.fp8 import (FP8KernelSpec, fp8_forward_kernel, fp8_forward_signature,
                               quantize_kernel)
from flexfa.codegen.hopper import HOPPER_TEMPLATE, hopper_kernel, hopper_signature
from flexfa.codegen.params import Param, TENSOR, KernelParams, constexprs, ints
from flexfa.codegen.spec import KernelSpec
from flexfa.codegen.template import load_template
from flexfa.frontend import trace
from flexfa.runtime.cache import get_module

SPEC = KernelSpec(dtype="bf16", head_dim=64, head_dim_v=32, block_m=32, block_n=16,
                  num_warps=4, num_stages=1, has_block_mask=True, has_full_blocks=True,
                  sparse_q=64, sparse_kv=64, even_l=False, even_s=True, return_lse=True,
                  gqa_group=2, input_precision="ieee", target="interpret")
FP8_SPEC = FP8KernelSpec(out_dtype="bf16", head_dim=64, head_dim_v=64, block_m=32, block_n=32,
                         num_warps=4, num_stages=1, has_block_mask=False, has_full_blocks=False,
                         sparse_q=32, sparse_kv=32, scale_q=64, scale_kv=64, even_l=False,
                         even_s=False, return_lse=True, gqa_group=1, target="interpret")
BWD_SPEC = BackwardSpec(dtype="fp16", head_dim=64, head_dim_v=64, block_m1=16, block_n1=32,
                        block_m2=32, block_n2=16, num_warps=4, num_stages=1,
                        has_block_mask=True, has_full_blocks=False, sparse_q=64, sparse_kv=64,
                        even_l1=True, even_s1=False, even_l2=False, even_s2=True, gqa_group=1,
                        deterministic=True, has_dlse=True, input_precision="ieee",
                        target="interpret")


def _mods():
    bias = torch.randn(4, 8)  # float32 and int32 captured tensors, ranks 2 and 1
    doc = torch.zeros(64, dtype=torch.int32)
    score = trace(lambda s, b, h, q, kv: s + bias[h % 4, q % 8])
    mask = trace(lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv))
    return score, mask


def _defs(source: str) -> dict[str, ast.FunctionDef]:
    return {node.name: node for node in ast.parse(source).body
            if isinstance(node, ast.FunctionDef)}


def _generated() -> dict:
    score, mask = _mods()
    return {"fwd": forward_kernel(SPEC, score, mask),
            "fwd_hopper": hopper_kernel(dataclasses.replace(SPEC, template=HOPPER_TEMPLATE),
                                        score, mask),
            "fwd_fp8": fp8_forward_kernel(FP8_SPEC, score, None), "quantize": quantize_kernel(),
            "bwd": backward_kernel(BWD_SPEC, None, None, mask)}


def test_every_kernel_def_is_its_description():
    for generated in _generated().values():
        defs = _defs(generated.source)
        assert generated.kernels, generated.name
        for function, params in generated.kernels:
            args = defs[function].args.args
            assert [a.arg for a in args] == [*params.names, *params.constexpr_names]
            constexpr = [a.arg for a in args if a.annotation is not None
                         and ast.unparse(a.annotation) == "tl.constexpr"]
            assert constexpr == list(params.constexpr_names), function


def test_generated_kernel_names_its_arguments():
    score, mask = _mods()
    generated = forward_kernel(SPEC, score, mask)
    assert generated.params[:6] == ("Q", "K", "V", "OUT", "LSE", "MAXS")
    assert generated.params[-12:] == (
        "HQ", "L", "S", "sm_scale", "sbuf0_ptr", "sbuf0_stride0", "sbuf0_stride1",
        "sbuf0_size0", "sbuf0_size1", "mbuf0_ptr", "mbuf0_stride0", "mbuf0_size0")
    assert set(generated.constexpr_names) == set(SPEC.constexprs(True))
    backward = backward_kernel(BWD_SPEC, None, None, mask)
    assert {f for f, _ in backward.kernels} == {
        f"{backward.name}_dq", f"{backward.name}_dkdv", "flexfa_bwd_delta"}
    assert set(backward.kernel_params(f"{backward.name}_dq").constexpr_names) == set(
        BWD_SPEC.dq_constexprs(True, False))
    assert set(backward.kernel_params(f"{backward.name}_dkdv").constexpr_names) == set(
        BWD_SPEC.dkdv_constexprs(True))
    with pytest.raises(AssertionError, match="has no kernel"):
        backward.params  # several kernels: name one


def test_signatures_come_from_the_description():
    score, mask = _mods()
    signature, constexprs = forward_signature(SPEC, score, mask)
    params = forward_kernel(SPEC, score, mask).kernel_params()
    assert list(signature) == [*params.names, *params.constexpr_names]
    assert (signature["Q"], signature["LSE"], signature["KV_INDICES"], signature["sm_scale"],
            signature["sbuf0_ptr"], signature["mbuf0_ptr"], signature["BLOCK_M"]) == (
        "*bf16", "*fp32", "*i32", "fp32", "*fp32", "*i32", "constexpr")
    hopper_spec = dataclasses.replace(SPEC, template=HOPPER_TEMPLATE)
    signature, _ = hopper_signature(hopper_spec, score, mask)
    assert signature["Q_DESC"] == "tensordesc<bf16[32, 64]>"
    assert signature["V_DESC"] == "tensordesc<bf16[16, 32]>"
    signature, constexprs = fp8_forward_signature(FP8_SPEC, score, None)
    assert (signature["Q"], signature["OUT"]) == ("*fp8e4nv", "*bf16")
    assert set(constexprs) == set(fp8_forward_kernel(FP8_SPEC, score, None).constexpr_names)


def test_a_description_checks_itself():
    with pytest.raises(AssertionError, match="constexpr parameters must come last"):
        KernelParams((constexprs("A"), ints("n")))
    with pytest.raises(AssertionError, match="named twice"):
        KernelParams((ints("n", "n"),))
    with pytest.raises(AssertionError, match="needs"):
        Param("X", TENSOR)
    with pytest.raises(AssertionError, match="are not the kernel's"):
        KernelParams((ints("n"), constexprs("A"))).signature({"B": 1})


def _header(template: str) -> str:
    return "\n".join(line for line in load_template(template).splitlines()
                     if line.startswith("#"))


def _documented(templates: list[str], flag: str) -> list[str]:
    """The templates whose header documents ``flag`` in a flag list (``#   A, B    text``)."""
    pattern = re.compile(rf"^#\s{{3}}[A-Z0-9_, ]*\b{flag}\b[A-Z0-9_, ]*(\s{{2,}}|$)", re.M)
    return [t for t in templates if pattern.search(_header(t))]


@pytest.mark.parametrize("module", ["fwd", "fwd_hopper", "fwd_fp8", "bwd"])
def test_every_module_flag_is_documented_once_at_the_top_of_a_template(module):
    generated = _generated()[module]
    flags = re.findall(r"^(\w+) = tl\.constexpr\(", generated.source, re.M)
    assert len(flags) >= 15
    templates = re.findall(r"^# Template: flexfa/codegen/templates/(\w+\.tmpl)",
                           generated.source, re.M)
    assert "common.tmpl" in templates
    for flag in [*flags, *(LAUNCH_FLAGS if module.startswith("fwd") else ())]:
        assert len(_documented(templates, flag)) == 1, (flag, _documented(templates, flag))


def test_helpers_read_module_flags_instead_of_taking_them():
    """Only what varies between calls (mask or not, bounds checks, the walked tile and the
    visitor of a walk) stays a constexpr parameter of a helper function (before: 12 to 24);
    the kernels' flags are the module's."""
    for generated in _generated().values():
        kernels = {f for f, _ in generated.kernels}
        for name, node in _defs(generated.source).items():
            flags = [a.arg for a in node.args.args if a.annotation is not None]
            if name not in kernels:
                assert len(flags) <= 6, (name, flags)


def test_backward_flags_name_each_kernels_tiles():
    flags = backward_flags(BWD_SPEC, None)
    assert (flags["BLOCK_M1"], flags["BLOCK_N1"], flags["BLOCK_M2"], flags["BLOCK_N2"]) == (
        16, 32, 32, 16)
    assert (flags["EVEN_L1"], flags["EVEN_S1"], flags["EVEN_L2"], flags["EVEN_S2"]) == (
        True, False, False, True)
    assert "BLOCK_M" not in flags and flags["DETERMINISTIC"] is True


def _launch_forward(module, name, constexprs):
    q = torch.zeros(1, 2, 64, 64, dtype=torch.bfloat16)
    k = v = torch.zeros(1, 1, 64, 64, dtype=torch.bfloat16)
    v = v[..., :32]
    out, lse = torch.zeros(1, 2, 64, 32, dtype=torch.bfloat16), torch.zeros(1, 2, 64)
    table = torch.zeros(1, 1, 1, 1, dtype=torch.int32)
    tables = [table] * 4 + [0] * 14
    getattr(module, name)[(2, 2)](q, k, v, out, lse, lse, *q.stride(), *k.stride(), *v.stride(),
                                  *out.stride(), *tables, 2, 64, 64, 0.125, **constexprs)


def test_constexprs_other_than_the_module_flags_fail_under_the_interpreter():
    spec = dataclasses.replace(SPEC, has_block_mask=False, has_full_blocks=False, sparse_q=32,
                               sparse_kv=16)
    generated = forward_kernel(spec, None, None)
    module = get_module(generated.name, generated.key, True, lambda: generated.source)
    _launch_forward(module, generated.name, spec.constexprs(False))  # the module's own: runs
    wrong = dict(spec.constexprs(False), BLOCK_N=32)
    with pytest.raises(Exception, match="differ from the flags"):
        _launch_forward(module, generated.name, wrong)


def test_constexprs_other_than_the_module_flags_do_not_compile():
    spec = dataclasses.replace(SPEC, target="cuda:80")
    score, mask = _mods()
    generated = forward_kernel(spec, score, mask)
    module = get_module(generated.name, generated.key, False, lambda: generated.source)
    signature, constexprs = forward_signature(spec, score, mask)
    constexprs["EVEN_S"] = not constexprs["EVEN_S"]
    with pytest.raises(Exception, match="differ from the flags"):
        triton.compile(ASTSource(getattr(module, generated.name), signature, constexprs),
                       target=GPUTarget("cuda", 80, 32), options=spec.launch_options())
