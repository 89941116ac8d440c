"""The compile-check variants of every kernel family: each a builder ``arch -> CompileJob``
that renders the family's kernel for a few mods at its GPU default tiles, as the runtime
would plan it, registered under a readable name."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ..codegen.backward import backward_kernel, launch_signature
from ..codegen.decode import decode_kernel, decode_signature
from ..codegen.forward import forward_kernel, forward_signature
from ..codegen.fp8 import (FP8_MIN_DIM, FP8KernelSpec, fp8_forward_kernel, fp8_forward_signature,
                           quantize_kernel, quantize_signature)
from ..codegen.params import quantize_params
from ..codegen.gluon import GLUON_TEMPLATE, MAX_REGISTERS, gluon_kernel, gluon_signature
from ..codegen.gluon_bwd import (POST, PRE, ZERO, GluonBackwardSpec, RowsSpec, gluon_bwd_kernel,
                                 gluon_bwd_signature, rows_params)
from ..codegen.hopper import HOPPER_TEMPLATE, hopper_kernel, hopper_signature
from ..codegen.ranges import Domain, mods_int64_nodes, static_score_max
from ..codegen.spec import TORCH_DTYPES, KernelSpec, next_power_of_two
from ..blockmask import create_block_mask
from ..runtime.cache import get_module
from ..runtime.call import AttentionCall, Dropout
from ..runtime.families.ampere import default_tiles as ampere_tiles
from ..runtime.families.hopper import COMBINE_LAUNCH as HOPPER_COMBINE_LAUNCH
from ..runtime.families.backward import (BACKWARD, Inputs, backward_spec, full_walk_mask,
                                         joint_graph, step_args)
from ..runtime.families.gluon_bwd import keys_per_program
from ..runtime.decode_inputs import DecodeInputs
from ..runtime.families.decode import decode_spec
from ..fp8.inputs import FP8_DTYPE
from ..fp8.quantize import seq_contiguous_storage
from ..runtime.families.fp8 import default_tiles as fp8_tiles, quantize_launch
from ..runtime.options import KernelOptions, PassOptions
from ..runtime.pipeline import prepare_mask, prepare_score_mod
from ..runtime.target import parse_target
from . import CompileJob, kernel_job, register, traced_mods

# ---- the Ampere-class forward -----------------------------------------------------------

def slopes_mod():
    """An ALiBi score_mod over 4 heads' slopes (a captured tensor), as the jobs compile it."""
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()
    return alibi


def learnable_relative_bias():
    """A score_mod adding a learnable relative-position bias (a captured [8191] tensor that
    wants a gradient: the backward scatter-adds into it)."""
    rel = torch.zeros(8191, requires_grad=True)

    def relative(score, b, h, q_idx, kv_idx):
        return score + rel[q_idx - kv_idx + 4095]
    return relative


def learnable_axis_biases():
    """A score_mod adding a learnable row bias row[h, q_idx] and key bias col[kv_idx]
    (captured [8, 4096] and [4096] tensors: the backward's sums along one tile axis)."""
    row, col = torch.zeros(8, 4096, requires_grad=True), torch.zeros(4096, requires_grad=True)

    def axis_biases(score, b, h, q_idx, kv_idx):
        return score + row[h, q_idx] + col[kv_idx]
    return axis_biases


def softcap_mod(score, b, h, q_idx, kv_idx):
    return 30.0 * torch.tanh(score / 30.0)


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def document_mask():
    """A document mask_mod reading a captured [4096] int32 document id per position."""
    doc = torch.zeros(4096, dtype=torch.int32)

    def document(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]
    return document


def _global_tokens_mask():
    is_global = torch.zeros(4096, dtype=torch.bool)

    def global_or_causal(b, h, q_idx, kv_idx):
        return is_global[kv_idx] | (q_idx >= kv_idx)
    return global_or_causal


def forward_job(head_dim: int, dtype: str, score_mod=None, mask_mod=None, head_dim_v=None,
                return_lse: bool = True, return_max: bool = False, split_keys: int = 0,
                sinks_dtype: str = "", dropout: bool = False) -> Callable[[int], CompileJob]:
    """A builder compiling the forward kernel for these mods at default GPU tiles
    (``split_keys``: split-KV decoding's variant; ``sinks_dtype``, ``dropout``: the optional
    features)."""
    def build(arch: int) -> CompileJob:
        score, mask = traced_mods(score_mod, mask_mod)
        block_m, block_n, warps, stages = ampere_tiles(
            next_power_of_two(head_dim), TORCH_DTYPES[dtype], parse_target(f"cuda:{arch}"),
            next_power_of_two(head_dim_v or head_dim))
        spec = KernelSpec(dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v or head_dim,
                          block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages,
                          has_block_mask=mask is not None, has_full_blocks=mask is not None,
                          sparse_q=128 if mask else block_m, sparse_kv=128 if mask else block_n,
                          even_l=False, even_s=False, return_lse=return_lse, gqa_group=1,
                          input_precision="ieee", target=f"cuda:{arch}", return_max=return_max,
                          split_keys=split_keys, sinks_dtype=sinks_dtype, dropout=dropout)
        return kernel_job(spec, score, mask, forward_kernel, forward_signature)
    return build


register("fwd_d64_bf16_dense", forward_job(64, "bf16", return_lse=False))
register("fwd_d128_bf16_causal", forward_job(128, "bf16", mask_mod=causal_mask))
# with the rows' max scores too (AuxRequest(max_scores=True))
register("fwd_d128_fp16_softcap", forward_job(128, "fp16", score_mod=softcap_mod, return_max=True))
register("fwd_d64_fp16_alibi_document", forward_job(64, "fp16", score_mod=slopes_mod(),
                                                     mask_mod=document_mask()))
register("fwd_d80_bf16_ev48_causal", forward_job(80, "bf16", mask_mod=causal_mask, head_dim_v=48))
register("fwd_d256_bf16_dense", forward_job(256, "bf16"))
register("fwd_d128_bf16_causal_split", forward_job(128, "bf16", mask_mod=causal_mask,
                                                   return_max=True, split_keys=4096))
