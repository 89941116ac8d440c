"""The Gluon backward (``bwd_gluon.tmpl``, FlashAttention-3's backward on sm_90; at head dims
padding to 256 ``bwd_gluon_wide.tmpl``, both consumers on the same 64 keys; both with
``bwd_gluon_shared.tmpl``'s producer and tile walk) and the row kernels around it
(``bwd_gluon_rows.tmpl``): filling them, their parameters and their compile checks.

The Gluon module is built like the Gluon forward's: helpers, the Gluon library, the kernel
library with the mask_mod, then the template with the score_mod's joint graph rendered as for
the Triton backward (``score_joint_code``) and broadcasts in the transposed score tile's layout
(``GLUON_TILE_T``). The row kernels are a small plain-Triton module (the interpreter runs them
too): the preprocess writes the padded lse2 and delta rows the Gluon kernel reads by TMA, the
postprocess scales and casts the fp32 dQ accumulator.
"""
from __future__ import annotations

import dataclasses

from ..frontend.grad import JointGraph
from ..frontend.trace import TracedMod
from .backward import (buffer_grad_code, dscore_is_one, grad_buffer_args, has_buffer_grads,
                       joint_key, score_joint_code)
from .forward import GeneratedKernel, buffer_params, describe_mods, mask_mod_code, mod_buffer_args
from .gluon import MAX_REGISTERS, descriptor_type, descriptor_layout
from .params import (DESCRIPTOR, FLOAT, INPUT, KernelParams, Param, as_tuple, block_mask_tables,
                     constexprs, def_kernel, feature_params, gradients, ints, strides,
                     table_names, tensors, unpack)
from .spec import INTERPRET, next_power_of_two, spec_key
from .template import fill, load_template, module_source, template_hash
from .versions import versions_key

GLUON_BWD_TEMPLATES = ("bwd_gluon.tmpl", "bwd_gluon_wide.tmpl", "bwd_gluon_shared.tmpl",
                       "helpers.tmpl", "gluon_common.tmpl", "common.tmpl")
ROWS_TEMPLATES = ("bwd_gluon_rows.tmpl", "helpers.tmpl", "common.tmpl")
# a full transposed score tile of one value (bwd_gluon.tmpl's S_LAYOUT)
GLUON_TILE_T = "gl.full([KEYS, BLOCK_M], {fill}, {dtype}, S_LAYOUT)"
# a consumer's score columns at E = 256 (bwd_gluon_wide.tmpl's S_LAYOUT)
GLUON_TILE_WIDE = "gl.full([BLOCK_M, SPLIT], {fill}, {dtype}, S_LAYOUT)"
CONSUMERS = 2  # bwd_gluon.tmpl's consumer warpgroups
KEYS = 64  # keys of one consumer (one wgmma M)
BLOCK_M = 64  # query rows of a walked tile
BLOCK_N = CONSUMERS * KEYS  # keys per program
# bwd_gluon_wide.tmpl (head dims padding to 256): both consumers on the same 64 keys
WIDE_HEAD_DIM = 256
BLOCK_N_WIDE = 64


