"""The Gluon forward (``fwd_gluon.tmpl``, FlashAttention-3's structure on sm_90): filling it,
its parameters and its compile checks.

The module is built like the Triton forwards' (``forward_module``: the spec's flags, the
helpers and the kernel libraries filled with the rendered mods, then the template), so the
mods are rendered by the same renderer into the same library functions; Gluon runs them on
its distributed tensors. Two things differ: a mod's value that is not a tile by itself is
broadcast in the score tile's layout (``GLUON_TILE``), the template adds the flags
``STAGES``, ``PINGPONG``, ``TMA_STORE``, ``PERSISTENT``, ``STATIC_MAX`` (with its bound
``STATIC_MAX2``) and ``QK_TRIM``, the work-tile count's factor
``BATCH_HEADS`` and, with ``TMA_STORE``, the output's descriptor ``O_DESC``. Gluon modules
are compiled only (no interpreter): they import ``triton.experimental.gluon``, whose
standard library cannot be imported where ``triton.language`` was decorated for the
interpreter.
"""
from __future__ import annotations

from ..frontend.trace import TracedMod
from .forward import GeneratedKernel, buffer_params, forward_module, module_flags
from .hopper import kv_heads
from .params import (DESCRIPTOR, INPUT, KernelParams, Param, constexprs, feature_params,
                     forward_params, ints, tensors)
from .spec import KernelSpec, next_power_of_two, spec_key
from .template import template_hash
from .versions import versions_key

GLUON_TEMPLATE = "fwd_gluon"
GLUON_TEMPLATES = ("fwd_gluon.tmpl", "helpers.tmpl", "gluon_common.tmpl", "common.tmpl",
                   "fwd_common.tmpl")
GLUON_TILE = "gl.full([ROWS, BLOCK_N], {fill}, {dtype}, S_LAYOUT)"
CONSUMERS = 2  # consumer warpgroups per program (fwd_gluon.tmpl's CONSUMERS)
CONSUMER_ROWS = 64  # query rows of one consumer warpgroup (one wgmma M)
# registers per thread at launch: 1 consumer warpgroup (the default partition), 1 consumer
# worker at 240 and the producer warp's warpgroup at 24 share 65536 registers: 168 * 384
# threads, leaving 240 to the default partition
MAX_REGISTERS = 168


def gluon_params(score: TracedMod | None, mask: TracedMod | None, tma_store: bool,
                 dropout: bool = False, dynamic: bool = False,
                 sinks_dtype: str = "") -> KernelParams:
    """The Hopper forward's parameters (descriptors, outputs, tables, lengths, captured
    tensors; with ``dropout`` the seed, threshold and scale of ``feature_params``, with
    ``sinks_dtype`` its SINKS) plus, with
    ``tma_store``, the output's descriptor ``O_DESC``, ``BATCH_HEADS``
    (B * HQ: the persistent grid's work tiles are q tiles times it), with ``dynamic`` the
    tile counter ``TILE_COUNTER``, and the ring depth
    ``STAGES``, the flags ``PINGPONG``, ``TMA_STORE``, ``PERSISTENT``, ``STATIC_MAX``
    with its bound ``STATIC_MAX2`` (log2 units) and ``QK_TRIM``."""
    base = forward_params(True, buffer_params(score, mask),
                          features=feature_params(sinks_dtype, dropout))
    out_desc = (Param("O_DESC", DESCRIPTOR, INPUT, ("BLOCK_M", "EV_PAD")),) if tma_store else ()
    counter = tensors("i32", "TILE_COUNTER") if dynamic else ()
    return KernelParams((base.groups[0] + out_desc, *base.groups[1:-1],
                         ints("BATCH_HEADS") + counter,
                         base.groups[-1] + constexprs("STAGES", "PINGPONG", "TMA_STORE",
                                                      "PERSISTENT", "DYNAMIC", "STATIC_MAX",
                                                      "STATIC_MAX2", "QK_TRIM")))


