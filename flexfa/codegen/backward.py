"""Filling the backward templates: a score_mod's joint graph and a mask_mod -> Triton source.

The generated module holds the kernels (helpers.tmpl, common.tmpl and bwd_common.tmpl first):
``<name>_dq`` (bwd_dq.tmpl, run first: it also stores delta = rowsum(dO * O) - dlse and
accumulates captured-tensor gradients; with ``ds_dq`` it runs last and reads the dS that
``<name>_dkdv`` stored), ``<name>_dkdv`` (bwd_dkdv.tmpl) and ``flexfa_bwd_delta`` (first,
for ``ds_dq``). Rendering is a
pure function of the score_mod's IR with its grad slots, the mask_mod's IR and the
``BackwardSpec``; the spec's fields are the module's flags (``backward_flags``) and reach the
kernels as constexpr launch arguments too.
"""
from __future__ import annotations

import dataclasses
import hashlib

from ..frontend.grad import JointGraph
from ..frontend.ir import Node, Op
from ..frontend.trace import TracedMod
from .fold import fold_joint
from .forward import GeneratedKernel, buffer_params, describe_mods, mod_buffer_args
from .params import (KernelParams, Param, as_tuple, def_kernel, delta_params, dkdv_params,
                     dq_params, feature_params, gradients, table_names, unpack)
from .render import Leaves, buffer_args, leaf_ops, needs_tile_broadcast, render_mod
from .spec import TORCH_DTYPES, INTERPRET, head_dim_blocks, next_power_of_two
from .template import fill, load_template, module_source, template_hash
from .versions import versions_key

BACKWARD_TEMPLATES = ("helpers.tmpl", "common.tmpl", "bwd_common.tmpl", "bwd_dq.tmpl",
                      "bwd_dkdv.tmpl")
# the module flags of each kernel's tile constexprs (bwd_common.tmpl); None: a launch flag
_DQ_TILE = {"BLOCK_M": "BLOCK_M2", "BLOCK_N": "BLOCK_N2", "EVEN_L": "EVEN_L2", "EVEN_S": "EVEN_S2"}
_DKDV_TILE = {"BLOCK_M": "BLOCK_M1", "BLOCK_N": "BLOCK_N1", "EVEN_L": "EVEN_L1",
              "EVEN_S": "EVEN_S1"}
_ROW_KERNEL = {"BLOCK_M": None}  # the delta kernel's rows per program
LOG2E = 1.4426950408889634  # the rendered scores' log2_scale without a folded factor


def wide_head_dims(head_dim: int, head_dim_v: int) -> bool:
    """Whether q/k's or v's head dim pads past 128: the backward's wide kernels (their own
    tuned tiles, their own ragged-length defaults)."""
    return max(next_power_of_two(head_dim), next_power_of_two(head_dim_v)) > 128