register("fwd_d64_bf16_bool_table", forward_job(64, "bf16", mask_mod=_global_tokens_mask()))
# attention sinks (bf16 and float32 logits) with dropout, and with the rows' max scores
register("fwd_d128_bf16_causal_sinks_dropout",
         forward_job(128, "bf16", mask_mod=causal_mask, sinks_dtype="fp32", dropout=True))
register("fwd_d64_fp16_softcap_sinks_dropout_max",
         forward_job(64, "fp16", score_mod=softcap_mod, sinks_dtype="fp16", dropout=True,
                     return_max=True))



# ---- compile-only checks (python -m flexfa compile-check) ----------------------------------

def hopper_job(head_dim: int, dtype: str, score_mod=None, mask_mod=None, block_m: int = 128,
               block_n: int = 128, num_warps: int = 8, num_stages: int = 2,
               return_lse: bool = True, max_registers: int = 0, return_max: bool = False,
               strided_qkv: bool = False, sinks_dtype: str = "", dropout: bool = False,
               head_dim_v: int | None = None, split_kv: bool = False, combine: bool = False):
    """A compile-check builder (arch -> CompileJob) for the Hopper forward of these mods
    (``strided_qkv``: q, k, v through descriptors over strided matrices; ``split_kv``: the
    split-KV variant; ``combine``: its combine kernel, as the runtime launches it)."""
    def build(arch: int):
        score, mask = traced_mods(score_mod, mask_mod)
        spec = KernelSpec(dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v or head_dim,
                          block_m=block_m,
                          block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                          has_block_mask=mask is not None, has_full_blocks=mask is not None,
                          sparse_q=128, sparse_kv=128, even_l=False, even_s=False,
                          return_lse=return_lse, gqa_group=1, input_precision="ieee",
                          target=f"cuda:{arch}", template=HOPPER_TEMPLATE,
                          max_registers=max_registers, return_max=return_max,
                          strided_qkv=strided_qkv, sinks_dtype=sinks_dtype, dropout=dropout,
                          split_kv=split_kv)
        if not combine:
            return kernel_job(spec, score, mask, hopper_kernel, hopper_signature)
        generated = hopper_kernel(spec, score, mask)
        module = get_module(generated.name, generated.key, False, lambda: generated.source)
        signature, constexprs = hopper_signature(spec, score, mask, combine=True)
        return CompileJob(getattr(module, f"{generated.name}_combine"), signature, constexprs,
                          HOPPER_COMBINE_LAUNCH, f"{generated.name}_combine")
    return build


def _register_hopper() -> None:
    # sm_90 only: the runtime never picks this template elsewhere
    register("fwd_hopper_d128_bf16_causal", hopper_job(128, "bf16", mask_mod=causal_mask),
                   archs=(90,))
    register("fwd_hopper_d64_bf16_dense", hopper_job(64, "bf16", return_lse=False),
                   archs=(90,))
    # the tuned defaults with a register cap (two programs per SM)
    register("fwd_hopper_d128_bf16_causal_128x64_r128",
                   hopper_job(128, "bf16", mask_mod=causal_mask, block_n=64, max_registers=128),
                   archs=(90,))
    # packed / [B, L, H, E] q, k, v read in place (varlen_attention's layout)
    register("fwd_hopper_d128_bf16_causal_strided",
             hopper_job(128, "bf16", mask_mod=causal_mask, strided_qkv=True), archs=(90,))
    # with the rows' max scores too (AuxRequest(max_scores=True))
    register("fwd_hopper_d128_fp16_softcap_causal",
                   hopper_job(128, "fp16", score_mod=softcap_mod, mask_mod=causal_mask,
                              return_max=True),
                   archs=(90,))
    register("fwd_hopper_d128_bf16_causal_sinks_dropout",
             hopper_job(128, "bf16", mask_mod=causal_mask, block_n=64, return_max=True,
                        sinks_dtype="fp32", dropout=True), archs=(90,))
    # split-KV (a chunked prefill), over a block mask and dense, at the default tiles without
    # their register cap: with the cap of 128 these spill about 236 bytes, as the unsplit
    # kernel does (232)
    register("fwd_hopper_d128_bf16_causal_split",
             hopper_job(128, "bf16", mask_mod=causal_mask, block_n=64, return_max=True,
                        split_kv=True), archs=(90,))
    register("fwd_hopper_d128_bf16_softcap_split",
             hopper_job(128, "bf16", score_mod=softcap_mod, block_n=64, split_kv=True),
             archs=(90,))
    register("fwd_hopper_combine_d128_bf16_sinks_max",
             hopper_job(128, "bf16", mask_mod=causal_mask, block_n=64, return_max=True,
                        sinks_dtype="fp32", split_kv=True, combine=True), archs=(90,))



def gluon_job(head_dim: int, dtype: str, score_mod=None, mask_mod=None, block_n: int = 128,
              num_stages: int = 2, return_lse: bool = True, return_max: bool = False,
              pingpong: bool = False, tma_store: bool = False, persistent: bool = False,
              head_dim_v: int | None = None, static_max: bool = False, dropout: bool = False,
              even: bool = False, dynamic: bool = False, qk_trim: bool = False,
              sinks: bool = False):
    """A compile-check builder for the Gluon forward (sm_90) of these mods, at the family's
    fixed 128-row programs and register split (``pingpong``: the consumers' turns;
    ``tma_store``: out through shared memory and TMA; ``persistent``: the persistent grid
    (``dynamic``: its work tiles from an atomic counter); ``head_dim_v``: v's head dim,
    default ``head_dim``; ``static_max``: the score_mod's bound instead of a running max, as
    GLUON_STATIC_MAX takes it at S = 16384; ``dropout``: the keep mask applied to P;
    ``even``: lengths multiples of the tiles, else ragged; ``qk_trim``: Q K^T over E's
    32-column slices alone, GLUON_QK_TRIM; ``sinks``: float32 attention sinks folded in the
    epilogue)."""
    def build(arch: int):
        score, mask = traced_mods(score_mod, mask_mod)
        domain = Domain(1, 16, 16384, 16384)  # as a call at S = 16384 decides (lengths: data)
        bound = static_score_max(score, domain) if static_max else None
        assert not static_max or bound is not None, "no static bound for this score_mod"
        spec = KernelSpec(dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v or head_dim,
                          block_m=128, block_n=block_n, num_warps=4, num_stages=num_stages,
                          has_block_mask=mask is not None, has_full_blocks=mask is not None,
                          sparse_q=128, sparse_kv=128 if mask else block_n, even_l=even,
                          even_s=even, return_lse=return_lse, gqa_group=1,
                          input_precision="ieee", target=f"cuda:{arch}",
                          template=GLUON_TEMPLATE, max_registers=MAX_REGISTERS,
                          return_max=return_max, pingpong=pingpong, tma_store=tma_store,
                          persistent=persistent or dynamic, dynamic=dynamic,
                          static_max=bound, dropout=dropout, qk_trim=qk_trim,
                          sinks_dtype="fp32" if sinks else "",
                          wide_ints=mods_int64_nodes((score, mask), domain))
        return kernel_job(spec, score, mask, gluon_kernel, gluon_signature)
    return build


