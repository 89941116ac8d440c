"""The FP8 forward kernel: ``FP8KernelSpec`` and the filler of ``fwd_fp8.tmpl``.

Same hooks and leaves as the bf16 forward (``flexfa/codegen/forward.py``): the score_mod and
mask_mod render identically, because the kernel hands them the descaled float32 score.
Importing this module registers the FP8 variants with ``python -m flexfa compile-check``.
"""
from __future__ import annotations

import dataclasses
import hashlib

from ..frontend.trace import TracedMod
from . import compile_check
from .forward import GeneratedKernel, describe_mods, mod_hooks, tables_and_mods_signature
from .spec import (INTERPRET, forward_constexprs, kernel_name, launch_options, next_power_of_two,
                   spec_key)
from .template import fill, load_template, template_hash
from .versions import versions_key

FP8_TEMPLATES = ("fwd_fp8.tmpl", "helpers.tmpl", "fp8_helpers.tmpl")
QUANTIZE_TEMPLATES = ("fwd_fp8_quantize.tmpl", "helpers.tmpl", "fp8_helpers.tmpl")
P_SHIFT = 8  # P is cast to e4m3 as P * 2**8: [0, 1] -> [0, 256], well inside e4m3's 448
FP8_MIN_DIM = 32  # e4m3 dots reduce over K >= 32: E and BLOCK_N pad/tile to at least this


@dataclasses.dataclass(frozen=True)
class FP8KernelSpec:
    """An FP8 forward-kernel variant; rendering is a pure function of (mods' IR, spec)."""

    out_dtype: str  # "bf16" | "fp16"
    head_dim: int  # E of the FP8 q/k (after any rotation padding)
    head_dim_v: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    has_block_mask: bool
    has_full_blocks: bool
    sparse_q: int
    sparse_kv: int
    scale_q: int  # rows per Q scale block
    scale_kv: int  # rows per K/V scale block
    even_l: bool
    even_s: bool
    return_lse: bool
    gqa_group: int
    target: str
    use_tma: bool = False  # Q/K/V^T tiles through tensor descriptors (runtime checks layouts)
    exp_f16: bool = False  # P's exp2 in float16, two per instruction (ex2.approx.f16x2)
    # q.k's descales and scale joined to exp2's FMA (needs them > 0 and no score_mod)
    fold_qk_scale: bool = False
    template: str = "fwd_fp8"
    dtype: str = "e4m3"  # the inputs' dtype, for the kernel name
    max_registers: int = 0  # Triton's maxnreg, from kernel_options (0: none)
    wide_ints: tuple[str, ...] = ()  # as KernelSpec.wide_ints

    def __post_init__(self):
        assert self.out_dtype in ("bf16", "fp16"), self.out_dtype
        for tile, block, what in ((self.block_m, self.sparse_q, "block-mask q"),
                                  (self.block_n, self.sparse_kv, "block-mask kv"),
                                  (self.block_m, self.scale_q, "Q scale"),
                                  (self.block_n, self.scale_kv, "K/V scale")):
            assert block % tile == 0, f"tile {tile} must divide the {what} block {block}"

    @property
    def head_dim_pad(self) -> int:
        return next_power_of_two(self.head_dim, FP8_MIN_DIM)

    @property
    def head_dim_v_pad(self) -> int:
        return next_power_of_two(self.head_dim_v, FP8_MIN_DIM)

    @property
    def interpret(self) -> bool:
        return self.target == INTERPRET

    def constexprs(self, has_score_mod: bool) -> dict[str, object]:
        return dict(
            forward_constexprs(self, has_score_mod), SCALE_Q=self.scale_q,
            SCALE_KV=self.scale_kv, P_SHIFT=P_SHIFT, EMULATE_FP8_CAST=self.interpret,
            USE_TMA=self.use_tma, EXP_F16=self.exp_f16, FOLD_QK_SCALE=self.fold_qk_scale)

    def launch_options(self) -> dict[str, int]:
        return launch_options(self)


