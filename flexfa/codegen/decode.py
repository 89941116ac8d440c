"""The decode template: ``DecodeSpec`` and filling ``fwd_decode.tmpl`` (through
``flexfa.codegen.forward.forward_module``, so the mods, the kernel library and the forward
library are the ones every forward kernel has).

The module holds two kernels: ``<name>`` (one program per batch * kv head and split, the GQA
group's query heads and rows packed into the tile's rows) and ``<name>_combine`` (the splits
combined by their lse, launched only when there are several).
"""
from __future__ import annotations

import dataclasses

from ..frontend.trace import TracedMod
from .forward import GeneratedKernel, buffer_params, forward_module
from .params import INPUT, decode_combine_params, decode_params, feature_params
from .spec import TORCH_DTYPES, PaddedDims, launch_options, spec_key
from .template import template_hash
from .versions import versions_key

DECODE_TEMPLATE = "fwd_decode"
DECODE_TEMPLATES = ("fwd_decode.tmpl", "helpers.tmpl", "common.tmpl", "fwd_common.tmpl")
# q_idx of the mods (fwd_decode.tmpl's OFFSETS): rows from 0, the last Q_LEN keys of each
# sequence, or a per-sequence offset tensor
OFFSETS_NONE, OFFSETS_FROM_LENS, OFFSETS_TENSOR = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class DecodeSpec(PaddedDims):
    """A decode-kernel variant; rendering is a pure function of (mods' IR, spec)."""

    dtype: str  # "fp16" | "bf16" | "fp32"
    head_dim: int
    head_dim_v: int
    block_m: int  # packed rows: a power of two >= 16 and >= gqa_group * q_len
    block_n: int
    num_warps: int
    num_stages: int
    q_len: int
    gqa_group: int
    has_block_mask: bool
    has_full_blocks: bool
    sparse_q: int
    sparse_kv: int
    table_g: int  # block-mask heads per kv head: gqa_group (per-head tables) or 1
    qb_span: int  # q blocks a program's rows can touch
    even_s: bool  # every sequence has S keys, a multiple of the key tile (and mask block)
    return_lse: bool
    return_max: bool
    input_precision: str
    target: str
    offsets: int = OFFSETS_NONE
    has_kv_lens: bool = False
    paged: bool = False
    page_size: int = 0
    write_parts: bool = False  # split-KV: the workspaces, combined by the second kernel
    union_walk: bool = False  # walk the union of the group's block-mask members (UNION_*)
    wide_ints: tuple[str, ...] = ()
    template: str = DECODE_TEMPLATE
    max_registers: int = 0
    sinks_dtype: str = ""  # HAS_SINKS: the sinks' element type (as KernelSpec.sinks_dtype)

    def __post_init__(self):
        assert self.dtype in TORCH_DTYPES, self.dtype
        assert self.block_m >= self.gqa_group * self.q_len, (
            f"block_m {self.block_m} < {self.gqa_group} heads x {self.q_len} rows")
        assert self.sparse_kv % self.block_n == 0, (self.sparse_kv, self.block_n)
        assert self.has_block_mask or not self.union_walk, "the union walk needs a block mask"
        assert not self.paged or self.page_size % self.block_n == 0, (
            f"page size {self.page_size} is not a multiple of the key tile {self.block_n}")


    def constexprs(self, has_score_mod: bool) -> dict[str, object]:
        """The main kernel's constexpr arguments (also the module's flags, but
        HAS_SCORE_MOD)."""
        return dict(
            BLOCK_M=self.block_m, BLOCK_N=self.block_n, E=self.head_dim, E_PAD=self.head_dim_pad,
            EV=self.head_dim_v, EV_PAD=self.head_dim_v_pad, HAS_SCORE_MOD=has_score_mod,
            HAS_BLOCK_MASK=self.has_block_mask, HAS_FULL_BLOCKS=self.has_full_blocks,
            SPARSE_Q=self.sparse_q, SPARSE_KV=self.sparse_kv, EVEN_S=self.even_s,
            RETURN_LSE=self.return_lse, RETURN_MAX=self.return_max, GQA_GROUP=self.gqa_group,
            Q_LEN=self.q_len, TABLE_G=self.table_g, QB_SPAN=self.qb_span, OFFSETS=self.offsets,
            HAS_KV_LENS=self.has_kv_lens, PAGED=self.paged, PAGE_SIZE=self.page_size,
            WRITE_PARTS=self.write_parts, UNION_WALK=self.union_walk,
            INPUT_PRECISION=self.input_precision,
            DOT_IN_FP32=self.interpret and self.dtype == "bf16", HAS_SINKS=bool(self.sinks_dtype))

    def combine_constexprs(self) -> dict[str, object]:
        names = decode_combine_params(self.features).constexpr_names
        return {n: v for n, v in self.constexprs(False).items() if n in names}

    @property
    def features(self):
        """The kernels' feature parameters (``params.feature_params``: the sinks)."""
        return feature_params(self.sinks_dtype, False)

    def launch_options(self) -> dict[str, int]:
        return launch_options(self)


def decode_key(spec: DecodeSpec, score: TracedMod | None, mask: TracedMod | None) -> str:
    return spec_key(spec, score.key if score else "-", mask.key if mask else "-",
                    versions_key(), template_hash(*DECODE_TEMPLATES))


def decode_kernel(spec: DecodeSpec, score: TracedMod | None, mask: TracedMod | None
                  ) -> GeneratedKernel:
    """Key, name (``flexfa_fwd_decode_d128_bf16_<hash>``) and source of the decode module."""
    flags = {n: v for n, v in spec.constexprs(True).items() if n != "HAS_SCORE_MOD"}
    return forward_module(spec, score, mask, decode_key(spec, score, mask), "fwd_decode.tmpl",
                          decode_params(buffer_params(score, mask), spec.features), flags,
                          others=(("DEF_COMBINE", "combine",
                                   decode_combine_params(spec.features)),))


def decode_signature(spec: DecodeSpec, score: TracedMod | None, mask: TracedMod | None,
                     combine: bool = False) -> tuple[dict[str, str], dict[str, object]]:
    """(signature, constexprs) of the decode kernel (or its combine kernel), for
    ``triton.compile(ASTSource(...))``."""
    if combine:
        constexprs = spec.combine_constexprs()
        return (decode_combine_params(spec.features).signature(constexprs, {INPUT: spec.dtype}),
                constexprs)
    constexprs = spec.constexprs(score is not None)
    params = decode_params(buffer_params(score, mask), spec.features)
    return params.signature(constexprs, {INPUT: spec.dtype}), constexprs