# a compiled Gluon module imports triton.experimental.gluon: check these in a process that
# never ran the interpreter (tests/codegen/test_gluon_compile.py)
register("fwd_gluon_d128_bf16_dense", gluon_job(128, "bf16"), archs=(90,))
register("fwd_gluon_d128_bf16_causal", gluon_job(128, "bf16", mask_mod=causal_mask), archs=(90,))
register("fwd_gluon_d128_fp16_softcap_causal",
         gluon_job(128, "fp16", score_mod=softcap_mod, mask_mod=causal_mask, return_max=True),
         archs=(90,))
# GLUON_STATIC_MAX: softcap's bound subtracted, no running max or rescale
register("fwd_gluon_d128_bf16_softcap_causal_static",
         gluon_job(128, "bf16", score_mod=softcap_mod, mask_mod=causal_mask, static_max=True),
         archs=(90,))
# even lengths with a cheap score_mod: the partial tiles' branch must stay a branch (its
# full tiles run no mask: codegen tests read the tile loop's shortest path)
register("fwd_gluon_d128_bf16_alibi_causal_even",
         gluon_job(128, "bf16", score_mod=slopes_mod(), mask_mod=causal_mask, even=True),
         archs=(90,))
# dropout_p: the keep mask's Philox words in the consumers (counters laid out as the score tile)
register("fwd_gluon_d128_bf16_causal_dropout",
         gluon_job(128, "bf16", mask_mod=causal_mask, dropout=True), archs=(90,))
register("fwd_gluon_d256_bf16_causal_dropout",
         gluon_job(256, "bf16", mask_mod=causal_mask, block_n=64, dropout=True), archs=(90,))
# attention sinks: each row's sink joins its denominator in the epilogue (with the row max, and
# under the static max and the persistent grid's work-tile loop)
register("fwd_gluon_d128_bf16_causal_sinks",
         gluon_job(128, "bf16", mask_mod=causal_mask, return_max=True, sinks=True), archs=(90,))
register("fwd_gluon_d128_bf16_softcap_causal_static_sinks",
         gluon_job(128, "bf16", score_mod=softcap_mod, mask_mod=causal_mask, static_max=True,
                   dynamic=True, sinks=True), archs=(90,))
register("fwd_gluon_d256_bf16_dense", gluon_job(256, "bf16", block_n=64), archs=(90,))
register("fwd_gluon_d256_bf16_causal", gluon_job(256, "bf16", mask_mod=causal_mask, block_n=64),
         archs=(90,))
# padded head dims: E = 192 (256) with Ev = 128 (DeepSeek's MLA), E = 96 (128)
register("fwd_gluon_d192_ev128_bf16_causal",
         gluon_job(192, "bf16", mask_mod=causal_mask, block_n=64, num_stages=3, head_dim_v=128),
         archs=(90,))
register("fwd_gluon_d96_bf16_softcap_causal",
         gluon_job(96, "bf16", score_mod=softcap_mod, mask_mod=causal_mask), archs=(90,))
# Q K^T over E's 32-column slices alone (GLUON_QK_TRIM): 128 + 64 columns at 192, 64 + 32
# at 96
register("fwd_gluon_d192_ev128_bf16_causal_qk_trim",
         gluon_job(192, "bf16", mask_mod=causal_mask, block_n=64, num_stages=3, head_dim_v=128,
                   qk_trim=True), archs=(90,))
register("fwd_gluon_d96_bf16_softcap_causal_qk_trim",
         gluon_job(96, "bf16", score_mod=softcap_mod, mask_mod=causal_mask, qk_trim=True),
         archs=(90,))
register("fwd_gluon_d64_bf16_alibi_document",
         gluon_job(64, "bf16", score_mod=slopes_mod(), mask_mod=document_mask(),
                   num_stages=3), archs=(90,))
# the consumers' turns (kernel_options GLUON_PINGPONG) on the CI variants at both head dims
for _dim, _stages in ((64, 3), (128, 2)):
    register(f"fwd_gluon_d{_dim}_bf16_dense_pingpong",
             gluon_job(_dim, "bf16", num_stages=_stages, pingpong=True), archs=(90,))
    register(f"fwd_gluon_d{_dim}_bf16_causal_pingpong",
             gluon_job(_dim, "bf16", mask_mod=causal_mask, num_stages=_stages, pingpong=True),
             archs=(90,))
    register(f"fwd_gluon_d{_dim}_fp16_softcap_pingpong",
             gluon_job(_dim, "fp16", score_mod=softcap_mod, num_stages=_stages, return_max=True,
                       pingpong=True), archs=(90,))
    register(f"fwd_gluon_d{_dim}_bf16_document_pingpong",
             gluon_job(_dim, "bf16", mask_mod=document_mask(), num_stages=_stages,
                       pingpong=True), archs=(90,))
# out through shared memory and TMA (GLUON_TMA_STORE), alone and with the turns
register("fwd_gluon_d128_bf16_causal_tma_store",
         gluon_job(128, "bf16", mask_mod=causal_mask, tma_store=True), archs=(90,))
register("fwd_gluon_d64_fp16_softcap_pingpong_tma_store",
         gluon_job(64, "fp16", score_mod=softcap_mod, num_stages=3, return_max=True, pingpong=True,
                   tma_store=True), archs=(90,))