@dataclasses.dataclass(frozen=True)
class BackwardSpec:
    """A backward-kernel variant; rendering is a pure function of (joint IR, mask IR, spec).

    Two tilings: the dK/dV kernel walks q tiles of ``block_m1`` rows inside a program that
    owns ``block_n1`` keys; the dQ kernel walks kv tiles of ``block_n2`` keys inside a program
    that owns ``block_m2`` rows.
    """

    dtype: str  # "fp16" | "bf16" | "fp32"
    head_dim: int
    head_dim_v: int
    block_m1: int
    block_n1: int
    block_m2: int
    block_n2: int
    num_warps: int
    num_stages: int
    has_block_mask: bool
    has_full_blocks: bool
    sparse_q: int
    sparse_kv: int
    # no bounds checks needed on that side: the dK/dV kernel's walk over q (L a multiple of
    # the block-mask block, or of block_m1 without a mask) and its own keys (S % block_n1),
    # the dQ kernel's own rows (L % block_m2) and its walk over keys (like even_l1)
    even_l1: bool
    even_s1: bool
    even_l2: bool
    even_s2: bool
    gqa_group: int
    deterministic: bool
    has_dlse: bool
    input_precision: str
    target: str
    use_tma: bool = False  # Q/dO and K/V tiles through tensor descriptors (sm_90)
    # dQ from dS: the dK/dV kernel stores dS in a workspace, the dQ kernel runs last and does
    # one GEMM per tile (dS @ K) instead of three; delta comes from the delta kernel
    ds_dq: bool = False
    # the dQ kernel's own launch options (0: num_warps / num_stages)
    dq_warps: int = 0
    dq_stages: int = 0
    # keys of the INT nodes of the joint graph and the mask_mod computed in int64
    # (codegen.ranges.int64_nodes at this call's lengths)
    wide_ints: tuple[str, ...] = ()
    # the forward dropped probabilities (DROPOUT): the kernels draw its keep mask again
    dropout: bool = False
    # Q, K, dQ, dK in two column blocks (``head_dim_blocks``: E = 192 as 128 + 64): the
    # E_A, E_B flags
    split_head_dim: bool = False

    def __post_init__(self):
        assert self.dtype in TORCH_DTYPES, self.dtype
        for block, tile in ((self.sparse_q, self.block_m1), (self.sparse_kv, self.block_n1),
                            (self.sparse_q, self.block_m2), (self.sparse_kv, self.block_n2)):
            assert block % tile == 0, f"block-mask block {block} is not a multiple of tile {tile}"

    @property
    def interpret(self) -> bool:
        return self.target == INTERPRET

    @property
    def column_blocks(self) -> tuple[int, int]:
        """(E_A, E_B): the q/k head dim's column blocks; (E_PAD, 0) unless split."""
        if self.split_head_dim:
            return head_dim_blocks(self.head_dim)
        return next_power_of_two(self.head_dim), 0

    @property
    def wide(self) -> bool:
        """A padded head dim past 128 (q/k or v)."""
        return wide_head_dims(self.head_dim, self.head_dim_v)

    def _common(self) -> dict:
        e_a, e_b = self.column_blocks
        return dict(E=self.head_dim, E_PAD=next_power_of_two(self.head_dim), E_A=e_a, E_B=e_b,
                    EV=self.head_dim_v,
                    EV_PAD=next_power_of_two(self.head_dim_v), HAS_BLOCK_MASK=self.has_block_mask,
                    HAS_FULL_BLOCKS=self.has_full_blocks, SPARSE_Q=self.sparse_q,
                    SPARSE_KV=self.sparse_kv, GQA_GROUP=self.gqa_group,
                    INPUT_PRECISION=self.input_precision,
                    DOT_UPCAST=self.interpret and self.dtype == "bf16", USE_TMA=self.use_tma,
                    DROPOUT=self.dropout)

    def dkdv_constexprs(self, dscore_one: bool) -> dict:
        # partial and full q blocks in one loop (bwd_dkdv.tmpl): 256 in one column block, with
        # a block mask that has full blocks; without a block mask (the same tile body) where a
        # score_mod has a derivative (measured: bwd_dkdv.tmpl's ONE_LOOP). At 192 (128 + 64)
        # under a block mask with GQA on 8 warps (the tile multiples' tiles), where the two
        # loops spilled 20-36 bytes and the one loop none, in the same time (GQA 4 causal S =
        # 8192 1.000x on an H100); elsewhere at 192 it was no faster under a mask (0.98-1.02x)
        # and 0.95x without one (softcap), and the 4-warp ragged tiles spilled more in it
        # (gpu_2026-12-05/wq_0903e6a, docs/head-dims.md)
        wide_gqa = (self.column_blocks == (128, 64) and self.num_warps == 8
                    and self.gqa_group > 1 and self.has_block_mask)
        # With dropout at 256 under a block mask too (the keep mask drawn before the mask's
        # branch, dP^T through it before the branch): sm_90 compile 108-128 bytes of spills,
        # 25-35 local-memory instructions a tile, where the two loops spill 464-644 and
        # 113-201 (causal, softcap + causal); at 192 it spilled more (64 bytes against 40)
        one_loop = ((self.column_blocks == (256, 0) or wide_gqa)
                    and (not self.dropout
                         or (self.has_block_mask and self.column_blocks == (256, 0)))
                    and (self.has_full_blocks if self.has_block_mask else not dscore_one))
        # dV's GEMM after dK's (bwd_dkdv.tmpl): split from 256, or in the one loop; never
        # with dropout outside it
        dv_last = one_loop or (not self.dropout and self.column_blocks[1] > 0
                               and next_power_of_two(self.head_dim) > 128)
        return dict(BLOCK_M=self.block_m1, BLOCK_N=self.block_n1, EVEN_L=self.even_l1,
                    EVEN_S=self.even_s1, DSCORE_IS_ONE=dscore_one, STORE_DS=self.ds_dq,
                    DS_TMA=self.ds_dq and self.use_tma, DV_LAST=dv_last, ONE_LOOP=one_loop,
                    ROW_OFFSETS=one_loop and not self.has_block_mask and self.use_tma,
                    # without a block mask at a ragged L, past 128 the q tiles in one
                    # bounds-checked body (bwd_dkdv.tmpl's RAGGED_L_APART)
                    RAGGED_L_APART=not (self.wide and not self.even_l1), **self._common())

    def dq_constexprs(self, dscore_one: bool, has_buffer_grads: bool) -> dict:
        return dict(BLOCK_M=self.block_m2, BLOCK_N=self.block_n2, EVEN_L=self.even_l2,
                    EVEN_S=self.even_s2, DSCORE_IS_ONE=dscore_one,
                    HAS_BUFFER_GRADS=has_buffer_grads, DETERMINISTIC=self.deterministic,
                    HAS_DLSE=self.has_dlse, LOAD_DS=self.ds_dq,
                    RAGGED_APART=not self.wide,  # bwd_dq.tmpl
                    DS_TMA=self.ds_dq and self.use_tma, **self._common())

    def delta_constexprs(self, block_m: int) -> dict:
        return dict(BLOCK_M=block_m, EV=self.head_dim_v,
                    EV_PAD=next_power_of_two(self.head_dim_v), HAS_DLSE=self.has_dlse)

    def launch_options(self) -> dict:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}

    def dq_launch_options(self) -> dict:
        return {"num_warps": self.dq_warps or self.num_warps,
                "num_stages": self.dq_stages or self.num_stages}


