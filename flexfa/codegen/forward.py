"""Generating the forward kernels: their modules, and ``fwd.tmpl``'s.

``forward_kernel(spec, score, mask)`` returns the kernel's cache key, name and source; it is a
pure function of the mods' IR (their ``TracedMod.key``: structure and buffer shapes/dtypes,
never buffer values) and the ``KernelSpec``. ``forward_module`` builds the module of every
forward template (fwd.tmpl, fwd_hopper.tmpl, fwd_fp8.tmpl): the spec's flags once at the top,
the helpers, the kernel library (common.tmpl) and the forward library (fwd_common.tmpl)
filled with the rendered mask_mod and score_mod, then the template itself.
"""
from __future__ import annotations

import dataclasses

from ..frontend.ir import Node
from ..frontend.trace import TracedMod
from .fold import fold_scales
from .params import (INPUT, KernelParams, Param, as_tuple, captured, def_kernel,
                     feature_params, forward_params, table_names, unpack)
from .render import BufferArgs, Leaves, buffer_args, needs_tile_broadcast, render_mod
from .spec import KernelSpec, kernel_name, spec_key
from .template import fill, load_template, module_source, template_hash
from .versions import versions_key

FORWARD_TEMPLATES = ("fwd.tmpl", "helpers.tmpl", "common.tmpl", "fwd_common.tmpl")
# names the mods' code sees inside flexfa_score_mod and flexfa_mask_mod (fwd_common.tmpl,
# common.tmpl)
FORWARD_LEAVES = Leaves(score="score", b="off_b", h="off_h", q_idx="q_idx", kv_idx="kv_idx")
# constexpr parameters of the forward kernels that are not module flags: the runtime launches
# one module with either value
LAUNCH_FLAGS = ("HAS_SCORE_MOD",)
# a full score tile of one value, for a mod whose result is not a tile by itself (a constant,
# ``bias[h]``): Triton's tensors take their layout from their use, Gluon's need one named
# (fwd_gluon.tmpl's)
TRITON_TILE = "tl.full([BLOCK_M, BLOCK_N], {fill}, {dtype})"


@dataclasses.dataclass(frozen=True)
class GeneratedKernel:
    key: str  # sha256 of everything that decides the source
    name: str  # the kernel function's name, also the file name
    source: str
    mods: str = ""  # the mods it was rendered from, for error messages ("score_mod 'alibi'")
    # each kernel function of the module and its parameters (flexfa/codegen/params.py)
    kernels: tuple[tuple[str, KernelParams], ...] = ()

    def kernel_params(self, function: str | None = None) -> KernelParams:
        """The parameters of the module's kernel ``function`` (default: the one named
        ``name``)."""
        found = dict(self.kernels)
        function = function or self.name
        assert function in found, (
            f"module {self.name} has no kernel {function!r}; its kernels: {sorted(found)}")
        return found[function]

    @property
    def params(self) -> tuple[str, ...]:
        """The kernel's positional parameters, in order: what a launcher passes first."""
        return self.kernel_params().names

    @property
    def constexpr_names(self) -> tuple[str, ...]:
        """The kernel's constexpr parameters: what a launcher passes as keywords."""
        return self.kernel_params().constexpr_names


def describe_mods(score: TracedMod | None, mask: TracedMod | None) -> str:
    """``score_mod 'alibi', mask_mod 'causal'``: the mods a kernel renders, for messages."""
    return ", ".join(f"{mod.kind} {mod.name!r}" for mod in (score, mask) if mod is not None) \
        or "no mods"


def mod_buffer_args(score: TracedMod | None, mask: TracedMod | None
                    ) -> tuple[list[BufferArgs], list[BufferArgs]]:
    """Kernel argument names of the captured tensors: ``sbuf<i>_*`` for the score_mod,
    ``mbuf<i>_*`` for the mask_mod, in slot order."""
    score_args = [buffer_args(i, len(shape), "sbuf")
                  for i, (shape, _) in enumerate(score.buffer_specs)] if score else []
    mask_args = [buffer_args(i, len(shape), "mbuf")
                 for i, (shape, _) in enumerate(mask.buffer_specs)] if mask else []
    return score_args, mask_args


def buffer_params(score: TracedMod | None, mask: TracedMod | None) -> tuple[Param, ...]:
    """The kernel parameters of the mods' captured tensors (score_mod's, then mask_mod's)."""
    score_args, mask_args = mod_buffer_args(score, mask)
    return (captured(score_args, (dtype for _, dtype in score.buffer_specs) if score else ())
            + captured(mask_args, (dtype for _, dtype in mask.buffer_specs) if mask else ()))


def score_mod_code(score: TracedMod | None, args: list[BufferArgs], fast_math: bool = False,
                   wide: tuple[str, ...] = (), tile: str = TRITON_TILE,
                   root: Node | None = None) -> str:
    """Statements setting ``score_mod_out`` (a full fp32 tile) from ``score`` and indices;
    ``fast_math`` for GPU targets (hardware tanh/sigmoid/exp); ``wide``: the spec's
    ``wide_ints``; ``tile``: how a full tile of one value is written (TRITON_TILE);
    ``root``: the graph to render, default the mod's (the forward renders it with its
    constant factors folded out: ``fold.fold_scales``)."""
    if score is None:
        return "score_mod_out = score"
    root = score.root if root is None else root
    rendered = render_mod(score, [root], FORWARD_LEAVES, args, prefix="s",
                          fast_math=fast_math, wide=wide)
    value = rendered.values[0]
    if needs_tile_broadcast(root):
        value = f"{tile.format(fill='0.0', dtype='tl.float32')} + ({value})"
    return "\n".join([*rendered.lines, f"score_mod_out = {value}"])


