"""Generating the forward kernel: fill ``fwd.tmpl`` with the rendered score_mod and mask_mod.

``forward_kernel(spec, score, mask)`` returns the kernel's cache key, name and source; it is a
pure function of the mods' IR (their ``TracedMod.key``: structure and buffer shapes/dtypes,
never buffer values) and the ``KernelSpec``.
"""
from __future__ import annotations

import dataclasses

from ..frontend.trace import TracedMod
from .render import BufferArgs, Leaves, buffer_args, needs_tile_broadcast, render_mod
from .spec import KernelSpec, kernel_name, spec_key
from .template import fill, load_template, template_hash
from .versions import versions_key

FORWARD_TEMPLATES = ("fwd.tmpl", "helpers.tmpl")
# names the hooks see inside the tile function of fwd.tmpl
FORWARD_LEAVES = Leaves(score="score", b="off_b", h="off_h", q_idx="q_idx", kv_idx="kv_idx")


@dataclasses.dataclass(frozen=True)
class GeneratedKernel:
    key: str  # sha256 of everything that decides the source
    name: str  # the kernel function's name, also the file name
    source: str
    mods: str = ""  # the mods it was rendered from, for error messages ("score_mod 'alibi'")


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


def score_mod_code(score: TracedMod | None, args: list[BufferArgs], fast_math: bool = False,
                   wide: tuple[str, ...] = ()) -> str:
    """Statements setting ``score_mod_out`` (a full fp32 tile) from ``score`` and indices;
    ``fast_math`` for GPU targets (hardware tanh/sigmoid/exp); ``wide``: the spec's
    ``wide_ints``."""
    if score is None:
        return "score_mod_out = score"
    rendered = render_mod(score, [score.root], FORWARD_LEAVES, args, prefix="s",
                          fast_math=fast_math, wide=wide)
    value = rendered.values[0]
    if needs_tile_broadcast(score.root):
        value = f"tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32) + ({value})"
    return "\n".join([*rendered.lines, f"score_mod_out = {value}"])


def mask_mod_code(mask: TracedMod | None, args: list[BufferArgs], wide: tuple[str, ...] = ()
                  ) -> str:
    """Statements setting ``mask_mod_out`` (bool, True = keep) from the indices."""
    if mask is None:
        return "mask_mod_out = True"
    rendered = render_mod(mask, [mask.root], dataclasses.replace(FORWARD_LEAVES, score=None),
                          args, prefix="m", wide=wide)
    value = rendered.values[0]
    if needs_tile_broadcast(mask.root):
        value = f"tl.full([BLOCK_M, BLOCK_N], 1, tl.int1) & ({value})"
    return "\n".join([*rendered.lines, f"mask_mod_out = {value}"])


def forward_key(spec: KernelSpec, score: TracedMod | None, mask: TracedMod | None) -> str:
    return spec_key(spec, score.key if score else "-", mask.key if mask else "-",
                    versions_key(), template_hash(*FORWARD_TEMPLATES))


def mod_hooks(score: TracedMod | None, mask: TracedMod | None, fast_math: bool,
              wide: tuple[str, ...] = ()) -> dict[str, str]:
    """The hooks every forward-style template shares: helpers, captured-buffer parameters
    and arguments, and the rendered score_mod / mask_mod (``wide``: the spec's
    ``wide_ints``)."""
    score_args, mask_args = mod_buffer_args(score, mask)
    names = [p for args in (*score_args, *mask_args) for p in args.params]
    return dict(
        HELPERS=load_template("helpers.tmpl").rstrip("\n"),
        BUFFER_PARAMS="".join(f", {p}" for p in names),
        BUFFER_ARGS="".join(f", {p}" for p in names),
        SCORE_MOD=score_mod_code(score, score_args, fast_math=fast_math, wide=wide),
        MASK_MOD=mask_mod_code(mask, mask_args, wide=wide),
    )


def forward_kernel(spec: KernelSpec, score: TracedMod | None, mask: TracedMod | None
                   ) -> GeneratedKernel:
    """Key, name and source of the forward kernel for these mods and this spec."""
    key = forward_key(spec, score, mask)
    name = kernel_name(spec, key)
    source = fill(load_template("fwd.tmpl"), KERNEL_NAME=name,
                  **mod_hooks(score, mask, fast_math=not spec.interpret, wide=spec.wide_ints))
    return GeneratedKernel(key, name, source, describe_mods(score, mask))


_TRITON_TYPES = {"bool": "i1", "int8": "i8", "uint8": "u8", "int16": "i16", "int32": "i32",
                 "int64": "i64", "float16": "fp16", "bfloat16": "bf16", "float32": "fp32",
                 "float64": "fp64"}


def buffer_signature(traced: TracedMod | None, args: list[BufferArgs]) -> dict[str, str]:
    """Triton signature entries of a mod's captured tensors (for compile-only checks)."""
    signature = {}
    for arg, (_, dtype) in zip(args, traced.buffer_specs if traced else ()):
        signature[arg.ptr] = "*" + _TRITON_TYPES[str(dtype).replace("torch.", "")]
        signature.update({name: "i32" for name in (*arg.strides, *arg.sizes)})
    return signature


def forward_signature(spec: KernelSpec, score: TracedMod | None, mask: TracedMod | None
                      ) -> tuple[dict[str, str], dict[str, object]]:
    """(signature, constexprs) of the forward kernel, for ``triton.compile(ASTSource(...))``."""
    element = f"*{spec.dtype}"
    signature = {"Q": element, "K": element, "V": element, "OUT": element, "LSE": "*fp32",
                 "MAXS": "*fp32"}
    for tensor, dims in (("q", "bhmd"), ("k", "bhnd"), ("v", "bhnd"), ("o", "bhmd")):
        signature.update({f"stride_{tensor}{d}": "i32" for d in dims})
    constexprs = spec.constexprs(score is not None)
    signature.update(tables_and_mods_signature(score, mask, constexprs))
    return signature, constexprs


def tables_and_mods_signature(score: TracedMod | None, mask: TracedMod | None,
                              constexprs: dict[str, object]) -> dict[str, str]:
    """The signature entries forward-style kernels share after their tensors and strides:
    block-mask tables and strides, HQ/L/S/sm_scale, captured buffers, then constexprs."""
    signature = {name: "*i32" for name in ("KV_NUM_BLOCKS", "KV_INDICES", "FULL_KV_NUM_BLOCKS",
                                           "FULL_KV_INDICES")}
    for table, dims in (("nb", "bhm"), ("ix", "bhmn"), ("fnb", "bhm"), ("fix", "bhmn")):
        signature.update({f"stride_{table}_{d}": "i32" for d in dims})
    signature.update(HQ="i32", L="i32", S="i32", sm_scale="fp32")
    score_args, mask_args = mod_buffer_args(score, mask)
    signature.update(buffer_signature(score, score_args))
    signature.update(buffer_signature(mask, mask_args))
    signature.update({name: "constexpr" for name in constexprs})
    return signature
