"""The Hopper (sm_90) forward template: filling ``fwd_hopper.tmpl`` and its compile checks.

Same hooks, libraries and ``KernelSpec`` as the Ampere-class ``fwd.tmpl`` (with
``template="fwd_hopper"``; the module is built by ``flexfa.codegen.forward.forward_module``);
what differs is how tiles reach shared memory (host tensor descriptors, TMA), the flat
pipelined block loop and the reversed q-tile order.
"""
from __future__ import annotations

from ..frontend.trace import TracedMod
from .forward import GeneratedKernel, buffer_params, features, forward_module, module_flags
from .params import INPUT, forward_params
from .spec import KernelSpec, spec_key
from .template import template_hash
from .versions import versions_key

HOPPER_TEMPLATE = "fwd_hopper"
HOPPER_TEMPLATES = ("fwd_hopper.tmpl", "helpers.tmpl", "common.tmpl", "fwd_common.tmpl")


def hopper_key(spec: KernelSpec, score: TracedMod | None, mask: TracedMod | None) -> str:
    return spec_key(spec, score.key if score else "-", mask.key if mask else "-",
                    versions_key(), template_hash(*HOPPER_TEMPLATES))


def hopper_kernel(spec: KernelSpec, score: TracedMod | None, mask: TracedMod | None
                  ) -> GeneratedKernel:
    """Key, name (``flexfa_fwd_hopper_d128_bf16_<hash>``) and source of the Hopper forward."""
    assert spec.template == HOPPER_TEMPLATE, f"spec is for template {spec.template!r}"
    return forward_module(spec, score, mask, hopper_key(spec, score, mask), "fwd_hopper.tmpl",
                          forward_params(True, buffer_params(score, mask), spec.strided_qkv,
                                         features(spec)),
                          module_flags(spec.constexprs(True)))


def hopper_signature(spec: KernelSpec, score: TracedMod | None, mask: TracedMod | None
                     ) -> tuple[dict[str, str], dict[str, object]]:
    """(signature, constexprs) of the Hopper forward, for ``triton.compile(ASTSource(...))``."""
    constexprs = spec.constexprs(score is not None)
    params = forward_params(True, buffer_params(score, mask), spec.strided_qkv, features(spec))
    return params.signature(constexprs, {INPUT: spec.dtype}), constexprs