@dataclasses.dataclass(frozen=True)
class GluonBackwardSpec:
    """Everything that selects a Gluon backward kernel; rendering is a pure function of
    (joint IR, mask IR, spec)."""

    dtype: str  # "fp16" | "bf16"
    head_dim: int  # q, k, v alike (padding to 64, 128 or 256)
    stages: int  # the Q/dO ring depth
    has_block_mask: bool
    has_full_blocks: bool
    sparse_q: int  # the walked q block (BLOCK_M without a block mask)
    sparse_kv: int
    even_l: bool  # L % sparse_q == 0
    even_s: bool  # S % BLOCK_N == 0
    gqa_group: int
    target: str
    wide_ints: tuple[str, ...] = ()
    block_m: int = BLOCK_M
    block_n: int = BLOCK_N
    max_registers: int = MAX_REGISTERS
    early_dp: bool = False  # dP^T issued with S^T (kernel_options GLUON_BWD_EARLY_DP)
    dropout: bool = False  # the forward's keep mask drawn again (the templates' DROPOUT)
    # v's (and dO's) head dim where it differs from q's (bwd_gluon_wide.tmpl only: E = 192
    # or 256 with Ev = 128, DeepSeek's MLA); 0: the same
    head_dim_v: int = 0
    # S^T and dP^T over E's 32-column slices alone (kernel_options GLUON_BWD_QK_TRIM;
    # gluon_common.tmpl's flexfa_gluon_kt; bwd_gluon.tmpl only, set where they are fewer than
    # E_PAD's: the wide kernel's QK_TRIM is always on)
    qk_trim: bool = False

    def __post_init__(self):
        assert self.sparse_q % self.block_m == 0 and self.sparse_kv % self.block_n == 0, (
            f"block-mask blocks ({self.sparse_q}, {self.sparse_kv}) are not multiples of the "
            f"tiles ({self.block_m}, {self.block_n})")
        assert not (self.early_dp and self.dropout), "EARLY_DP's dP^T starts from -delta"
        assert not self.wide or (self.block_n == BLOCK_N_WIDE and not self.early_dp
                                 and not self.qk_trim), f"E = 256: {self}"
        assert self.ev == self.head_dim or (
            self.wide and next_power_of_two(self.ev) in (128, WIDE_HEAD_DIM)), (
            f"Ev={self.ev} with E={self.head_dim}")

    @property
    def ev(self) -> int:
        """v's head dim."""
        return self.head_dim_v or self.head_dim

    @property
    def wide(self) -> bool:
        """bwd_gluon_wide.tmpl's kernel (head dims padding to 256), else bwd_gluon.tmpl's."""
        return next_power_of_two(self.head_dim) == WIDE_HEAD_DIM

    @property
    def interpret(self) -> bool:
        return self.target == INTERPRET

    def constexprs(self, dscore_one: bool, buffer_grads: bool = False) -> dict[str, object]:
        """``buffer_grads``: the score_mod's captured tensors want gradients (the templates'
        HAS_BUFFER_GRADS)."""
        return dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, E=self.head_dim,
                    E_PAD=next_power_of_two(self.head_dim), EV=self.ev,
                    EV_PAD=next_power_of_two(self.ev), HAS_BLOCK_MASK=self.has_block_mask,
                    HAS_FULL_BLOCKS=self.has_full_blocks, SPARSE_Q=self.sparse_q,
                    SPARSE_KV=self.sparse_kv, EVEN_L=self.even_l, EVEN_S=self.even_s,
                    GQA_GROUP=self.gqa_group, DSCORE_IS_ONE=dscore_one, STAGES=self.stages,
                    EARLY_DP=self.early_dp, DROPOUT=self.dropout,
                    # the wide kernel's Q K^T always over E's 32-column slices
                    QK_TRIM=self.qk_trim or self.wide, HAS_BUFFER_GRADS=buffer_grads)

    def launch_options(self) -> dict[str, int]:
        return {"num_warps": 4, "num_stages": 1, "maxnreg": self.max_registers}