def backward_key(spec: BackwardSpec, joint: JointGraph | None, score: TracedMod | None,
                 mask: TracedMod | None) -> str:
    digest = hashlib.sha256(repr(dataclasses.astuple(spec)).encode())
    for part in (score.key if score else "-", joint_key(joint), mask.key if mask else "-",
                 versions_key(), template_hash(*BACKWARD_TEMPLATES)):
        digest.update(b"|" + part.encode())
    return digest.hexdigest()


def backward_kernel(spec: BackwardSpec, joint: JointGraph | None, score: TracedMod | None,
                    mask: TracedMod | None) -> GeneratedKernel:
    """Key, name (``flexfa_bwd_d64_bf16_<hash>``) and source of the backward module; its
    kernels are ``flexfa_bwd_delta``, ``<name>_dq`` and ``<name>_dkdv``."""
    key = backward_key(spec, joint, score, mask)
    name = f"flexfa_bwd_d{spec.head_dim}_{spec.dtype}_{key[:12]}"
    score_args, mask_args = mod_buffer_args(score, mask)
    grad_args = grad_buffer_args(joint, score)
    score_names = [p for args in score_args for p in args.params]
    mask_names = [p for args in mask_args for p in args.params]
    grads = gradients(grad_args.values(), "i64" if spec.deterministic else "fp32")
    grad_names = [p.name for p in grads]
    kernels = _kernel_params(spec, buffer_params(score, mask), grads, name)
    checks = _kernel_flags(spec, joint, name)
    shared = dict(SBUFS=as_tuple(score_names), MBUFS=as_tuple(mask_names),
                  SCORE_BUFFERS=unpack(score_names, "sbufs"))
    fast_math = not spec.interpret
    dq = fill(load_template("bwd_dq.tmpl"), KERNEL_NAME=name,
              DEF_KERNEL=def_kernel(f"{name}_dq", kernels[f"{name}_dq"], checks[f"{name}_dq"]),
              TABLES=as_tuple(table_names("KV", "m", "n")), GBUFS=as_tuple(grad_names),
              GRAD_BUFFERS=unpack(grad_names, "gbufs"),
              SCORE_JOINT=score_joint_code(joint, score, score_args, True, fast_math, spec.wide_ints),
              BUFFER_GRADS=buffer_grad_code(joint, score_args, grad_args), **shared)
    dkdv = fill(load_template("bwd_dkdv.tmpl"), KERNEL_NAME=name,
                DEF_KERNEL=def_kernel(f"{name}_dkdv", kernels[f"{name}_dkdv"],
                                      checks[f"{name}_dkdv"]),
                TABLES=as_tuple(table_names("Q", "n", "m")),
                # past 128 the dK/dV kernel's registers are at their edge: with the fold,
                # ptxas spilled two values around the loop at 256 (16 bytes; compile check)
                SCORE_JOINT=score_joint_code(joint, score, score_args, False, fast_math,
                                             spec.wide_ints,
                                             fold=next_power_of_two(spec.head_dim) <= 128),
                **shared)
    common = fill(load_template("bwd_common.tmpl"),
                  DEF_DELTA=def_kernel("flexfa_bwd_delta", kernels["flexfa_bwd_delta"],
                                       checks["flexfa_bwd_delta"]))
    library = fill(load_template("common.tmpl"), MASK_BUFFERS=unpack(mask_names, "mbufs"),
                   MASK_MOD=_mask_code(mask, mask_args, spec.wide_ints))
    title = (f"flexfa generated backward kernels: {name}\n# score_mod: "
             f"{score.name if score else None}; mask_mod: {mask.name if mask else None}")
    source = module_source(title, backward_flags(spec, joint), tuple(kernels),
                           load_template("helpers.tmpl"), library, common, dq, dkdv)
    return GeneratedKernel(key, name, source, describe_mods(score, mask),
                           tuple(kernels.items()))