def fp8_forward_key(spec: FP8KernelSpec, score: TracedMod | None, mask: TracedMod | None) -> str:
    return spec_key(spec, score.key if score else "-", mask.key if mask else "-",
                    versions_key(), template_hash(*FP8_TEMPLATES))


def fp8_forward_kernel(spec: FP8KernelSpec, score: TracedMod | None, mask: TracedMod | None
                       ) -> GeneratedKernel:
    """Key, name (``flexfa_fwd_fp8_d128_e4m3_<hash>``) and source of the FP8 forward kernel."""
    key = fp8_forward_key(spec, score, mask)
    name = kernel_name(spec, key)
    source = fill(load_template("fwd_fp8.tmpl"), KERNEL_NAME=name,
                  FP8_HELPERS=load_template("fp8_helpers.tmpl").rstrip("\n"),
                  **mod_hooks(score, mask, fast_math=not spec.interpret, wide=spec.wide_ints))
    return GeneratedKernel(key, name, source, describe_mods(score, mask))


def fp8_forward_signature(spec: FP8KernelSpec, score: TracedMod | None, mask: TracedMod | None
                          ) -> tuple[dict[str, str], dict[str, object]]:
    """(signature, constexprs) of the FP8 kernel, for ``triton.compile(ASTSource(...))``."""
    signature = {"Q": "*fp8e4nv", "K": "*fp8e4nv", "V": "*fp8e4nv", "Q_SCALE": "*fp32",
                 "K_SCALE": "*fp32", "V_SCALE": "*fp32", "OUT": f"*{spec.out_dtype}",
                 "LSE": "*fp32"}
    for tensor, dims in (("q", "bhmd"), ("k", "bhnd"), ("v", "bhnd"), ("o", "bhmd")):
        signature.update({f"stride_{tensor}{d}": "i32" for d in dims})
    signature.update({name: "i32" for name in ("stride_qs_b", "stride_qs_h", "stride_kvs_b",
                                               "stride_kvs_h")})
    constexprs = spec.constexprs(score is not None)
    signature.update(tables_and_mods_signature(score, mask, constexprs))
    return signature, constexprs


def quantize_kernel() -> GeneratedKernel:
    """The e4m3 quantization kernel (one for every mod and shape; flags are constexprs)."""
    text = "|".join(("fp8_quantize", versions_key(), template_hash(*QUANTIZE_TEMPLATES)))
    key = hashlib.sha256(text.encode()).hexdigest()
    name = f"flexfa_fp8_quantize_{key[:12]}"
    source = fill(load_template("fwd_fp8_quantize.tmpl"), KERNEL_NAME=name,
                  HELPERS=load_template("helpers.tmpl").rstrip("\n"),
                  FP8_HELPERS=load_template("fp8_helpers.tmpl").rstrip("\n"))
    return GeneratedKernel(key, name, source)


def quantize_signature(dtype: str, constexprs: dict) -> dict[str, str]:
    signature = {"X": f"*{dtype}", "X8": "*fp8e4nv", "SCALE": "*fp32", "SIGNED_H": "*fp32"}
    for tensor, dims in (("x", "bhnd"), ("o", "bhnd")):
        signature.update({f"stride_{tensor}{d}": "i32" for d in dims})
    signature.update(stride_sb="i32", stride_sh="i32", H="i32", N="i32", inv_sqrt_d="fp32")
    signature.update({name: "constexpr" for name in constexprs})
    return signature


# ---- compile-check variants -----------------------------------------------------------------