def descriptor_blocks(spec: GluonBackwardSpec) -> dict[str, tuple[list[int], str]]:
    """Each descriptor argument's (block shape, element type): at a ragged L (S) Q's and
    dO's (K's and V's) are [1, rows, E] blocks of their [B * H, n, E] heads (bwd_gluon.tmpl's
    Bounds)."""
    e_pad, ev_pad = next_power_of_two(spec.head_dim), next_power_of_two(spec.ev)
    rows = [1] * (not spec.even_l) + [spec.block_m]
    # K and V by consumer (bwd_gluon.tmpl) or whole (bwd_gluon_wide.tmpl's KV_ROWS)
    keys = [1] * (not spec.even_s) + [spec.block_n // (1 if spec.wide else CONSUMERS)]
    blocks = {"Q_DESC": (rows + [e_pad], spec.dtype), "DO_DESC": (rows + [ev_pad], spec.dtype),
              "K_DESC": (keys + [e_pad], spec.dtype), "V_DESC": (keys + [ev_pad], spec.dtype),
              "LSE_DESC": ([1, spec.block_m], "fp32"), "DELTA_DESC": ([1, spec.block_m], "fp32")}
    if not spec.wide:  # (the wide kernel adds dQ by atomics: no descriptor)
        # each consumer reduces its columns of the tile's dQ (bwd_gluon.tmpl's DQ_COLS)
        blocks["DQ_DESC"] = ([spec.block_m, e_pad // CONSUMERS], "fp32")
    return blocks


def gluon_bwd_params(score: TracedMod | None, mask: TracedMod | None,
                     dropout: bool = False, wide: bool = False,
                     joint: JointGraph | None = None) -> KernelParams:
    """bwd_gluon.tmpl's kernel: descriptors (their blocks from ``descriptor_blocks``), dK,
    dV, the transposed q tables, lengths, the scale, the mods' captured tensors, the fp32
    gradient accumulators of those that want one (``joint``'s grad slots) and, with
    ``dropout``, the seed, threshold and scale of ``feature_params``; ``wide``
    (bwd_gluon_wide.tmpl): the fp32 dQ accumulator DQ_ACC as a pointer, not a descriptor."""
    names = (("Q_DESC", INPUT), ("DO_DESC", INPUT), ("K_DESC", INPUT), ("V_DESC", INPUT),
             ("LSE_DESC", "fp32"), ("DELTA_DESC", "fp32")) + ((("DQ_DESC", "fp32"),) * (not wide))
    descriptors = tuple(Param(name, DESCRIPTOR, dtype, ("BLOCK_M", "E_PAD"))
                        for name, dtype in names)
    accumulator = tensors("fp32", "DQ_ACC") if wide else ()
    return KernelParams((
        descriptors + accumulator + tensors(INPUT, "DK", "DV"), strides("dk", "bhnd"),
        strides("dv", "bhnd"),
        *block_mask_tables("Q", "n", "m"),
        ints("HQ", "L", "S", "L_PAD", "HQ_CHUNK", "B0", "HKV0") + (Param("sm_scale", FLOAT),)
        + buffer_params(score, mask) + gradients(grad_buffer_args(joint, score).values(), "fp32")
        + feature_params("", dropout),
        constexprs("BLOCK_M", "BLOCK_N", "E", "E_PAD", "EV", "EV_PAD", "HAS_BLOCK_MASK",
                   "HAS_FULL_BLOCKS",
                   "SPARSE_Q", "SPARSE_KV", "EVEN_L", "EVEN_S", "GQA_GROUP", "DSCORE_IS_ONE",
                   "STAGES", "EARLY_DP", "DROPOUT", "QK_TRIM", "HAS_BUFFER_GRADS")))


def gluon_bwd_key(spec: GluonBackwardSpec, joint: JointGraph | None, score: TracedMod | None,
                  mask: TracedMod | None) -> str:
    return spec_key(spec, score.key if score else "-", joint_key(joint),
                    mask.key if mask else "-", versions_key(), template_hash(*GLUON_BWD_TEMPLATES))


def gluon_bwd_kernel(spec: GluonBackwardSpec, joint: JointGraph | None, score: TracedMod | None,
                     mask: TracedMod | None) -> GeneratedKernel:
    """Key, name (``flexfa_bwd_gluon_d128_bf16_<hash>``) and source of the Gluon backward."""
    assert not spec.interpret, "the Gluon backward is compiled only, never interpreted"
    key = gluon_bwd_key(spec, joint, score, mask)
    name = f"flexfa_bwd_gluon_d{spec.head_dim}_{spec.dtype}_{key[:12]}"
    score_args, mask_args = mod_buffer_args(score, mask)
    score_names = [p for args in score_args for p in args.params]
    mask_names = [p for args in mask_args for p in args.params]
    grad_args = grad_buffer_args(joint, score)
    assert spec.wide or not grad_args, "captured-tensor gradients: bwd_gluon_wide.tmpl only"
    grad_names = [p.name for p in gradients(grad_args.values(), "fp32")]
    params = gluon_bwd_params(score, mask, spec.dropout, spec.wide, joint)
    flags = spec.constexprs(dscore_is_one(joint), has_buffer_grads(joint))
    tile = GLUON_TILE_WIDE if spec.wide else GLUON_TILE_T
    library = fill(load_template("common.tmpl"), MASK_BUFFERS=unpack(mask_names, "mbufs"),
                   MASK_MOD=mask_mod_code(mask, mask_args, wide=spec.wide_ints, tile=tile))
    template = "bwd_gluon_wide.tmpl" if spec.wide else "bwd_gluon.tmpl"
    # the wide kernel's captured-tensor gradients (HAS_BUFFER_GRADS): the joint again with the
    # gradients' loads, and their scatter-adds
    grads = dict(GBUFS=as_tuple(grad_names), GRAD_BUFFERS=unpack(grad_names, "gbufs"),
                 SCORE_JOINT_LOADS=score_joint_code(joint, score, score_args, True, True,
                                                    spec.wide_ints, tile)
                 if grad_args else "pass",
                 BUFFER_GRADS=buffer_grad_code(joint, score_args, grad_args, gluon=True)
                 ) if spec.wide else {}
    kernel = fill(load_template(template), KERNEL_NAME=name,
                  DEF_KERNEL=def_kernel(name, params, flags),
                  TABLES=as_tuple(table_names("Q", "n", "m")), SBUFS=as_tuple(score_names),
                  MBUFS=as_tuple(mask_names), SCORE_BUFFERS=unpack(score_names, "sbufs"),
                  SCORE_JOINT=score_joint_code(joint, score, score_args, False, True,
                                               spec.wide_ints, tile), **grads)
    shared = fill(load_template("bwd_gluon_shared.tmpl"), KERNEL_NAME=name)
    source = module_source(f"flexfa generated Gluon backward kernel: {name}", flags, (name,),
                           load_template("helpers.tmpl"), load_template("gluon_common.tmpl"),
                           library, kernel, shared)
    return GeneratedKernel(key, name, source, describe_mods(score, mask), ((name, params),))


def gluon_bwd_signature(spec: GluonBackwardSpec, joint: JointGraph | None,
                        score: TracedMod | None, mask: TracedMod | None
                        ) -> tuple[dict[str, str], dict[str, object]]:
    """(signature, constexprs) for ``triton.compile(GluonASTSource(...))``."""
    constexprs_ = spec.constexprs(dscore_is_one(joint), has_buffer_grads(joint))
    signature = gluon_bwd_params(score, mask, spec.dropout, spec.wide, joint).signature(
        constexprs_ | {"E_PAD": next_power_of_two(spec.head_dim),
                       "EV_PAD": next_power_of_two(spec.ev)}, {INPUT: spec.dtype})
    for name, (block, dtype) in descriptor_blocks(spec).items():
        signature[name] = descriptor_type(block, dtype)
    return signature, constexprs_


def descriptor_layouts(spec: GluonBackwardSpec) -> dict[str, object]:
    """Each descriptor's NVMMA shared layout (what the host descriptors carry)."""
    return {name: descriptor_layout(block, dtype)
            for name, (block, dtype) in descriptor_blocks(spec).items()}


# ---- the row kernels ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RowsSpec:
    """The pre/postprocess kernels' variant: head dims and whether dlse is subtracted."""

    head_dim: int
    has_dlse: bool
    target: str
    head_dim_v: int = 0  # dO's and out's, where it differs (0: the same)

    @property
    def interpret(self) -> bool:
        return self.target == INTERPRET

    def constexprs(self, block: int) -> dict[str, object]:
        ev = self.head_dim_v or self.head_dim
        return dict(BLOCK=block, E=self.head_dim, E_PAD=next_power_of_two(self.head_dim),
                    EV=ev, EV_PAD=next_power_of_two(ev), HAS_DLSE=self.has_dlse)


PRE, POST, ZERO = "flexfa_gluon_bwd_pre", "flexfa_gluon_bwd_post", "flexfa_gluon_bwd_zero"
_ROW_CONSTEXPRS = constexprs("BLOCK", "E", "E_PAD", "EV", "EV_PAD", "HAS_DLSE")


def rows_params() -> dict[str, KernelParams]:
    """The parameters of the row kernels."""
    return {
        PRE: KernelParams((tensors(INPUT, "OUT", "DOUT") + tensors("fp32", "LSE", "DLSE", "LSE2",
                                                                   "DELTA"),
                           strides("o", "bhmd"), strides("g", "bhmd"),
                           ints("HQ", "L", "L_PAD", "ROW_STRIDE"),
                           _ROW_CONSTEXPRS)),
        POST: KernelParams((tensors("fp32", "DQ_ACC") + tensors(INPUT, "DQ"),
                            strides("dq", "bhmd"), ints("L", "L_PAD", "HQ_CHUNK", "B0", "H0")
                            + (Param("sm_scale", FLOAT),), _ROW_CONSTEXPRS)),
        ZERO: KernelParams((tensors("fp32", "DQ_ACC"), ints("ROWS"), _ROW_CONSTEXPRS))}


def rows_kernel(spec: RowsSpec) -> GeneratedKernel:
    """Key, name and source of the row kernels' module (kernels ``PRE``, ``POST`` and
    ``ZERO``; their BLOCK is a launch choice)."""
    key = spec_key(spec, versions_key(), template_hash(*ROWS_TEMPLATES))
    name = f"flexfa_bwd_gluon_rows_d{spec.head_dim}_{key[:12]}"
    flags = {n: v for n, v in spec.constexprs(0).items() if n != "BLOCK"}
    params = rows_params()
    library = fill(load_template("common.tmpl"), MASK_BUFFERS="",
                   MASK_MOD=mask_mod_code(None, []))
    rows = fill(load_template("bwd_gluon_rows.tmpl"),
                DEF_PRE=def_kernel(PRE, params[PRE], flags),
                DEF_POST=def_kernel(POST, params[POST], flags),
                DEF_ZERO=def_kernel(ZERO, params[ZERO], flags))
    source = module_source(f"flexfa generated Gluon backward row kernels: {name}", flags,
                           (PRE, POST, ZERO), load_template("helpers.tmpl"), library, rows)
    return GeneratedKernel(key, name, source, "no mods", tuple(params.items()))