def _kernel_params(spec: BackwardSpec, buffers: tuple[Param, ...], grads: tuple[Param, ...],
                   name: str) -> dict[str, KernelParams]:
    """Each kernel of the backward module and its parameters."""
    ds_tma = spec.ds_dq and spec.use_tma
    features = feature_params("", spec.dropout)
    split = spec.split_head_dim
    return {f"{name}_dq": dq_params(spec.use_tma, ds_tma, buffers + grads, features, split),
            f"{name}_dkdv": dkdv_params(spec.use_tma, ds_tma, buffers, features, split,
                                        not spec.even_l1),
            "flexfa_bwd_delta": delta_params()}


def _kernel_constexprs(spec: BackwardSpec, joint: JointGraph | None):
    """(kernel suffix, its constexprs, their module flags) of each kernel; the rows of the
    delta kernel are a launch choice (``block_m``: any value here)."""
    one, grads = dscore_is_one(joint), has_buffer_grads(joint)
    return (("_dq", spec.dq_constexprs(one, grads), _DQ_TILE),
            ("_dkdv", spec.dkdv_constexprs(one), _DKDV_TILE),
            ("flexfa_bwd_delta", spec.delta_constexprs(0), _ROW_KERNEL))


def backward_flags(spec: BackwardSpec, joint: JointGraph | None) -> dict[str, object]:
    """The module flags of a backward module: every kernel's constexprs, the tiles of the dQ
    and dK/dV kernels under their own names (BLOCK_M2, BLOCK_M1, ...), without the delta
    kernel's rows."""
    flags: dict[str, object] = {}
    for _, constexprs, renames in _kernel_constexprs(spec, joint):
        for name, value in constexprs.items():
            flag = renames.get(name, name)
            if flag is not None:
                assert flags.get(flag, value) == value, (
                    f"backward kernels disagree on {flag}: {flags[flag]!r} and {value!r}")
                flags[flag] = value
    return flags


def _kernel_flags(spec: BackwardSpec, joint: JointGraph | None, name: str
                  ) -> dict[str, dict[str, object]]:
    """The constexpr values each kernel's compile-time check expects: all but launch flags."""
    return {(name + kernel if kernel.startswith("_") else kernel):
            {n: v for n, v in constexprs.items() if renames.get(n, n) is not None}
            for kernel, constexprs, renames in _kernel_constexprs(spec, joint)}


def dscore_is_one(joint: JointGraph | None) -> bool:
    return joint is None or (joint.dscore.op is Op.CONST and joint.dscore.arg == 1.0)


def has_buffer_grads(joint: JointGraph | None) -> bool:
    """Whether the score_mod's captured tensors want gradients (HAS_BUFFER_GRADS)."""
    return bool(joint is not None and joint.grad_slots)


def joint_key(joint: JointGraph | None) -> str:
    if joint is None:
        return "-"
    parts = [joint.forward.key, joint.dscore.key] + [f"{l.key}:{g.key}" for l, g in joint.dloads]
    return ",".join(parts)


