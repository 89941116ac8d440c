"""The FP8 forward kernel: ``FP8KernelSpec`` and the filler of ``fwd_fp8.tmpl``.

Same hooks, leaves and libraries as the bf16 forward (``flexfa/codegen/forward.py``): the
score_mod and mask_mod render identically, because the kernel hands them the descaled float32
score.
Importing this module registers the FP8 variants with ``python -m flexfa compile-check``.
"""
from __future__ import annotations

import dataclasses
import hashlib

from ..frontend.trace import TracedMod
from . import compile_check
from .forward import GeneratedKernel, buffer_params, forward_module, module_flags
from .params import INPUT, OUTPUT, def_kernel, fp8_params, quantize_params
from .spec import INTERPRET, forward_constexprs, launch_options, next_power_of_two, spec_key
from .template import fill, load_template, module_source, template_hash
from .versions import versions_key

FP8_TEMPLATES = ("fwd_fp8.tmpl", "helpers.tmpl", "fp8_helpers.tmpl", "common.tmpl",
                 "fwd_common.tmpl")
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
    exp_f16: bool = False  # removed (docs/performance.md, tried and rejected): must be False
    # q.k's descales and scale joined to exp2's FMA (needs them > 0 and no score_mod)
    fold_qk_scale: bool = False
    template: str = "fwd_fp8"
    dtype: str = "e4m3"  # the inputs' dtype, for the kernel name
    max_registers: int = 0  # Triton's maxnreg, from kernel_options (0: none)
    wide_ints: tuple[str, ...] = ()  # as KernelSpec.wide_ints

    def __post_init__(self):
        assert self.out_dtype in ("bf16", "fp16"), self.out_dtype
        assert not self.exp_f16, "P's float16 exp2 (exp_f16) was removed"
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
            USE_TMA=self.use_tma, FOLD_QK_SCALE=self.fold_qk_scale)

    def launch_options(self) -> dict[str, int]:
        return launch_options(self)


def fp8_forward_key(spec: FP8KernelSpec, score: TracedMod | None, mask: TracedMod | None) -> str:
    return spec_key(spec, score.key if score else "-", mask.key if mask else "-",
                    versions_key(), template_hash(*FP8_TEMPLATES))


def fp8_forward_kernel(spec: FP8KernelSpec, score: TracedMod | None, mask: TracedMod | None
                       ) -> GeneratedKernel:
    """Key, name (``flexfa_fwd_fp8_d128_e4m3_<hash>``) and source of the FP8 forward kernel."""
    return forward_module(spec, score, mask, fp8_forward_key(spec, score, mask), "fwd_fp8.tmpl",
                          fp8_params(buffer_params(score, mask)),
                          module_flags(spec.constexprs(True)),
                          helpers=("helpers.tmpl", "fp8_helpers.tmpl"))


def fp8_forward_signature(spec: FP8KernelSpec, score: TracedMod | None, mask: TracedMod | None
                          ) -> tuple[dict[str, str], dict[str, object]]:
    """(signature, constexprs) of the FP8 kernel, for ``triton.compile(ASTSource(...))``."""
    constexprs = spec.constexprs(score is not None)
    params = fp8_params(buffer_params(score, mask))
    return params.signature(constexprs, {OUTPUT: spec.out_dtype}), constexprs


def quantize_kernel() -> GeneratedKernel:
    """The e4m3 quantization kernel (one for every mod and shape; flags are constexprs)."""
    text = "|".join(("fp8_quantize", versions_key(), template_hash(*QUANTIZE_TEMPLATES)))
    key = hashlib.sha256(text.encode()).hexdigest()
    name = f"flexfa_fp8_quantize_{key[:12]}"
    params = quantize_params()
    source = module_source(f"flexfa generated FP8 quantization kernel: {name}", {}, (name,),
                           load_template("helpers.tmpl"), load_template("fp8_helpers.tmpl"),
                           fill(load_template("fwd_fp8_quantize.tmpl"), KERNEL_NAME=name,
                                DEF_KERNEL=def_kernel(name, params, {})))
    return GeneratedKernel(key, name, source, kernels=((name, params),))


def quantize_signature(dtype: str, constexprs: dict) -> dict[str, str]:
    return quantize_params().signature(constexprs, {INPUT: dtype})


# ---- compile-check variants -----------------------------------------------------------------

def fp8_job(head_dim: int, score_mod=None, mask_mod=None, head_dim_v=None, use_tma=False):
    """A compile-check builder: the FP8 kernel for these mods at the GPU default tiles, with
    the scale fold of ``quantize``'s inputs where it applies (no score_mod)."""
    def build(arch: int) -> compile_check.CompileJob:
        from ..runtime.families.fp8 import default_tiles
        from ..runtime.target import parse_target

        score, mask = compile_check.traced_mods(score_mod, mask_mod)
        block_m, block_n, warps, stages, cap = default_tiles(
            next_power_of_two(head_dim, FP8_MIN_DIM), parse_target(f"cuda:{arch}"), use_tma)
        spec = FP8KernelSpec(out_dtype="bf16", head_dim=head_dim,
                             head_dim_v=head_dim_v or head_dim, block_m=block_m,
                             block_n=block_n, num_warps=warps, num_stages=stages,
                             has_block_mask=mask is not None, has_full_blocks=mask is not None,
                             sparse_q=128, sparse_kv=128, scale_q=128, scale_kv=128,
                             even_l=False, even_s=False, return_lse=True, gqa_group=1,
                             target=f"cuda:{arch}", use_tma=use_tma, max_registers=cap,
                             fold_qk_scale=score is None)
        return compile_check.kernel_job(spec, score, mask, fp8_forward_kernel,
                                        fp8_forward_signature)
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
