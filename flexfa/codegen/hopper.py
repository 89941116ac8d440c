"""The Hopper (sm_90) forward template: filling ``fwd_hopper.tmpl`` and its compile checks.

Same hooks, libraries and ``KernelSpec`` as the Ampere-class ``fwd.tmpl`` (with
``template="fwd_hopper"``; the module is built by ``flexfa.codegen.forward.forward_module``);
what differs is how tiles reach shared memory (host tensor descriptors, TMA), the flat
pipelined block loop and the reversed q-tile order.
"""
from __future__ import annotations

from ..frontend.trace import TracedMod
from .forward import GeneratedKernel, buffer_params, forward_module, module_flags
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
                          forward_params(True, buffer_params(score, mask)),
                          module_flags(spec.constexprs(True)))


def hopper_signature(spec: KernelSpec, score: TracedMod | None, mask: TracedMod | None
                     ) -> tuple[dict[str, str], dict[str, object]]:
    """(signature, constexprs) of the Hopper forward, for ``triton.compile(ASTSource(...))``."""
    constexprs = spec.constexprs(score is not None)
    params = forward_params(True, buffer_params(score, mask))
    return params.signature(constexprs, {INPUT: spec.dtype}), constexprs


# ---- compile-only checks (python -m flexfa compile-check) ----------------------------------

def hopper_job(head_dim: int, dtype: str, score_mod=None, mask_mod=None, block_m: int = 128,
               block_n: int = 128, num_warps: int = 8, num_stages: int = 2,
               return_lse: bool = True, max_registers: int = 0, return_max: bool = False):
    """A compile-check builder (arch -> CompileJob) for the Hopper forward of these mods."""
    def build(arch: int):
        from .compile_check import kernel_job, traced_mods

        score, mask = traced_mods(score_mod, mask_mod)
        spec = KernelSpec(dtype=dtype, head_dim=head_dim, head_dim_v=head_dim, block_m=block_m,
                          block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                          has_block_mask=mask is not None, has_full_blocks=mask is not None,
                          sparse_q=128, sparse_kv=128, even_l=False, even_s=False,
                          return_lse=return_lse, gqa_group=1, input_precision="ieee",
                          target=f"cuda:{arch}", template=HOPPER_TEMPLATE,
                          max_registers=max_registers, return_max=return_max)
        return kernel_job(spec, score, mask, hopper_kernel, hopper_signature)
    return build


def _register_compile_checks() -> None:
    import torch

    from . import compile_check as check

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def softcap(score, b, h, q_idx, kv_idx):
        return 30.0 * torch.tanh(score / 30.0)

    # sm_90 only: the runtime never picks this template elsewhere
    check.register("fwd_hopper_d128_bf16_causal", hopper_job(128, "bf16", mask_mod=causal),
                   archs=(90,))
    check.register("fwd_hopper_d64_bf16_dense", hopper_job(64, "bf16", return_lse=False),
                   archs=(90,))
    # the tuned defaults with a register cap (two programs per SM)
    check.register("fwd_hopper_d128_bf16_causal_128x64_r128",
                   hopper_job(128, "bf16", mask_mod=causal, block_n=64, max_registers=128),
                   archs=(90,))
    # with the rows' max scores too (AuxRequest(max_scores=True))
    check.register("fwd_hopper_d128_fp16_softcap_causal",
                   hopper_job(128, "fp16", score_mod=softcap, mask_mod=causal, return_max=True),
                   archs=(90,))


_register_compile_checks()
