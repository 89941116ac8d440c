"""Filling the backward templates: a score_mod's joint graph and a mask_mod -> Triton source.

The generated module holds three kernels (helpers.tmpl and bwd_common.tmpl first):
``flexfa_bwd_delta`` (delta = rowsum(dO * O) - dlse), ``<name>_dkdv`` (bwd_dkdv.tmpl) and
``<name>_dq`` (bwd_dq.tmpl, which also accumulates captured-tensor gradients). Rendering is a
pure function of the score_mod's IR with its grad slots, the mask_mod's IR and the
``BackwardSpec``; the spec's fields reach the kernels as constexpr launch arguments.
"""
from __future__ import annotations

import dataclasses
import hashlib

from ..frontend.grad import JointGraph
from ..frontend.ir import Node, Op
from ..frontend.trace import TracedMod
from .forward import GeneratedKernel, mod_buffer_args
from .render import Leaves, buffer_args, leaf_ops, needs_tile_broadcast, render
from .spec import TORCH_DTYPES, INTERPRET, next_power_of_two
from .template import fill, load_template, template_hash
from .versions import versions_key

BACKWARD_TEMPLATES = ("helpers.tmpl", "bwd_common.tmpl", "bwd_dq.tmpl", "bwd_dkdv.tmpl")


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
    even_l1: bool  # L % block_m1 == 0
    even_s1: bool  # S % block_n1 == 0
    even_l2: bool
    even_s2: bool
    gqa_group: int
    deterministic: bool
    has_dlse: bool
    input_precision: str
    target: str

    def __post_init__(self):
        assert self.dtype in TORCH_DTYPES, self.dtype
        for block, tile in ((self.sparse_q, self.block_m1), (self.sparse_kv, self.block_n1),
                            (self.sparse_q, self.block_m2), (self.sparse_kv, self.block_n2)):
            assert block % tile == 0, f"block-mask block {block} is not a multiple of tile {tile}"

    @property
    def interpret(self) -> bool:
        return self.target == INTERPRET

    def _common(self) -> dict:
        return dict(E=self.head_dim, E_PAD=next_power_of_two(self.head_dim), EV=self.head_dim_v,
                    EV_PAD=next_power_of_two(self.head_dim_v), HAS_BLOCK_MASK=self.has_block_mask,
                    HAS_FULL_BLOCKS=self.has_full_blocks, SPARSE_Q=self.sparse_q,
                    SPARSE_KV=self.sparse_kv, GQA_GROUP=self.gqa_group,
                    INPUT_PRECISION=self.input_precision,
                    DOT_UPCAST=self.interpret and self.dtype == "bf16")

    def dkdv_constexprs(self, dscore_one: bool) -> dict:
        return dict(BLOCK_M=self.block_m1, BLOCK_N=self.block_n1, EVEN_L=self.even_l1,
                    EVEN_S=self.even_s1, DSCORE_IS_ONE=dscore_one, **self._common())

    def dq_constexprs(self, dscore_one: bool, has_buffer_grads: bool) -> dict:
        return dict(BLOCK_M=self.block_m2, BLOCK_N=self.block_n2, EVEN_L=self.even_l2,
                    EVEN_S=self.even_s2, DSCORE_IS_ONE=dscore_one,
                    HAS_BUFFER_GRADS=has_buffer_grads, DETERMINISTIC=self.deterministic,
                    **self._common())

    def delta_constexprs(self, block_m: int) -> dict:
        return dict(BLOCK_M=block_m, EV=self.head_dim_v,
                    EV_PAD=next_power_of_two(self.head_dim_v), HAS_DLSE=self.has_dlse)

    def launch_options(self) -> dict:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


def backward_key(spec: BackwardSpec, joint: JointGraph | None, score: TracedMod | None,
                 mask: TracedMod | None) -> str:
    digest = hashlib.sha256(repr(dataclasses.astuple(spec)).encode())
    for part in (score.key if score else "-", _joint_key(joint), mask.key if mask else "-",
                 versions_key(), template_hash(*BACKWARD_TEMPLATES)):
        digest.update(b"|" + part.encode())
    return digest.hexdigest()