def trims_columns(E: int) -> bool:
    """Whether QK_TRIM changes a kernel at head dim E: E's 32-column slices
    (gluon_common.tmpl's TRIM_COLS) are fewer than its power of two's (80, 96, 160, 192,
    224); the families set it only there, so other head dims compile no second kernel."""
    return -(-E // 32) * 32 < next_power_of_two(E)


def gluon_constexprs(spec: KernelSpec, has_score_mod: bool) -> dict[str, object]:
    # the Hopper parameter list's STRIDED_QKV and SPLIT_KV: this kernel reads flat
    # [B * H * len, dim] rows, all keys of a row in one program
    return dict(spec.constexprs(has_score_mod), STRIDED_QKV=False, SPLIT_KV=False,
                HAS_SINKS=bool(spec.sinks_dtype), DROPOUT=spec.dropout,
                STAGES=spec.num_stages, PINGPONG=spec.pingpong,
                TMA_STORE=spec.tma_store, PERSISTENT=spec.persistent, DYNAMIC=spec.dynamic,
                STATIC_MAX=spec.static_max is not None,
                STATIC_MAX2=(spec.static_max or 0.0) * 1.4426950408889634,
                QK_TRIM=spec.qk_trim)


def gluon_key(spec: KernelSpec, score: TracedMod | None, mask: TracedMod | None) -> str:
    return spec_key(spec, score.key if score else "-", mask.key if mask else "-",
                    versions_key(), template_hash(*GLUON_TEMPLATES))


def gluon_kernel(spec: KernelSpec, score: TracedMod | None, mask: TracedMod | None
                 ) -> GeneratedKernel:
    """Key, name (``flexfa_fwd_gluon_d128_bf16_<hash>``) and source of the Gluon forward."""
    assert spec.template == GLUON_TEMPLATE, f"spec is for template {spec.template!r}"
    assert not spec.interpret, "the Gluon forward is compiled only, never interpreted"
    assert spec.block_m == CONSUMERS * CONSUMER_ROWS, (
        f"BLOCK_M={spec.block_m}: the Gluon forward's programs have {CONSUMERS} consumers of "
        f"{CONSUMER_ROWS} rows")
    return forward_module(spec, score, mask, gluon_key(spec, score, mask), "fwd_gluon.tmpl",
                          gluon_params(score, mask, spec.tma_store, spec.dropout, spec.dynamic,
                                       spec.sinks_dtype),
                          module_flags(gluon_constexprs(spec, True)),
                          helpers=("helpers.tmpl", "gluon_common.tmpl"), tile=GLUON_TILE)


def descriptor_layout(block: list[int], dtype: str):
    """The NVMMA shared layout of a descriptor block (Gluon descriptors carry it)."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for(
        block, {"bf16": gl.bfloat16, "fp16": gl.float16, "fp32": gl.float32}[dtype])


def descriptor_blocks(spec: KernelSpec) -> dict[str, list[int]]:
    """The block shape of each descriptor argument (q, k, v, and out with ``tma_store``):
    at a ragged S (``kv_heads``) K's and V's are [1, BLOCK_N, dim] blocks of their
    [B * HKV, S, dim] heads."""
    heads = [1] if kv_heads(spec) else []
    return {"Q_DESC": [spec.block_m // CONSUMERS, spec.head_dim_pad],
            "K_DESC": heads + [spec.block_n, spec.head_dim_pad],
            "V_DESC": heads + [spec.block_n, spec.head_dim_v_pad],
            **({"O_DESC": [spec.block_m // CONSUMERS, spec.head_dim_v_pad]}
               if spec.tma_store else {})}


def gluon_signature(spec: KernelSpec, score: TracedMod | None, mask: TracedMod | None
                    ) -> tuple[dict[str, str], dict[str, object]]:
    """(signature, constexprs) of the Gluon forward, for ``triton.compile(GluonASTSource(
    ...))``: a Gluon descriptor's type names its shared layout."""
    constexprs_ = gluon_constexprs(spec, score is not None)
    params = gluon_params(score, mask, spec.tma_store, spec.dropout, spec.dynamic,
                          spec.sinks_dtype)
    signature = params.signature(constexprs_, {INPUT: spec.dtype})
    for name, block in descriptor_blocks(spec).items():
        if name in signature:
            signature[name] = descriptor_type(block, spec.dtype)
    return signature, constexprs_


def descriptor_type(block: list[int], dtype: str) -> str:
    """Triton's type string of a Gluon descriptor with this block (from a descriptor over a
    small CPU tensor: the type depends on the block, dtype and layout only)."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    from .spec import TORCH_DTYPES

    base = torch.zeros(block, dtype=TORCH_DTYPES[dtype])
    return mangle_type(TensorDescriptor(base, list(base.shape), list(base.stride()), block,
                                        descriptor_layout(block, dtype)))