# the persistent grid (GLUON_PERSISTENT): dense and causal at E=128, softcap with the TMA
# store (o_smem reused across work tiles), with the turns (GLUON_PINGPONG), document at E=64
register("fwd_gluon_d128_bf16_dense_persistent", gluon_job(128, "bf16", persistent=True),
         archs=(90,))
register("fwd_gluon_d128_bf16_causal_persistent",
         gluon_job(128, "bf16", mask_mod=causal_mask, persistent=True), archs=(90,))
register("fwd_gluon_d128_fp16_softcap_causal_persistent_tma_store",
         gluon_job(128, "fp16", score_mod=softcap_mod, mask_mod=causal_mask, return_max=True,
                   tma_store=True, persistent=True), archs=(90,))
register("fwd_gluon_d128_bf16_causal_persistent_pingpong",
         gluon_job(128, "bf16", mask_mod=causal_mask, persistent=True, pingpong=True), archs=(90,))
register("fwd_gluon_d64_fp16_softcap_persistent_pingpong_tma_store",
         gluon_job(64, "fp16", score_mod=softcap_mod, num_stages=3, return_max=True, pingpong=True,
                   tma_store=True, persistent=True), archs=(90,))
register("fwd_gluon_d128_bf16_causal_persistent_dynamic",
         gluon_job(128, "bf16", mask_mod=causal_mask, dynamic=True), archs=(90,))
register("fwd_gluon_d128_bf16_dense_persistent_dynamic", gluon_job(128, "bf16", dynamic=True),
         archs=(90,))
register("fwd_gluon_d64_bf16_document_persistent",
         gluon_job(64, "bf16", mask_mod=document_mask(), num_stages=3, persistent=True),
         archs=(90,))


def gluon_bwd_job(head_dim: int, dtype: str, score_mod=None, mask_mod=None, gqa_group: int = 1,
                  stages: int = 2, early_dp: bool = False, dropout: bool = False,
                  even: bool = False, head_dim_v: int = 0, qk_trim: bool = False):
    """A compile-check builder for the Gluon backward (sm_90) of these mods, ragged lengths
    (the bounds-checked code and q, k, v read by heads) unless ``even``, 128-key programs
    (64 at E = 256: bwd_gluon_wide.tmpl) walking 64-row q tiles (``dropout``: the keep mask
    drawn again; ``head_dim_v``: v's head dim where it is not q's, E = 256 only; ``qk_trim``:
    S^T and dP^T over E's 32-column slices, GLUON_BWD_QK_TRIM)."""
    def build(arch: int):
        score, mask = traced_mods(score_mod, mask_mod)
        joint = joint_graph(score)
        block_n = keys_per_program(head_dim)  # 64 at E = 256 (bwd_gluon_wide.tmpl)
        spec = GluonBackwardSpec(dtype=dtype, head_dim=head_dim, stages=stages,
                                 has_block_mask=mask is not None,
                                 has_full_blocks=mask is not None,
                                 sparse_q=128 if mask else 64,
                                 sparse_kv=128 if mask else block_n, even_l=even,
                                 even_s=even, gqa_group=gqa_group, target=f"cuda:{arch}",
                                 early_dp=early_dp, dropout=dropout, block_n=block_n,
                                 head_dim_v=head_dim_v, qk_trim=qk_trim)
        generated = gluon_bwd_kernel(spec, joint, score, mask)
        module = get_module(generated.name, generated.key, False, lambda: generated.source)
        signature, constexprs = gluon_bwd_signature(spec, joint, score, mask)
        return CompileJob(getattr(module, generated.name), signature, constexprs,
                          spec.launch_options(), generated.name)
    return build


def gluon_rows_job(which: str, head_dim: int = 128, dtype: str = "bf16",
                   has_dlse: bool = False):
    """A compile-check builder for the Gluon backward's row kernels (``which``: the
    preprocess, the postprocess or the zeroing of ``codegen.gluon_bwd.rows_kernel``), plain
    Triton, as the runtime launches them (``row_steps``, ``zero_step``: rows per program,
    warps, the arguments of a [1, 2, 256, head_dim] call, specialized as a GPU launch is)."""
    from ..runtime.families.gluon_bwd import row_steps, zero_step

    def build(arch: int):
        spec = RowsSpec(head_dim, has_dlse, f"cuda:{arch}")
        q = torch.zeros(1, 2, 256, head_dim, dtype=TORCH_DTYPES[dtype])
        rows = torch.zeros(2, 256)
        x = Inputs(q, q, q, q, rows[None], q, rows[None] if has_dlse else None, q, q, q, {})
        pre, post = row_steps(spec, x, 256)
        step, values = {
            PRE: (pre, {"OUT": q, "DOUT": q, "LSE": rows, "DLSE": rows, "LSE2": rows,
                        "DELTA": rows, "ROW_STRIDE": 512}),
            POST: (post, {"DQ_ACC": rows, "DQ": q, "sm_scale": 0.125, "B0": 0, "H0": 0}),
            ZERO: (zero_step(spec, 2 * 256), {"DQ_ACC": rows})}[which]
        args = step.binder.bind(values)
        signature, ones, divisible = launch_specialization(
            step.kernel, rows_params()[which].signature(step.constexprs, {"input": dtype}),
            step.binder.names, args)
        return CompileJob(step.kernel, signature, step.constexprs | ones, step.options, which,
                          divisible)
    return build


register("bwd_gluon_d128_bf16_causal", gluon_bwd_job(128, "bf16", mask_mod=causal_mask),
         archs=(90,))
# E = 256 (bwd_gluon_wide.tmpl: both consumers on 64 keys, dK / dV / dQ split along E); spill
# bytes / local-memory instructions in the tile loop at registration (sm_90, Triton 3.6): 0 / 0
# dense, softcap, causal, softcap + causal, ALiBi + causal, ragged and at tile multiples, at
# 256, 192/128 and 256/128; GQA 4 causal 48 / 2 ragged, 24 / 0 even (32 / 0 at 192/128), all
# in the producer warp's 24 registers (the consumers' 240 hold everything), until the
# producer walked each head from opaque copies (OPAQUE_WALK, twenty-sixth session: 0 / 0)
register("bwd_gluon_d256_bf16_dense", gluon_bwd_job(256, "bf16"), archs=(90,))
register("bwd_gluon_d256_bf16_causal_even", gluon_bwd_job(256, "bf16", mask_mod=causal_mask,
                                                          even=True), archs=(90,))