def joint_roots(joint: JointGraph, with_loads: bool = True) -> list[Node]:
    """The graphs the backward renders from a joint graph: the score_mod, dscore and (dQ
    kernel, ``with_loads``) each captured-tensor gradient and its load's indices."""
    roots: list[Node] = [joint.forward, joint.dscore]
    if with_loads:
        for load, dload in joint.dloads:
            roots += [dload, *load.src]
    return roots


def score_joint_code(joint: JointGraph | None, score: TracedMod | None, args, with_loads: bool,
                     fast_math: bool = False, wide: tuple[str, ...] = (),
                     tile: str = "tl.full(score.shape, {fill}, {dtype})",
                     fold: bool = True) -> str:
    """Statements setting score_mod_out, log2_scale (score_mod_out * log2_scale is the score
    in log2 units), dscore and (dQ kernel) dload{i}, load{i}_idx{d} from the raw ``qk``;
    ``tile``: how a full tile of one value is written (the Gluon backward's names its
    layout); ``fold``: the mod's constant factors folded into the scales (below)."""
    if joint is None:
        return "score_mod_out = qk\nlog2_scale = sm_scale * 1.4426950408889634"
    # constant factors of the mod folded into the scales (codegen/fold.py): the score read as
    # q.k * scale * in_scale, log2(e) times out_scale, the derivative times their product
    folded = fold_joint(joint) if fold else None
    in_scale, out_scale, ds_scale = ((folded.in_scale, folded.out_scale, folded.dscore_scale)
                                     if folded else (1.0, 1.0, 1.0))
    joint = folded.joint if folded else joint
    roots = joint_roots(joint, with_loads)
    names = ["score_mod_out", "dscore"]
    if with_loads:
        for i, (load, _) in enumerate(joint.dloads):
            names += [f"dload{i}", *(f"load{i}_idx{d}" for d in range(len(load.src)))]
    # fast_math (GPU targets): hardware tanh/sigmoid/exp as in the forward; the derivative
    # of tanh reads the forward's tanh value (one tanh.approx per element)
    rendered = render_mod(score, roots, Leaves(), args, prefix="s", fast_math=fast_math,
                          wide=wide)
    lines = [f"score = qk * (sm_scale * {in_scale!r})" if in_scale != 1.0
             else "score = qk * sm_scale", *rendered.lines]
    for root, name, value in zip(roots, names, rendered.values):
        if name == "score_mod_out" and needs_tile_broadcast(root):
            value = f"({value}) + {tile.format(fill='0.0', dtype='tl.float32')}"
        if name == "dscore" and ds_scale != 1.0:
            value = f"({value}) * {ds_scale!r}"
        lines.append(f"{name} = {value}")
    lines.append(f"log2_scale = {LOG2E * out_scale!r}")
    return "\n".join(lines)


def _mask_code(mask: TracedMod | None, args, wide: tuple[str, ...] = ()) -> str:
    if mask is None:  # never compiled: APPLY_MASK is False without a block mask
        return "mask_mod_out = q_idx >= 0"
    rendered = render_mod(mask, [mask.root], Leaves(score=None), args, prefix="m", wide=wide)
    return "\n".join([*rendered.lines, f"mask_mod_out = {rendered.values[0]}"])