def fp8_job(head_dim: int, score_mod=None, mask_mod=None, head_dim_v=None, use_tma=False,
            exp_f16=False):
    """A compile-check builder: the FP8 kernel for these mods at the GPU default tiles, with
    the scale fold of ``quantize``'s inputs where it applies (no score_mod)."""
    def build(arch: int) -> compile_check.CompileJob:
        from ..frontend.trace import MASK_MOD, SCORE_MOD, trace
        from ..fp8.runtime import default_fp8_tiles
        from ..runtime.cache import get_module

        score = trace(score_mod, SCORE_MOD) if score_mod else None
        mask = trace(mask_mod, MASK_MOD) if mask_mod else None
        block_m, block_n, warps, stages, cap = default_fp8_tiles(
            next_power_of_two(head_dim, FP8_MIN_DIM), f"cuda:{arch}", use_tma)
        spec = FP8KernelSpec(out_dtype="bf16", head_dim=head_dim,
                             head_dim_v=head_dim_v or head_dim, block_m=block_m,
                             block_n=block_n, num_warps=warps, num_stages=stages,
                             has_block_mask=mask is not None, has_full_blocks=mask is not None,
                             sparse_q=128, sparse_kv=128, scale_q=128, scale_kv=128,
                             even_l=False, even_s=False, return_lse=True, gqa_group=1,
                             target=f"cuda:{arch}", use_tma=use_tma, exp_f16=exp_f16,
                             max_registers=cap, fold_qk_scale=score is None)
        generated = fp8_forward_kernel(spec, score, mask)
        module = get_module(generated.name, generated.key, False, lambda: generated.source)
        signature, constexprs = fp8_forward_signature(spec, score, mask)
        return compile_check.CompileJob(getattr(module, generated.name), signature, constexprs,
                                        spec.launch_options(), generated.name)
    return build


FP8_ARCHS = (89, 90)  # e4m3 tensor cores: Ada (mma.sync) and Hopper (wgmma)
compile_check.register("fwd_fp8_d128_dense", fp8_job(128), archs=FP8_ARCHS)
compile_check.register("fwd_fp8_d128_causal", fp8_job(128, mask_mod=compile_check._causal),
                       archs=FP8_ARCHS)
compile_check.register("fwd_fp8_d64_softcap", fp8_job(64, score_mod=compile_check._softcap),
                       archs=FP8_ARCHS)
compile_check.register("fwd_fp8_d128_alibi_document",
                       fp8_job(128, score_mod=compile_check._slopes_mod(),
                               mask_mod=compile_check._document_mask()), archs=FP8_ARCHS)
compile_check.register("fwd_fp8_d128_causal_tma",
                       fp8_job(128, mask_mod=compile_check._causal, use_tma=True), archs=(90,))
compile_check.register("fwd_fp8_d128_causal_tma_exp16",
                       fp8_job(128, mask_mod=compile_check._causal, use_tma=True, exp_f16=True),
                       archs=(90,))


def quantize_job(head_dim: int, dtype: str, rotate: bool, block: int = 128):
    """A compile-check builder: the quantization kernel for one head dim and input dtype."""
    def build(arch: int) -> compile_check.CompileJob:
        from ..runtime.cache import get_module

        generated = quantize_kernel()
        module = get_module(generated.name, generated.key, False, lambda: generated.source)
        e_pad = next_power_of_two(head_dim, FP8_MIN_DIM if rotate else 16)
        constexprs = dict(E=head_dim, E_PAD=e_pad, E_OUT=e_pad if rotate else head_dim,
                          BLOCK=block, ROWS=min(block, 64 if e_pad >= 256 else 128),
                          ROTATE=rotate, DOT_IN_FP32=dtype == "fp32", EMULATE_FP8_CAST=False)
        return compile_check.CompileJob(getattr(module, generated.name),
                                        quantize_signature(dtype, constexprs), constexprs,
                                        {"num_warps": 8 if e_pad >= 128 else 4, "num_stages": 1},
                                        generated.name)
    return build


compile_check.register("fp8_quantize_d128_bf16_rotate", quantize_job(128, "bf16", True),
                       archs=FP8_ARCHS)
compile_check.register("fp8_quantize_d256_fp16_rotate", quantize_job(256, "fp16", True),
                       archs=FP8_ARCHS)
compile_check.register("fp8_quantize_d128_bf16_v", quantize_job(128, "bf16", False),
                       archs=FP8_ARCHS)
