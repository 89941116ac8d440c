"""The Hopper (sm_90) forward template: filling ``fwd_hopper.tmpl`` and its compile checks.
The module holds the forward kernel ``<name>`` and ``<name>_combine`` (split-KV's slices
combined by their lse, launched only when a plan splits).

Same hooks, libraries and ``KernelSpec`` as the Ampere-class ``fwd.tmpl`` (with
``template="fwd_hopper"``; the module is built by ``flexfa.codegen.forward.forward_module``);
what differs is how tiles reach shared memory (host tensor descriptors, TMA), the flat
pipelined block loop and the reversed q-tile order.
"""
from __future__ import annotations

from ..frontend.trace import TracedMod
from .forward import GeneratedKernel, buffer_params, features, forward_module, module_flags
from .params import INPUT, forward_params, hopper_combine_params
from .spec import KernelSpec, spec_key
from .template import template_hash
from .versions import versions_key

HOPPER_TEMPLATE = "fwd_hopper"
HOPPER_TEMPLATES = ("fwd_hopper.tmpl", "helpers.tmpl", "common.tmpl", "fwd_common.tmpl")


def hopper_key(spec: KernelSpec, score: TracedMod | None, mask: TracedMod | None) -> str:
    return spec_key(spec, score.key if score else "-", mask.key if mask else "-",
                    versions_key(), template_hash(*HOPPER_TEMPLATES))


def kv_heads(spec: KernelSpec) -> bool:
    """K and V through descriptors over their heads (fwd_hopper.tmpl: [B * HKV, S, dim], or
    with strided q, k, v [B, HKV, S, dim]) at a ragged S, where a key tile past S would read
    another head's rows from the row views, and an inf or NaN there would reach the output
    as 0 * inf in P @ V."""
    return not spec.even_s


def hopper_kernel(spec: KernelSpec, score: TracedMod | None, mask: TracedMod | None
                  ) -> GeneratedKernel:
    """Key, name (``flexfa_fwd_hopper_d128_bf16_<hash>``) and source of the Hopper forward."""
    assert spec.template == HOPPER_TEMPLATE, f"spec is for template {spec.template!r}"
    return forward_module(spec, score, mask, hopper_key(spec, score, mask), "fwd_hopper.tmpl",
                          forward_params(True, buffer_params(score, mask), spec.strided_qkv,
                                         features(spec), kv_heads(spec)),
                          module_flags(spec.constexprs(True)),
                          others=(("DEF_COMBINE", "combine",
                                   hopper_combine_params(features(spec))),))


def combine_constexprs(spec: KernelSpec) -> dict[str, object]:
    """The constexpr arguments of the module's split-KV combine kernel."""
    names = hopper_combine_params(features(spec)).constexpr_names
    return {n: v for n, v in spec.constexprs(False).items() if n in names}


def hopper_signature(spec: KernelSpec, score: TracedMod | None, mask: TracedMod | None,
                     combine: bool = False) -> tuple[dict[str, str], dict[str, object]]:
    """(signature, constexprs) of the Hopper forward (or its split-KV combine kernel), for
    ``triton.compile(ASTSource(...))``."""
    if combine:
        constexprs = combine_constexprs(spec)
        return (hopper_combine_params(features(spec)).signature(constexprs, {INPUT: spec.dtype}),
                constexprs)
    constexprs = spec.constexprs(score is not None)
    params = forward_params(True, buffer_params(score, mask), spec.strided_qkv, features(spec),
                            kv_heads(spec))
    return params.signature(constexprs, {INPUT: spec.dtype}), constexprs