def buffer_grad_code(joint: JointGraph | None, args, grad_args, gluon: bool = False) -> str:
    """Scatter-adds of ds_out * dload{i} at each grad load's (clamped) indices, in a
    [queries, keys] score tile.

    The contribution is summed over the tile axes the indices do not depend on first
    (``scale[h]``: one atomic per tile; ``bias[q_idx]``: one per row), so atomics stay few.
    ``gluon``: Gluon's reduce and atomics (relaxed fp32 adds) instead of ``flexfa_grad_add``;
    a sum along one axis stays a vector of the sliced layout there.
    """
    if joint is None or not joint.dloads:
        return "pass"
    lang = "gl" if gluon else "tl"
    lines = []
    for i, ((load, _), (rows, cols)) in enumerate(zip(joint.dloads, grad_load_axes(joint))):
        slot = load.arg
        # 0 where P is (an inf or NaN dload there stays out); the dQ kernel's NaN P of a row
        # that saw a +inf or NaN score (bwd_dq.tmpl) goes in: NaN in the entries it read.
        # Gluon's kernel keeps p > 0 (its gradients are poisoned whole after it when a row saw
        # one: runtime.families.gluon_bwd.poison_buffer_grads)
        contrib = (f"gl.where(p > 0.0, ds_out * dload{i}, 0.0)" if gluon
                   else f"tl.where(p == 0.0, 0.0, ds_out * dload{i})")
        size_names, grad = args[slot].sizes, grad_args[slot]
        offset = " + ".join(f"flexfa_index(load{i}_idx{d}, {size}) * {stride}"
                            for d, (size, stride) in enumerate(zip(size_names, grad.strides)))
        axis = None if rows == cols else (1 if rows else 0)  # the one axis summed over
        if axis is None:
            value = contrib if rows else (
                f"{lang}.reduce({lang}.reduce({contrib}, 1, flexfa_sum_combine), 0, "
                f"flexfa_sum_combine)")
        elif not gluon:
            value = f"tl.reduce({contrib}, {axis}, flexfa_sum_combine, keep_dims=True)"
        else:
            # a vector in the sliced layout (one register per element; a keep_dims tile
            # repeats it in a thread's registers and Gluon's atomics add every copy), the
            # offsets (constant along the summed axis) brought to the same layout by a max
            value = f"gl.reduce({contrib}, {axis}, flexfa_sum_combine)"
            offset = (f"gl.reduce(({offset}) + (q_idx * 0 + kv_idx * 0), {axis}, "
                      f"flexfa_max_combine)")
        pointer = f"{grad.ptr} + {offset}" if offset else grad.ptr
        # the tensor's element count (its accumulator is contiguous): where DETERMINISTIC's
        # bound words start, after the value words (flexfa_grad_add)
        count = f"{size_names[0]} * {grad.strides[0]}" if size_names else "1"
        lines.append(f"gl.atomic_add({pointer}, {value}, sem=\"relaxed\")" if gluon
                     else f"flexfa_grad_add({pointer}, {value}, {count})")
    return "\n".join(lines)


def grad_load_axes(joint: JointGraph | None) -> list[tuple[bool, bool]]:
    """(rows, cols) of each gradient load of ``joint``: whether its indices vary along the
    score tile's query axis, its key axis (the score itself varies along both)."""
    axes = []
    for load, _ in (joint.dloads if joint is not None else ()):
        deps = frozenset().union(*(leaf_ops(index) for index in load.src)) if load.src \
            else frozenset()
        axes.append((bool(deps & {Op.Q_IDX, Op.SCORE}), bool(deps & {Op.KV_IDX, Op.SCORE})))
    return axes


def grad_buffer_args(joint: JointGraph | None, score: TracedMod | None) -> dict:
    """{slot: the gradient accumulator's argument names} of each captured tensor of the
    score_mod that wants a gradient."""
    grad_slots = joint.grad_slots if joint is not None else ()
    return {s: buffer_args(s, len(score.buffer_specs[s][0]), "gbuf") for s in grad_slots}


# ---- compile-only check variants (python -m flexfa compile-check) --------------------------

_SIGNATURE_TYPES = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32", "float64": "*fp64",
                    "int32": "*i32", "int64": "*i64", "bool": "*i1", "uint8": "*u8", "int8": "*i8"}


def launch_signature(params: KernelParams, args) -> dict[str, str]:
    """Triton signature of a launch of the kernel with ``params``: pointer types from the
    tensors, tensordesc<...> from tensor descriptors, i32/fp32 for scalars."""
    assert len(args) == len(params.names), (
        f"{len(args)} launch arguments for the {len(params.names)} parameters {params.names}")
    signature = {}
    for name, value in zip(params.names, args):
        if hasattr(value, "block_shape"):  # a tensor descriptor
            element = _SIGNATURE_TYPES[str(value.base.dtype).replace("torch.", "")][1:]
            signature[name] = f"tensordesc<{element}{list(value.block_shape)}>"
        elif hasattr(value, "dtype"):
            signature[name] = _SIGNATURE_TYPES[str(value.dtype).replace("torch.", "")]
        else:
            signature[name] = "fp32" if isinstance(value, float) else "i32"
    return signature | {name: "constexpr" for name in params.constexpr_names}