def backward_kernel(spec: BackwardSpec, joint: JointGraph | None, score: TracedMod | None,
                    mask: TracedMod | None) -> GeneratedKernel:
    """Key, name (``flexfa_bwd_d64_bf16_<hash>``) and source of the backward module; its
    kernels are ``flexfa_bwd_delta``, ``<name>_dkdv`` and ``<name>_dq``."""
    key = backward_key(spec, joint, score, mask)
    name = f"flexfa_bwd_d{spec.head_dim}_{spec.dtype}_{key[:12]}"
    score_args, mask_args = mod_buffer_args(score, mask)
    grad_slots = joint.grad_slots if joint is not None else ()
    grad_args = {s: buffer_args(s, len(score.buffer_specs[s][0]), "gbuf") for s in grad_slots}
    mod_params = "".join(", " + p for a in score_args + mask_args for p in a.params)
    grad_params = "".join(f", {a.ptr}" + "".join(f", {s}" for s in a.strides)
                          for a in grad_args.values())
    mask_code = _mask_code(mask, mask_args)
    dq = fill(load_template("bwd_dq.tmpl"), KERNEL_NAME=name,
              BUFFER_PARAMS=mod_params + grad_params, BUFFER_ARGS=mod_params + grad_params,
              SCORE_JOINT=_score_code(joint, score_args, with_loads=True), MASK_MOD=mask_code,
              BUFFER_GRADS=_buffer_grad_code(joint, score_args, grad_args))
    dkdv = fill(load_template("bwd_dkdv.tmpl"), KERNEL_NAME=name, BUFFER_PARAMS=mod_params,
                BUFFER_ARGS=mod_params, SCORE_JOINT=_score_code(joint, score_args, False),
                MASK_MOD=mask_code)
    text = "\n\n".join([
        f"# flexfa generated backward kernels: {name}\n"
        f"# score_mod: {score.name if score else None}; mask_mod: {mask.name if mask else None}\n"
        "import triton\nimport triton.language as tl",
        load_template("helpers.tmpl").rstrip("\n"), load_template("bwd_common.tmpl").rstrip("\n"),
        dq.rstrip("\n"), dkdv])
    return GeneratedKernel(key, name, text)


def dscore_is_one(joint: JointGraph | None) -> bool:
    return joint is None or (joint.dscore.op is Op.CONST and joint.dscore.arg == 1.0)


def _joint_key(joint: JointGraph | None) -> str:
    if joint is None:
        return "-"
    parts = [joint.forward.key, joint.dscore.key] + [f"{l.key}:{g.key}" for l, g in joint.dloads]
    return ",".join(parts)


def _score_code(joint: JointGraph | None, args, with_loads: bool) -> str:
    """Statements setting score_mod_out, dscore and (dQ kernel) dload{i}, load{i}_idx{d}."""
    if joint is None:
        return "score_mod_out = score"
    roots: list[Node] = [joint.forward, joint.dscore]
    names = ["score_mod_out", "dscore"]
    if with_loads:
        for i, (load, dload) in enumerate(joint.dloads):
            roots.append(dload)
            names.append(f"dload{i}")
            for d, index in enumerate(load.src):
                roots.append(index)
                names.append(f"load{i}_idx{d}")
    rendered = render(roots, Leaves(), args, prefix="s")
    lines = list(rendered.lines)
    for root, name, value in zip(roots, names, rendered.values):
        if name == "score_mod_out" and needs_tile_broadcast(root):
            value = f"({value}) + tl.zeros_like(score)"
        lines.append(f"{name} = {value}")
    return "\n".join(lines)


def _mask_code(mask: TracedMod | None, args) -> str:
    if mask is None:  # never compiled: APPLY_MASK is False without a block mask
        return "mask_mod_out = q_idx >= 0"
    rendered = render([mask.root], Leaves(score=None), args, prefix="m")
    return "\n".join([*rendered.lines, f"mask_mod_out = {rendered.values[0]}"])


def _buffer_grad_code(joint: JointGraph | None, args, grad_args) -> str:
    """Scatter-adds of ds_out * dload{i} at each grad load's (clamped) indices.

    The contribution is summed over the tile axes the indices do not depend on first
    (``scale[h]``: one atomic per tile; ``bias[q_idx]``: one per row), so atomics stay few.
    """
    if joint is None or not joint.dloads:
        return "pass"
    lines = []
    for i, (load, _) in enumerate(joint.dloads):
        slot = load.arg
        deps = frozenset().union(*(leaf_ops(index) for index in load.src)) if load.src \
            else frozenset()
        rows = bool(deps & {Op.Q_IDX, Op.SCORE})
        cols = bool(deps & {Op.KV_IDX, Op.SCORE})
        contrib = f"tl.where(p > 0.0, ds_out * dload{i}, 0.0)"
        if rows and cols:
            value = contrib
        elif rows:
            value = f"tl.sum({contrib}, 1, keep_dims=True)"
        elif cols:
            value = f"tl.sum({contrib}, 0, keep_dims=True)"
        else:
            value = f"tl.sum(tl.sum({contrib}, 1), 0)"
        size_names, grad = args[slot].sizes, grad_args[slot]
        offset = " + ".join(f"flexfa_index(load{i}_idx{d}, {size}) * {stride}"
                            for d, (size, stride) in enumerate(zip(size_names, grad.strides)))
        pointer = f"{grad.ptr} + {offset}" if offset else grad.ptr
        lines.append(f"flexfa_grad_add({pointer}, {value}, DETERMINISTIC)")
    return "\n".join(lines)