register("bwd_gluon_d256_bf16_causal", gluon_bwd_job(256, "bf16", mask_mod=causal_mask),
         archs=(90,))
register("bwd_gluon_d256_fp16_softcap", gluon_bwd_job(256, "fp16", score_mod=softcap_mod),
         archs=(90,))
register("bwd_gluon_d256_bf16_softcap_causal_even",
         gluon_bwd_job(256, "bf16", score_mod=softcap_mod, mask_mod=causal_mask, even=True),
         archs=(90,))
register("bwd_gluon_d256_bf16_gqa_causal",
         gluon_bwd_job(256, "bf16", mask_mod=causal_mask, gqa_group=4), archs=(90,))
register("bwd_gluon_d192_bf16_causal_even",
         gluon_bwd_job(192, "bf16", mask_mod=causal_mask, even=True), archs=(90,))
# DeepSeek's MLA shape: E = 192 with Ev = 128 (dV's columns 64 a consumer)
register("bwd_gluon_d192_ev128_bf16_causal",
         gluon_bwd_job(192, "bf16", mask_mod=causal_mask, head_dim_v=128), archs=(90,))
# dropout: the keep mask of each consumer's [queries, keys] tile, kept in P's sign
register("bwd_gluon_d256_bf16_softcap_causal_dropout",
         gluon_bwd_job(256, "bf16", score_mod=softcap_mod, mask_mod=causal_mask, dropout=True),
         archs=(90,))
# a learnable relative bias (HAS_BUFFER_GRADS: one atomic add a score into its gradient)
register("bwd_gluon_d256_bf16_relbias_causal",
         gluon_bwd_job(256, "bf16", score_mod=learnable_relative_bias(),
                       mask_mod=causal_mask), archs=(90,))
# row and key biases: sums along one axis, one atomic add per element (not per register copy)
register("bwd_gluon_d256_bf16_axisbias_causal",
         gluon_bwd_job(256, "bf16", score_mod=learnable_axis_biases(), mask_mod=causal_mask),
         archs=(90,))
register("bwd_gluon_d192_ev128_bf16_softcap",
         gluon_bwd_job(192, "bf16", score_mod=softcap_mod, head_dim_v=128), archs=(90,))
register("bwd_gluon_rows_pre_d128_bf16_dlse", gluon_rows_job(PRE, has_dlse=True), archs=(90,))
register("bwd_gluon_rows_post_d128_bf16", gluon_rows_job(POST), archs=(90,))
register("bwd_gluon_rows_zero_d128_bf16", gluon_rows_job(ZERO), archs=(90,))
# dP^T with S^T (GLUON_BWD_EARLY_DP): no spills without mods, dense and causal
register("bwd_gluon_d128_bf16_dense_early_dp", gluon_bwd_job(128, "bf16", early_dp=True),
         archs=(90,))
register("bwd_gluon_d128_bf16_causal_early_dp",
         gluon_bwd_job(128, "bf16", mask_mod=causal_mask, early_dp=True), archs=(90,))
# dropout_p: the keep mask's Philox words in the consumers (counters laid out as S^T)
register("bwd_gluon_d128_bf16_causal_dropout",
         gluon_bwd_job(128, "bf16", mask_mod=causal_mask, stages=3, dropout=True), archs=(90,))
register("bwd_gluon_d64_fp16_softcap_gqa_dropout",
         gluon_bwd_job(64, "fp16", score_mod=softcap_mod, gqa_group=2, stages=3, dropout=True),
         archs=(90,))
# the deepest ring that fits at E = 128 (kernel_options GLUON_BWD_STAGES=3)
register("bwd_gluon_d128_bf16_causal_s3",
         gluon_bwd_job(128, "bf16", mask_mod=causal_mask, stages=3), archs=(90,))
register("bwd_gluon_d128_bf16_softcap_gqa", gluon_bwd_job(128, "bf16", score_mod=softcap_mod,
                                                          gqa_group=2), archs=(90,))
register("bwd_gluon_d64_fp16_alibi_document",
         gluon_bwd_job(64, "fp16", score_mod=slopes_mod(), mask_mod=document_mask(),
                       stages=3), archs=(90,))
# the heavier mods at E=128, where the consumers' 240 registers are tightest (spill bytes
# before and after in docs/gluon.md, "The Gluon backward")
register("bwd_gluon_d128_bf16_alibi_causal",
         gluon_bwd_job(128, "bf16", score_mod=slopes_mod(), mask_mod=causal_mask), archs=(90,))
register("bwd_gluon_d128_bf16_document",
         gluon_bwd_job(128, "bf16", mask_mod=document_mask()), archs=(90,))
register("bwd_gluon_d128_bf16_alibi_document",
         gluon_bwd_job(128, "bf16", score_mod=slopes_mod(), mask_mod=document_mask()),
         archs=(90,))
register("bwd_gluon_d128_fp16_softcap_causal",
         gluon_bwd_job(128, "fp16", score_mod=softcap_mod, mask_mod=causal_mask), archs=(90,))
# GQA with a block mask: each query head of the group walks its own tables (the benchmark's
# causal GQA case: Hq=32, Hkv=8)
register("bwd_gluon_d128_bf16_causal_gqa", gluon_bwd_job(128, "bf16", mask_mod=causal_mask,
                                                         gqa_group=4), archs=(90,))
register("bwd_gluon_d128_bf16_alibi_causal_gqa",
         gluon_bwd_job(128, "bf16", score_mod=slopes_mod(), mask_mod=causal_mask, gqa_group=4),
         archs=(90,))
# head dims padded to the next power of two (TMA's zero fill past E; issue 28's 96 and 80)
register("bwd_gluon_d96_bf16_softcap_causal",
         gluon_bwd_job(96, "bf16", score_mod=softcap_mod, mask_mod=causal_mask), archs=(90,))
