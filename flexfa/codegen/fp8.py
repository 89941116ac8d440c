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
from .forward import GeneratedKernel, buffer_params, forward_module, module_flags
from .params import INPUT, OUTPUT, def_kernel, feature_params, fp8_params, quantize_params
from .spec import INTERPRET, forward_constexprs, launch_options, next_power_of_two, spec_key
from .template import fill, load_template, module_source, template_hash
from .versions import versions_key

FP8_TEMPLATES = ("fwd_fp8.tmpl", "helpers.tmpl", "fp8_helpers.tmpl", "common.tmpl",
                 "fwd_common.tmpl")
QUANTIZE_TEMPLATES = ("fwd_fp8_quantize.tmpl", "helpers.tmpl", "fp8_helpers.tmpl")
P_SHIFT = 8  # P is cast to e4m3 as P * 2**8: [0, 1] -> [0, 256], well inside e4m3's 448
# the smallest descale ``quantize`` writes (a block's amax / 448 below it is raised to it: its
# values, under 448 * 2**-60 = 3.9e-16, then land on e4m3's subnormals or 0, at most 2**-69
# off; before, a float32 block of subnormals got descale 0). Two such descales multiply to
# 2**-120, inside float32's normal range, so the folded score scale (FOLD_QK_SCALE:
# q_descale * k_descale * scale * log2(e)) cannot underflow to 0, where a masked -inf score
# times 0 was NaN, for a softmax scale >= FOLD_MIN_SCALE (0.0108; smaller ones: no fold)
DESCALE_MIN = 2.0 ** -60
FOLD_MIN_SCALE = 2.0 ** -126 / (DESCALE_MIN * DESCALE_MIN * 1.4426950408889634)
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
    # q.k's descales and scale joined to exp2's FMA (needs them > 0 and no score_mod)
    fold_qk_scale: bool = False
    template: str = "fwd_fp8"
    dtype: str = "e4m3"  # the inputs' dtype, for the kernel name
    max_registers: int = 0  # Triton's maxnreg, from kernel_options (0: none)
    wide_ints: tuple[str, ...] = ()  # as KernelSpec.wide_ints
    sinks_dtype: str = ""  # as KernelSpec.sinks_dtype (no dropout: FP8 is forward-only)

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
            USE_TMA=self.use_tma, FOLD_QK_SCALE=self.fold_qk_scale,
            HAS_SINKS=bool(self.sinks_dtype))

    def launch_options(self) -> dict[str, int]:
        return launch_options(self)


def fp8_forward_key(spec: FP8KernelSpec, score: TracedMod | None, mask: TracedMod | None) -> str:
    return spec_key(spec, score.key if score else "-", mask.key if mask else "-",
                    versions_key(), template_hash(*FP8_TEMPLATES))


def fp8_forward_kernel(spec: FP8KernelSpec, score: TracedMod | None, mask: TracedMod | None
                       ) -> GeneratedKernel:
    """Key, name (``flexfa_fwd_fp8_d128_e4m3_<hash>``) and source of the FP8 forward kernel."""
    return forward_module(spec, score, mask, fp8_forward_key(spec, score, mask), "fwd_fp8.tmpl",
                          fp8_params(buffer_params(score, mask),
                                     feature_params(spec.sinks_dtype, False)),
                          module_flags(spec.constexprs(True)),
                          helpers=("helpers.tmpl", "fp8_helpers.tmpl"))


def fp8_forward_signature(spec: FP8KernelSpec, score: TracedMod | None, mask: TracedMod | None
                          ) -> tuple[dict[str, str], dict[str, object]]:
    """(signature, constexprs) of the FP8 kernel, for ``triton.compile(ASTSource(...))``."""
    constexprs = spec.constexprs(score is not None)
    params = fp8_params(buffer_params(score, mask), feature_params(spec.sinks_dtype, False))
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
