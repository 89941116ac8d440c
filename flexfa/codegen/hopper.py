"""The Hopper (sm_90) forward template: filling ``fwd_hopper.tmpl`` and its compile checks.

Same hooks and the same ``KernelSpec`` as the Ampere-class ``fwd.tmpl`` (with
``template="fwd_hopper"``), so the score_mod and mask_mod code is rendered once by
``flexfa.codegen.forward``; what differs is how tiles reach shared memory (host tensor
descriptors, TMA), the flat pipelined block loop and the reversed q-tile order.
"""
from __future__ import annotations

import os

from ..frontend.trace import TracedMod
from .forward import (GeneratedKernel, describe_mods, forward_signature, mask_mod_code,
                      mod_buffer_args, score_mod_code)
from .spec import KernelSpec, kernel_name, spec_key
from .template import fill, load_template, template_hash
from .versions import versions_key

HOPPER_TEMPLATE = "fwd_hopper"
HOPPER_TEMPLATES = ("fwd_hopper.tmpl", "helpers.tmpl")
# RESCALE_THRESHOLD of fwd_hopper.tmpl: 0 rescales on every tile, 8 only when a row max grew
# by more than 2**8 (measured on the H200: see docs/performance.md)
RESCALE_THRESHOLD = int(os.environ.get("FLEXFA_RESCALE_THRESHOLD", "0"))


def hopper_key(spec: KernelSpec, score: TracedMod | None, mask: TracedMod | None) -> str:
    return spec_key(spec, score.key if score else "-", mask.key if mask else "-",
                    versions_key(), template_hash(*HOPPER_TEMPLATES),
                    f"rescale={RESCALE_THRESHOLD}")


def hopper_kernel(spec: KernelSpec, score: TracedMod | None, mask: TracedMod | None
                  ) -> GeneratedKernel:
    """Key, name (``flexfa_fwd_hopper_d128_bf16_<hash>``) and source of the Hopper forward."""
    assert spec.template == HOPPER_TEMPLATE, f"spec is for template {spec.template!r}"
    key = hopper_key(spec, score, mask)
    name = kernel_name(spec, key)
    score_args, mask_args = mod_buffer_args(score, mask)
    names = "".join(f", {p}" for args in (*score_args, *mask_args) for p in args.params)
    source = fill(
        load_template("fwd_hopper.tmpl"),
        KERNEL_NAME=name,
        HELPERS=load_template("helpers.tmpl").rstrip("\n"),
        # the running max is the row max only when every tile rescales
        RESCALE_THRESHOLD="0" if spec.return_max else str(RESCALE_THRESHOLD),
        BUFFER_PARAMS=names,
        BUFFER_ARGS=names,
        SCORE_MOD=score_mod_code(score, score_args, fast_math=not spec.interpret,
                                 wide=spec.wide_ints),
        MASK_MOD=mask_mod_code(mask, mask_args, wide=spec.wide_ints),
    )
    return GeneratedKernel(key, name, source, describe_mods(score, mask))


def hopper_signature(spec: KernelSpec, score: TracedMod | None, mask: TracedMod | None
                     ) -> tuple[dict[str, str], dict[str, object]]:
    """(signature, constexprs) of the Hopper forward, for ``triton.compile(ASTSource(...))``."""
    ampere, constexprs = forward_signature(spec, score, mask)
    signature = {
        "Q_DESC": f"tensordesc<{spec.dtype}[{spec.block_m}, {spec.head_dim_pad}]>",
        "K_DESC": f"tensordesc<{spec.dtype}[{spec.block_n}, {spec.head_dim_pad}]>",
        "V_DESC": f"tensordesc<{spec.dtype}[{spec.block_n}, {spec.head_dim_v_pad}]>",
    }
    dropped = {"Q", "K", "V", *(f"stride_{t}{d}" for t, dims in
                                (("q", "bhmd"), ("k", "bhnd"), ("v", "bhnd")) for d in dims)}
    signature.update({k: v for k, v in ampere.items() if k not in dropped})
    return signature, constexprs


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