def mask_mod_code(mask: TracedMod | None, args: list[BufferArgs], wide: tuple[str, ...] = (),
                  tile: str = TRITON_TILE) -> str:
    """Statements setting ``mask_mod_out`` (bool, True = keep) from the indices; ``tile`` as
    in ``score_mod_code``."""
    if mask is None:
        return "mask_mod_out = True"
    rendered = render_mod(mask, [mask.root], dataclasses.replace(FORWARD_LEAVES, score=None),
                          args, prefix="m", wide=wide)
    value = rendered.values[0]
    if needs_tile_broadcast(mask.root):
        value = f"{tile.format(fill='1', dtype='tl.int1')} & ({value})"
    return "\n".join([*rendered.lines, f"mask_mod_out = {value}"])


def forward_key(spec: KernelSpec, score: TracedMod | None, mask: TracedMod | None) -> str:
    return spec_key(spec, score.key if score else "-", mask.key if mask else "-",
                    versions_key(), template_hash(*FORWARD_TEMPLATES))


def forward_module(spec, score: TracedMod | None, mask: TracedMod | None, key: str,
                   template: str, params: KernelParams, flags: dict[str, object],
                   helpers: tuple[str, ...] = ("helpers.tmpl",),
                   others: tuple[tuple[str, str, KernelParams], ...] = (),
                   tile: str = TRITON_TILE, **hooks: str) -> GeneratedKernel:
    """The module of a forward kernel (fwd.tmpl, fwd_hopper.tmpl, fwd_fp8.tmpl,
    fwd_decode.tmpl): ``helpers``, the kernel library (common.tmpl) and the forward library
    (fwd_common.tmpl) filled with the mods, then ``template`` filled with ``hooks`` and the
    hooks every forward template has. ``flags``: the module flags, the kernel's constexprs
    but the launch flags. ``others``: further kernels of the template as (hook of their
    `def`, name suffix, parameters): kernel ``<name>_<suffix>``. ``tile``: how the mods'
    code writes a full tile of one value (``score_mod_code``)."""
    name = kernel_name(spec, key)
    kernels = [(name, params)]
    for hook, suffix, other in others:
        kernels.append((f"{name}_{suffix}", other))
        hooks[hook] = def_kernel(f"{name}_{suffix}", other, {
            n: flags[n] for n in other.constexpr_names if n not in LAUNCH_FLAGS})
    score_args, mask_args = mod_buffer_args(score, mask)
    score_names = [p for args in score_args for p in args.params]
    mask_names = [p for args in mask_args for p in args.params]
    folded = fold_scales(score.root) if score is not None else None
    flags = {**flags, "SCORE_IN_SCALE": folded.in_scale if folded else 1.0,
             "SCORE_OUT_SCALE": folded.out_scale if folded else 1.0}
    common = fill(load_template("common.tmpl"), MASK_BUFFERS=unpack(mask_names, "mbufs"),
                  MASK_MOD=mask_mod_code(mask, mask_args, wide=spec.wide_ints, tile=tile))
    library = fill(load_template("fwd_common.tmpl"), SCORE_BUFFERS=unpack(score_names, "sbufs"),
                   SCORE_MOD=score_mod_code(score, score_args, fast_math=not spec.interpret,
                                            wide=spec.wide_ints, tile=tile,
                                            root=folded.root if folded else None))
    checked = {n: flags[n] for n in params.constexpr_names if n not in LAUNCH_FLAGS}
    kernel = fill(load_template(template), KERNEL_NAME=name,
                  DEF_KERNEL=def_kernel(name, params, checked),
                  TABLES=as_tuple(table_names("KV", "m", "n")), SBUFS=as_tuple(score_names),
                  MBUFS=as_tuple(mask_names), **hooks)
    source = module_source(f"flexfa generated forward kernel: {name}", flags,
                           tuple(k for k, _ in kernels),
                           *(load_template(h) for h in helpers), common, library, kernel)
    return GeneratedKernel(key, name, source, describe_mods(score, mask), tuple(kernels))


def features(spec: KernelSpec) -> tuple[Param, ...]:
    """The parameters of the spec's optional features (sinks, dropout)."""
    return feature_params(spec.sinks_dtype, spec.dropout)


def module_flags(constexprs: dict[str, object]) -> dict[str, object]:
    """A forward module's flags: its kernel's constexprs but the launch flags."""
    return {name: value for name, value in constexprs.items() if name not in LAUNCH_FLAGS}


def forward_kernel(spec: KernelSpec, score: TracedMod | None, mask: TracedMod | None
                   ) -> GeneratedKernel:
    """Key, name and source of the forward kernel for these mods and this spec."""
    return forward_module(spec, score, mask, forward_key(spec, score, mask), "fwd.tmpl",
                          forward_params(False, buffer_params(score, mask), features=features(spec)),
                          module_flags(spec.constexprs(True)))


def forward_signature(spec: KernelSpec, score: TracedMod | None, mask: TracedMod | None
                      ) -> tuple[dict[str, str], dict[str, object]]:
    """(signature, constexprs) of the forward kernel, for ``triton.compile(ASTSource(...))``."""
    constexprs = spec.constexprs(score is not None)
    params = forward_params(False, buffer_params(score, mask), features=features(spec))
    return params.signature(constexprs, {INPUT: spec.dtype}), constexprs