register("bwd_gluon_d80_bf16_causal", gluon_bwd_job(80, "bf16", mask_mod=causal_mask), archs=(90,))
# S^T and dP^T over E's 32-column slices (GLUON_BWD_QK_TRIM; causal at a ragged length spills
# 4 bytes there, one local-memory instruction a tile: not a compile-check variant)
register("bwd_gluon_d96_bf16_softcap_causal_qk_trim",
         gluon_bwd_job(96, "bf16", score_mod=softcap_mod, mask_mod=causal_mask, qk_trim=True),
         archs=(90,))
register("bwd_gluon_d48_fp16_dense", gluon_bwd_job(48, "fp16", stages=3), archs=(90,))
register("bwd_gluon_rows_post_d96_bf16", gluon_rows_job(POST, head_dim=96), archs=(90,))


# ---- compile-check variants -----------------------------------------------------------------

def fp8_job(head_dim: int, score_mod=None, mask_mod=None, head_dim_v=None, use_tma=False,
            sinks_dtype: str = ""):
    """A compile-check builder: the FP8 kernel for these mods at the GPU default tiles, with
    the scale fold of ``quantize``'s inputs where it applies (no score_mod)."""
    def build(arch: int) -> CompileJob:
        score, mask = traced_mods(score_mod, mask_mod)
        block_m, block_n, warps, stages, cap = fp8_tiles(
            next_power_of_two(head_dim, FP8_MIN_DIM), parse_target(f"cuda:{arch}"), use_tma,
            next_power_of_two(head_dim_v or head_dim, FP8_MIN_DIM))
        spec = FP8KernelSpec(out_dtype="bf16", head_dim=head_dim,
                             head_dim_v=head_dim_v or head_dim, block_m=block_m,
                             block_n=block_n, num_warps=warps, num_stages=stages,
                             has_block_mask=mask is not None, has_full_blocks=mask is not None,
                             sparse_q=128, sparse_kv=128, scale_q=128, scale_kv=128,
                             even_l=False, even_s=False, return_lse=True, gqa_group=1,
                             target=f"cuda:{arch}", use_tma=use_tma, max_registers=cap,
                             fold_qk_scale=score is None, sinks_dtype=sinks_dtype)
        return kernel_job(spec, score, mask, fp8_forward_kernel,
                                        fp8_forward_signature)
    return build


FP8_ARCHS = (89, 90)  # e4m3 tensor cores: Ada (mma.sync) and Hopper (wgmma)
register("fwd_fp8_d128_dense", fp8_job(128), archs=FP8_ARCHS)
register("fwd_fp8_d128_causal", fp8_job(128, mask_mod=causal_mask),
                       archs=FP8_ARCHS)
register("fwd_fp8_d64_softcap", fp8_job(64, score_mod=softcap_mod),
                       archs=FP8_ARCHS)
register("fwd_fp8_d128_alibi_document",
                       fp8_job(128, score_mod=slopes_mod(),
                               mask_mod=document_mask()), archs=FP8_ARCHS)
register("fwd_fp8_d128_causal_tma",
                       fp8_job(128, mask_mod=causal_mask, use_tma=True), archs=(90,))
register("fwd_fp8_d128_causal_sinks", fp8_job(128, mask_mod=causal_mask, sinks_dtype="fp32"),
         archs=FP8_ARCHS)


def quantize_job(head_dim: int, dtype: str, rotate: bool, block: int = 128):
    """A compile-check builder: the quantization kernel for one head dim and input dtype,
    launched as ``flexfa.fp8.quantize`` launches it (``quantize_launch``) on q or k (rotated,
    row-contiguous output) or v (S-contiguous output) of 200 rows, its arguments specialized
    as on a GPU (``launch_specialization``)."""
    def build(arch: int) -> CompileJob:
        generated = quantize_kernel()
        module = get_module(generated.name, generated.key, False, lambda: generated.source)
        kernel = getattr(module, generated.name)
        e_pad = next_power_of_two(head_dim, FP8_MIN_DIM if rotate else 16)
        x = torch.zeros(1, 2, 200, head_dim, dtype=TORCH_DTYPES[dtype])
        out = (torch.empty(1, 2, 200, e_pad, dtype=FP8_DTYPE) if rotate
               else seq_contiguous_storage(x))
        scale = torch.empty(1, 2, -(-200 // block))
        signed_h = torch.zeros(e_pad, e_pad) if rotate else None
        names = quantize_params().names
        args, launch = quantize_launch(names, x, block, signed_h, out, scale, False)
        options = {"num_warps": launch.pop("num_warps"), "num_stages": 1}
        signature, ones, divisible = launch_specialization(
            kernel, quantize_signature(dtype, launch), names, args)
        return CompileJob(kernel, signature, launch | ones, options, generated.name, divisible)
    return build


register("fp8_quantize_d128_bf16_rotate", quantize_job(128, "bf16", True),
                       archs=FP8_ARCHS)
register("fp8_quantize_d256_fp16_rotate", quantize_job(256, "fp16", True),
                       archs=FP8_ARCHS)
register("fp8_quantize_d128_bf16_v", quantize_job(128, "bf16", False),
                       archs=FP8_ARCHS)

def backward_job(which: str, head_dim: int, dtype: str, score_mod=None, mask_mod=None,
                 head_dim_v=None, gqa_group: int = 1, deterministic: bool = False,
                 ragged: bool = True, ds: bool = False, dropout: bool = False,
                 config: tuple | None = None, use_tma: bool | None = None,
                 block_m1: int | None = None, full_walk: bool = False):
    """A compile-check builder (arch -> CompileJob) for the ``which`` ("dq" or "dkdv"; with
    ``ds`` (dQ from the stored dS): "delta", "dkdv" or "dq") kernel of these mods at the
    default GPU tiles (``config``: the backward's tuned-config tuple instead; ``use_tma``:
    kernel_options USE_TMA; ``block_m1``: kernel_options bwd_BLOCK_M1, the other tiles at their
    default), launched as the runtime's backward family launches it; example launch
    arguments are tiny CPU tensors of the right dtypes (only their types reach the
    signature). ``ragged``: lengths that are not tile multiples (the bounds-checked code);
    False: the benchmark's lengths. ``dropout``: the kernels that draw the keep mask again.
    ``full_walk`` (no ``mask_mod``): under the full-block walk's mask (kernel_options
    BWD_FULL_WALK, ``families.backward.full_walk_mask``)."""
    # launch order: dQ, dK/dV; ds: delta, dK/dV (storing dS), dQ from dS
    order = ("delta", "dkdv", "dq") if ds else ("dq", "dkdv")
    if which not in order:
        raise ValueError(f"which must be one of {order} (ds={ds}), got {which!r}")

    def build(arch: int):
        # a ragged length picks the runtime's tiles for such lengths (past 128 they differ)
        torch_dtype, hkv, length = TORCH_DTYPES[dtype], 2, 200 if ragged else 256
        q = torch.zeros(1, hkv * gqa_group, length, head_dim, dtype=torch_dtype)
        k = torch.zeros(1, hkv, length, head_dim, dtype=torch_dtype)
        v = torch.zeros(1, hkv, length, head_dim_v or head_dim, dtype=torch_dtype)
        block_mask = create_block_mask(mask_mod, None, None, length, length, device="cpu") \
            if mask_mod is not None else None
        if full_walk:
            block_mask = full_walk_mask(length, length, torch.device("cpu"))
        seed = Dropout(0.1, torch.zeros(2, dtype=torch.int64)) if dropout else None
        call = AttentionCall(prepare_score_mod(score_mod), prepare_mask(block_mask), block_mask,
                             0.125, KernelOptions(deterministic=deterministic,
                                                  bwd=PassOptions(use_tma=use_tma,
                                                                  block_m1=block_m1)),
                             gqa_group,
                             dropout=seed)
        spec = backward_spec(q, k, v, call, has_dlse=True, target=parse_target(f"cuda:{arch}"),
                             config=config, force_ds=ds)
        if ragged:  # lengths that are not tile multiples: the bounds-checked code paths
            spec = dataclasses.replace(spec, even_l1=False, even_s1=False, even_l2=False,
                                       even_s2=False)
        joint = joint_graph(call.score)
        out, lse = torch.zeros_like(q[..., :v.shape[3]]), torch.zeros(q.shape[:3])
        grads = {s: torch.zeros(call.score.buffers[s].shape,
                                dtype=torch.int64 if deterministic else torch.float32)
                 for s in (joint.grad_slots if joint else ())}
        inputs = Inputs(q, k, v, out, lse, out, lse, q, k, v, grads)
        plan = BACKWARD.make_plan(spec, call, inputs, joint)
        step = plan.steps[order.index(which)]
        args = step_args(plan, call, inputs)[order.index(which)]
        generated = backward_kernel(spec, joint, call.score, call.mask)
        params = generated.kernel_params(step.kernel.fn.__name__)
        signature, ones, divisible = launch_specialization(
            step.kernel, launch_signature(params, args), params.names, args)
        return CompileJob(step.kernel, signature, step.constexprs | ones, step.options,
                          generated.name, divisible)
    return build


def launch_specialization(kernel, signature: dict[str, str], names, args
                          ) -> tuple[dict, dict, tuple]:
    """``signature`` specialized on ``args`` as Triton's launcher does on a GPU launch of
    ``kernel``: ints equal to 1 (a contiguous tensor's last stride) become constexprs,
    16-byte aligned pointers and ints divisible by 16 are compiled as such, except the
    kernel's ``do_not_specialize`` parameters. Unspecialized, the tiles' stores are per
    element with a 64-bit address each, registers no launch ever uses. Returns the
    signature, the constexprs it adds and the names of the divisible arguments."""
    kept = {p.name for p in kernel.params if p.do_not_specialize}
    ones, divisible = {}, []
    for name, value in zip(names, args):
        if name in kept or isinstance(value, bool) or not isinstance(value, (int, torch.Tensor)):
            continue
        if isinstance(value, torch.Tensor):
            if value.data_ptr() % 16 == 0:
                divisible.append(name)
        elif value == 1:
            ones[name] = 1
        elif value % 16 == 0:
            divisible.append(name)
    return signature | {name: "constexpr" for name in ones}, ones, tuple(divisible)


def _register_backward() -> None:
    bias = torch.zeros(4, 256, 256, requires_grad=True)

    def learnable_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx, kv_idx]

    variants = {
        "d64_bf16_dense": dict(head_dim=64, dtype="bf16"),
        "d128_bf16_softcap_causal": dict(head_dim=128, dtype="bf16", score_mod=softcap_mod,
                                         mask_mod=causal_mask),
        "d64_fp16_bias_deterministic": dict(head_dim=64, dtype="fp16", score_mod=learnable_bias,
                                            deterministic=True),
        "d80_bf16_ev48_gqa_causal": dict(head_dim=80, dtype="bf16", mask_mod=causal_mask,
                                         head_dim_v=48, gqa_group=2),
        "d128_bf16_causal_dropout": dict(head_dim=128, dtype="bf16", mask_mod=causal_mask,
                                         dropout=True),
        "d64_fp16_dense_dropout": dict(head_dim=64, dtype="fp16", dropout=True),
    }
    for label, kwargs in variants.items():
        for which in ("dkdv", "dq"):
            register(f"bwd_{which}_{label}", backward_job(which, **kwargs))
    # dQ from the stored dS (the sm_90 default at head dim 128): dK/dV storing dS, dQ from it
    for which in ("dkdv", "dq"):
        register(f"bwd_ds_{which}_d128_bf16_causal",
                       backward_job(which, 128, "bf16", mask_mod=causal_mask, ds=True))
        register(f"bwd_ds_{which}_d128_bf16_causal_dropout",
                 backward_job(which, 128, "bf16", mask_mod=causal_mask, ds=True, dropout=True))


_register_hopper()
_register_backward()


# ---- the decode family ----------------------------------------------------------------------

def decode_job(head_dim: int, dtype: str, group: int, q_len: int, score_mod=None,
               mask_mod=None, per_head_mask: bool = False, paged: bool = False,
               splits: bool = False, combine: bool = False, walk: str = "AUTO",
               sinks: bool = False):
    """A compile-check builder for the decode kernel (or, with ``combine``, its combine
    kernel) as the runtime plans it: ``group`` query heads per kv head, ``q_len`` rows, a paged
    cache with per-sequence lengths (positions from them) or a contiguous one; ``walk`` the
    kernel option DECODE_WALK (a per-head mask or rows across q blocks: the union walk by
    default); ``sinks``: float32 attention sinks (HAS_SINKS)."""
    def build(arch: int) -> CompileJob:
        torch_dtype, hkv, length, page = TORCH_DTYPES[dtype], 2, 1024, 64
        q = torch.zeros(1, hkv * group, q_len, head_dim, dtype=torch_dtype)
        if paged:
            k = torch.zeros(length // page, page, hkv, head_dim, dtype=torch_dtype)
            inputs = DecodeInputs(kv_lens=torch.zeros(1, dtype=torch.int32),
                                  page_table=torch.zeros(1, length // page, dtype=torch.int32),
                                  page_size=page)
        else:
            k = torch.zeros(1, hkv, length, head_dim, dtype=torch_dtype)
            inputs = DecodeInputs()
        q_positions = length if inputs.offsets else q_len
        block_mask = create_block_mask(mask_mod, None, hkv * group if per_head_mask else None,
                                       q_positions, length, device="cpu") \
            if mask_mod is not None else None
        call = AttentionCall(prepare_score_mod(score_mod), prepare_mask(block_mask), block_mask,
                             0.125, KernelOptions(decode_walk=walk), group,
                             sinks=torch.zeros(hkv * group) if sinks else None)
        spec = decode_spec(q, k, k, call, parse_target(f"cuda:{arch}"), inputs, True, False,
                           write_parts=splits)
        if not combine:
            return kernel_job(spec, call.score, call.mask, decode_kernel, decode_signature)
        generated = decode_kernel(spec, call.score, call.mask)
        module = get_module(generated.name, generated.key, False, lambda: generated.source)
        signature, constexprs = decode_signature(spec, call.score, call.mask, combine=True)
        return CompileJob(getattr(module, f"{generated.name}_combine"), signature, constexprs,
                          {"num_warps": 4, "num_stages": 1}, f"{generated.name}_combine")
    return build


register("decode_d128_bf16_g4_l1_dense_split", decode_job(128, "bf16", 4, 1, splits=True))
register("decode_d128_bf16_g5_l3_paged_causal",
         decode_job(128, "bf16", 5, 3, score_mod=softcap_mod, mask_mod=causal_mask, paged=True,
                    splits=True))
register("decode_d64_fp16_g8_l16_per_head_alibi",
         decode_job(64, "fp16", 8, 16, score_mod=slopes_mod(), mask_mod=causal_mask,
                    per_head_mask=True))
# rows across two q blocks, per-head tables: the union walk, and each member in turn
register("decode_d128_bf16_g4_l3_paged_per_head_union",
         decode_job(128, "bf16", 4, 3, score_mod=softcap_mod, mask_mod=causal_mask,
                    per_head_mask=True, paged=True, splits=True))
register("decode_d128_bf16_g4_l3_paged_per_head_members",
         decode_job(128, "bf16", 4, 3, score_mod=softcap_mod, mask_mod=causal_mask,
                    per_head_mask=True, paged=True, splits=True, walk="MEMBERS"))
register("decode_combine_d128_bf16_g4_l1", decode_job(128, "bf16", 4, 1, splits=True,
                                                      combine=True))


# ---- the varlen block mask's table kernels --------------------------------------------------

def varlen_tables_job(which: str, block: tuple[int, int] = (128, 128), causal: bool = True,
                      window: bool = False, check: bool = False, offsets: str = "i32"):
    """A compile-check builder for ``varlen_check``, ``varlen_rows`` or ``varlen_columns``
    (blockmask/varlen_kernels.py) as ``varlen_tables`` launches them; ``offsets``: the
    caller's offsets' type where a kernel reads them as given (``varlen_check``, ``check``)."""
    from ..blockmask.offsets import PAD_DOC_K, PAD_DOC_Q
    from ..blockmask.varlen_tables import CHUNK, TOKENS, kernels

    def build(arch: int) -> CompileJob:
        kernel = getattr(kernels(interpret=False), which)
        if which == "varlen_rows":
            constexprs = dict(BLOCK_Q=block[0], BLOCK_KV=block[1],
                              ROWS=next_power_of_two(block[0], 1), CHUNK=CHUNK, TOKENS=TOKENS,
                              CAUSAL=causal, WINDOW=window, PAD_DOC_Q=PAD_DOC_Q,
                              PAD_DOC_K=PAD_DOC_K, CHECK=check)
            ints = ("documents", "steps", "total_q", "total_k", "window", "q_tiles", "kv_tiles",
                    "q_length", "k_length")
        elif which == "varlen_check":
            constexprs, ints = dict(CHUNK=TOKENS), ("documents", "total_q", "total_k")
        else:
            constexprs, ints = dict(CHUNK=CHUNK), ("q_tiles", "kv_tiles")
        given = which == "varlen_check" or check
        signature = {name: "constexpr" if name in constexprs else "i32" if name in ints
                     else f"*{offsets}" if given and name in ("cu_q", "cu_k") else "*i32"
                     for name in kernel.arg_names}
        return CompileJob(kernel, signature, constexprs, {"num_warps": 4, "num_stages": 1},
                          which)
    return build


register("varlen_rows_causal_128", varlen_tables_job("varlen_rows"))
register("varlen_rows_window_48x80", varlen_tables_job("varlen_rows", (48, 80), False, True))
# the offsets' checks inside the rows kernel (totals given), on int64 offsets as given
register("varlen_rows_checked_causal_128_i64",
         varlen_tables_job("varlen_rows", check=True, offsets="i64"))
register("varlen_columns", varlen_tables_job("varlen_columns"))
register("varlen_check_i32", varlen_tables_job("varlen_check"))
register("varlen_check_i64", varlen_tables_job("varlen_check", offsets="i64"))
# attention sinks: in the kernel's epilogue (no splits) and in the combine kernel (splits)
register("decode_d128_bf16_g4_l3_paged_causal_sinks",
         decode_job(128, "bf16", 4, 3, score_mod=softcap_mod, mask_mod=causal_mask, paged=True,
                    sinks=True))
register("decode_combine_d128_bf16_g4_l1_sinks", decode_job(128, "bf16", 4, 1, splits=True,
                                                            combine=True, sinks=True))
