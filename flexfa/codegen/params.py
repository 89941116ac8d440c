"""Kernel parameter lists, described once.

A kernel's parameters are a ``KernelParams``: ordered groups of ``Param`` (name, kind, element
type). The one description renders the kernel's ``def`` (``def_kernel``: the ``{{DEF_KERNEL}}``
hook of its template, with the compile-time check that its constexprs are its module's
flags), names the arguments a launcher passes (``names`` positionally, in order;
``constexpr_names`` as keywords; ``GeneratedKernel.params`` exposes them) and gives the Triton
signature of a compile-only check (``signature``). Groups several kernels share (a tensor's
strides, a block mask's tables, captured tensors) are built by one function each;
``as_tuple`` / ``unpack`` render a group as the tuple a kernel hands its helper functions and
the statement that unpacks it.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

import torch

from .render import BufferArgs

TENSOR = "tensor"  # a pointer to tensor data: `*<dtype>`
DESCRIPTOR = "descriptor"  # a host tensor descriptor: `tensordesc<<dtype>[<block>]>`
INT = "int"  # i32
FLOAT = "float"  # fp32
CONSTEXPR = "constexpr"
KINDS = (TENSOR, DESCRIPTOR, INT, FLOAT, CONSTEXPR)
# element types a signature resolves per call (``signature(types=...)``): q/k/v's dtype, the
# output's dtype
INPUT, OUTPUT = "input", "output"

_TRITON_TYPES = {torch.bool: "i1", torch.int8: "i8", torch.uint8: "u8", torch.int16: "i16",
                 torch.int32: "i32", torch.int64: "i64", torch.float16: "fp16",
                 torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}


@dataclasses.dataclass(frozen=True)
class Param:
    name: str
    kind: str
    dtype: str = ""  # TENSOR, DESCRIPTOR: a Triton element type ("fp32"), INPUT or OUTPUT
    # DESCRIPTOR: its block shape, constexpr names or fixed sizes
    block: tuple[str | int, ...] = ()

    def __post_init__(self):
        assert self.kind in KINDS, f"parameter {self.name}: kind {self.kind!r} not in {KINDS}"
        assert bool(self.dtype) == (self.kind in (TENSOR, DESCRIPTOR)), (
            f"parameter {self.name}: a {self.kind} {'needs' if not self.dtype else 'has no'} "
            "element type")


@dataclasses.dataclass(frozen=True)
class KernelParams:
    """A kernel's parameters in ``def`` order, in groups (one line or more each when
    rendered)."""

    groups: tuple[tuple[Param, ...], ...]

    def __post_init__(self):
        names = [p.name for p in self.params]
        assert len(set(names)) == len(names), f"parameters named twice in {names}"
        kinds = [p.kind == CONSTEXPR for p in self.params]
        assert kinds == sorted(kinds), "constexpr parameters must come last"

    @property
    def params(self) -> tuple[Param, ...]:
        return tuple(p for group in self.groups for p in group)

    @property
    def names(self) -> tuple[str, ...]:
        """The positional arguments, in order."""
        return tuple(p.name for p in self.params if p.kind != CONSTEXPR)

    @property
    def constexpr_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params if p.kind == CONSTEXPR)

    def render(self, width: int = 92) -> str:
        """The ``def``'s parameter list: one group a line (wrapped at ``width``), each line
        ending in a comma."""
        lines = []
        for group in self.groups:
            lines += _wrap([f"{p.name}: tl.constexpr" if p.kind == CONSTEXPR else p.name
                            for p in group], ", ", width, ",")
        return "\n".join(lines)

    def signature(self, constexprs: Mapping[str, object], types: Mapping[str, str] = {}
                  ) -> dict[str, str]:
        """The Triton signature for ``triton.compile(ASTSource(...))``: ``types`` resolves
        INPUT and OUTPUT; a descriptor's block shape comes from ``constexprs``."""
        assert set(constexprs) == set(self.constexpr_names), (
            f"constexprs {sorted(constexprs)} are not the kernel's {sorted(self.constexpr_names)}")
        signature = {}
        for p in self.params:
            element = types.get(p.dtype, p.dtype)
            if p.kind == TENSOR:
                signature[p.name] = f"*{element}"
            elif p.kind == DESCRIPTOR:
                block = ", ".join(str(b if isinstance(b, int) else constexprs[b])
                                  for b in p.block)
                signature[p.name] = f"tensordesc<{element}[{block}]>"
            else:
                signature[p.name] = {INT: "i32", FLOAT: "fp32", CONSTEXPR: "constexpr"}[p.kind]
        return signature


def _wrap(items: list[str], separator: str, width: int, end: str = "") -> list[str]:
    """``items`` joined by ``separator`` into lines of at most ``width`` characters (an item
    is never split), each line ending in the separator's stripped form, the last in ``end``."""
    lines, line = [], ""
    for item in items:
        if line and len(line) + len(separator) + len(item) > width:
            lines.append(line + separator.rstrip())
            line = item
        else:
            line = f"{line}{separator}{item}" if line else item
    return lines + [line + end] if line else lines


def tensors(dtype: str, *names: str) -> tuple[Param, ...]:
    return tuple(Param(name, TENSOR, dtype) for name in names)


def ints(*names: str) -> tuple[Param, ...]:
    return tuple(Param(name, INT) for name in names)


def strides(prefix: str, dims: str) -> tuple[Param, ...]:
    """``stride_<prefix><d>`` for each dimension letter: ``strides("q", "bhmd")``."""
    return ints(*(f"stride_{prefix}{d}" for d in dims))


def constexprs(*names: str) -> tuple[Param, ...]:
    return tuple(Param(name, CONSTEXPR) for name in names)


def block_mask_tables(table: str, row: str, col: str) -> tuple[tuple[Param, ...], ...]:
    """A block mask's partial and full tables (``KV_NUM_BLOCKS, KV_INDICES, FULL_KV_...``
    for ``table="KV"``) and their strides over (batch, head, ``row``) and, for the index
    tables, ``col``: five groups (tables; num-blocks, indices, full num-blocks, full indices
    strides)."""
    tables = tensors("i32", f"{table}_NUM_BLOCKS", f"{table}_INDICES", f"FULL_{table}_NUM_BLOCKS",
                     f"FULL_{table}_INDICES")
    return (tables, strides("nb_", "bh" + row), strides("ix_", "bh" + row + col),
            strides("fnb_", "bh" + row), strides("fix_", "bh" + row + col))


def table_names(table: str, row: str, col: str) -> tuple[str, ...]:
    """The names of ``block_mask_tables(table, row, col)`` in order: the tuple the table walk
    of common.tmpl (``flexfa_walk_mask``) unpacks."""
    return tuple(p.name for group in block_mask_tables(table, row, col) for p in group)


def captured(args: Iterable[BufferArgs], dtypes: Iterable[torch.dtype]) -> tuple[Param, ...]:
    """A mod's captured tensors: each one's pointer (its element type), strides and sizes."""
    params: list[Param] = []
    for arg, dtype in zip(args, dtypes, strict=True):
        params += [Param(arg.ptr, TENSOR, _TRITON_TYPES[dtype]), *ints(*arg.strides, *arg.sizes)]
    return tuple(params)


def gradients(args: Iterable[BufferArgs], dtype: str) -> tuple[Param, ...]:
    """The gradients of a score_mod's captured tensors: each one's pointer (element type
    ``dtype``) and strides."""
    return tuple(p for arg in args for p in (Param(arg.ptr, TENSOR, dtype), *ints(*arg.strides)))


def as_tuple(names: Iterable[str]) -> str:
    """``(a, b)``, ``(a,)`` or ``()``: a group handed on as one value."""
    names = list(names)
    return f"({names[0]},)" if len(names) == 1 else f"({', '.join(names)})"


def unpack(names: Iterable[str], value: str) -> str:
    """The statement giving ``names`` back from the tuple ``value`` (empty for no names)."""
    names = list(names)
    if not names:
        return ""
    lines = _wrap(names, ", ", 88, ",) = " + value if len(names) == 1 else ") = " + value)
    return "\n ".join(["(" + lines[0], *lines[1:]])


def def_kernel(name: str, params: KernelParams, flags: Mapping[str, object]) -> str:
    """A kernel's ``def``: its name, its parameters and, first in its body, a compile-time
    check that its constexpr parameters carry ``flags``, the values of its module's flags
    (the helper functions read the module's flags, the kernel's body its parameters)."""
    lines = [f"def {name}(", *("    " + line for line in params.render().split("\n")), "):"]
    if flags:
        terms = [f"({flag} == {value!r})" for flag, value in flags.items()]
        lines += ["    tl.static_assert(", *("        " + line for line in
                                             _wrap(terms, " and ", 84, ",")),
                  '        "the constexprs differ from the flags this module was generated '
                  'for")']
    return "\n".join(lines)


# ---- the kernels' descriptions ------------------------------------------------------------

_FORWARD_CONSTEXPRS = constexprs(
    "BLOCK_M", "BLOCK_N", "E", "E_PAD", "EV", "EV_PAD", "HAS_SCORE_MOD", "HAS_BLOCK_MASK",
    "HAS_FULL_BLOCKS", "SPARSE_Q", "SPARSE_KV", "EVEN_L", "EVEN_S", "RETURN_LSE", "GQA_GROUP")
_SCALARS = ints("HQ", "L", "S") + (Param("sm_scale", FLOAT),)


def forward_params(hopper: bool, buffers: tuple[Param, ...], strided: bool = False,
                   features: tuple[Param, ...] = (), kv_heads: bool = False) -> KernelParams:
    """fwd.tmpl's kernel, or with ``hopper`` fwd_hopper.tmpl's (q, k, v through host tensor
    descriptors, with ``strided`` their batch, head and row strides too, with ``kv_heads``
    k and v over [B * HKV, S, dim] heads, [B, HKV, S, dim] with ``strided`` (a ragged S), and
    SPLIT_KV for the Ampere kernel's SPLIT_KEYS); ``buffers``: the mods' ``captured``
    tensors; ``features``: ``feature_params``."""
    if hopper:
        rows = ((1, 1, "BLOCK_N") if strided else (1, "BLOCK_N")) if kv_heads else ("BLOCK_N",)
        inputs = (Param("Q_DESC", DESCRIPTOR, INPUT, ("BLOCK_M", "E_PAD")),
                  Param("K_DESC", DESCRIPTOR, INPUT, (*rows, "E_PAD")),
                  Param("V_DESC", DESCRIPTOR, INPUT, (*rows, "EV_PAD")))
        input_strides: tuple[tuple[Param, ...], ...] = (
            (strides("q", "bhm"), strides("k", "bhn"), strides("v", "bhn")) if strided else ())
    else:
        inputs = tensors(INPUT, "Q", "K", "V")
        input_strides = (strides("q", "bhmd"), strides("k", "bhnd"), strides("v", "bhnd"))
    own = constexprs("RETURN_MAX", "INPUT_PRECISION", "DOT_IN_FP32", "HAS_SINKS", "DROPOUT")
    template_flags = (constexprs("STRIDED_QKV", "SPLIT_KV") if hopper
                      else constexprs("SPLIT_KEYS"))
    # HEAD_GROUP: flexfa_longest_first's heads per group under a block mask
    scalars = _SCALARS + (ints("HEAD_GROUP") if hopper else ())
    return KernelParams((
        inputs + tensors(INPUT, "OUT") + tensors("fp32", "LSE", "MAXS"), *input_strides,
        strides("o", "bhmd"), *block_mask_tables("KV", "m", "n"), scalars + buffers, features,
        _FORWARD_CONSTEXPRS + own + template_flags))


def decode_params(buffers: tuple[Param, ...], features: tuple[Param, ...] = ()) -> KernelParams:
    """fwd_decode.tmpl's kernel: one program per (batch * kv head, split), contiguous or paged
    keys; the per-sequence key counts, query offsets and page table (dummies where unused);
    the split workspaces; the union tables of ``flexfa.blockmask.union`` (dummies without the
    union walk); ``buffers``: the mods' ``captured`` tensors; ``features``:
    ``feature_params`` (sinks only)."""
    return KernelParams((
        tensors(INPUT, "Q", "K", "V", "OUT") + tensors("fp32", "LSE", "MAXS")
        + tensors("fp32", "PARTS", "PART_LSE", "PART_MAX")
        + tensors("i32", "KV_LENS", "Q_OFFSETS", "PAGE_TABLE"),
        strides("q", "bhmd"), strides("k", "bhnd"), strides("v", "bhnd"), strides("o", "bhmd"),
        strides("pt", "bp"), *block_mask_tables("KV", "m", "n"),
        tensors("i32", "UNION_NUM", "UNION_IDX") + tensors("i8", "UNION_STATUS")
        + ints("union_sb", "UNION_NQB", "UNION_W"),
        ints("HKV", "S") + (Param("sm_scale", FLOAT),) + buffers, features,
        constexprs("BLOCK_M", "BLOCK_N", "E", "E_PAD", "EV", "EV_PAD", "HAS_SCORE_MOD",
                   "HAS_BLOCK_MASK", "HAS_FULL_BLOCKS", "SPARSE_Q", "SPARSE_KV", "EVEN_S",
                   "RETURN_LSE", "RETURN_MAX", "GQA_GROUP", "Q_LEN", "TABLE_G", "QB_SPAN",
                   "OFFSETS", "HAS_KV_LENS", "PAGED", "PAGE_SIZE", "WRITE_PARTS",
                   "UNION_WALK", "INPUT_PRECISION", "DOT_IN_FP32", "HAS_SINKS")))


def _combine_params(shape: tuple[Param, ...], features: tuple[Param, ...],
                    tiles: tuple[Param, ...]) -> KernelParams:
    """A split-KV combine kernel: the split workspaces into the outputs (and the sinks,
    ``features``, added once); ``shape`` and ``tiles``: how it finds its rows."""
    return KernelParams((
        tensors("fp32", "PARTS", "PART_LSE", "PART_MAX") + tensors(INPUT, "OUT")
        + tensors("fp32", "LSE", "MAXS"),
        strides("o", "bhmd"), shape, features,
        tiles + constexprs("EV", "EV_PAD", "RETURN_LSE", "RETURN_MAX", "HAS_SINKS")))


def decode_combine_params(features: tuple[Param, ...] = ()) -> KernelParams:
    """fwd_decode.tmpl's combine kernel: one program per batch * kv head, its packed rows."""
    return _combine_params(ints("HKV", "SPLITS"), features,
                           constexprs("BLOCK_M", "GQA_GROUP", "Q_LEN"))


def hopper_combine_params(features: tuple[Param, ...] = ()) -> KernelParams:
    """fwd_hopper.tmpl's combine kernel: BLOCK_M of the ROWS = B * HQ * L rows per
    program."""
    return _combine_params(ints("HQ", "L", "ROWS", "SPLITS"), features, constexprs("BLOCK_M"))


def fp8_params(buffers: tuple[Param, ...], features: tuple[Param, ...] = ()) -> KernelParams:
    """fwd_fp8.tmpl's kernel: e4m3 q, k, v with float32 descales, output in OUTPUT;
    HEAD_GROUP as ``forward_params``'s; ``features``: ``feature_params`` (sinks only)."""
    return KernelParams((
        tensors("fp8e4nv", "Q", "K", "V") + tensors("fp32", "Q_SCALE", "K_SCALE", "V_SCALE")
        + tensors(OUTPUT, "OUT") + tensors("fp32", "LSE"),
        strides("q", "bhmd"), strides("k", "bhnd"), strides("v", "bhnd"), strides("o", "bhmd"),
        strides("qs_", "bh") + strides("kvs_", "bh"), *block_mask_tables("KV", "m", "n"),
        _SCALARS + ints("HEAD_GROUP") + buffers, features,
        _FORWARD_CONSTEXPRS + constexprs("SCALE_Q", "SCALE_KV", "P_SHIFT", "EMULATE_FP8_CAST",
                                         "USE_TMA", "FOLD_QK_SCALE", "HAS_SINKS")))


def quantize_params() -> KernelParams:
    """fwd_fp8_quantize.tmpl's kernel: X (INPUT) to e4m3 X8 with per-block descales."""
    return KernelParams((
        tensors(INPUT, "X") + tensors("fp8e4nv", "X8") + tensors("fp32", "SCALE", "SIGNED_H"),
        strides("x", "bhnd"), strides("o", "bhnd"), strides("s", "bh"),
        ints("H", "N") + (Param("inv_sqrt_d", FLOAT),),
        constexprs("E", "E_PAD", "E_OUT", "BLOCK", "ROWS", "ROTATE", "DOT_IN_FP32",
                   "EMULATE_FP8_CAST")))


def _pointer_or_descriptor(name: str, descriptor: bool, dtype: str, *block: str) -> Param:
    """A backward kernel's descriptor slot: a tensor descriptor with TMA, else an unused
    pointer."""
    return Param(name, DESCRIPTOR, dtype, block) if descriptor else Param(name, TENSOR, dtype)


def _ds_workspace(tma: bool) -> tuple[tuple[Param, ...], ...]:
    """The dS workspace (bwd_dkdv.tmpl's STORE_DS, bwd_dq.tmpl's LOAD_DS) and its band table:
    the groups both backward kernels take before their strides."""
    return ((_pointer_or_descriptor("DS_DESC", tma, INPUT, "BLOCK_N", "BLOCK_M"),
             *tensors("i32", "DS_BAND")), strides("band_", "bhn") + ints("MAX_SLOTS"))


def _column_blocks(name: str, tma: bool, split: bool, *rows: str | int) -> tuple[Param, ...]:
    """A backward kernel's descriptor slots of a q/k head-dim tensor: ``name`` over the
    columns [0, E_A) and, with ``split`` (E_B > 0), ``name``_B over [E_A, E_A + E_B)."""
    first = _pointer_or_descriptor(name, tma, INPUT, *rows, "E_A")
    return (first, _pointer_or_descriptor(f"{name}_B", tma, INPUT, *rows, "E_B")) if split \
        else (first,)


def dq_params(tma: bool, ds_tma: bool, buffers: tuple[Param, ...],
              features: tuple[Param, ...] = (), split: bool = False) -> KernelParams:
    """bwd_dq.tmpl's kernel (``tma``: K, V through descriptors; ``ds_tma``: the dS workspace
    too; ``split``: the q/k head dim in two column blocks, K and dQ with a descriptor each);
    ``buffers``: the mods' captured tensors, then the score_mod's gradients; ``features``:
    ``feature_params`` (dropout only)."""
    ds = _ds_workspace(ds_tma)
    return KernelParams((
        tensors(INPUT, "Q", "K", "V", "DO")
        + _column_blocks("K_DESC", tma, split, 1, "BLOCK_N")
        + (_pointer_or_descriptor("V_DESC", tma, INPUT, 1, "BLOCK_N", "EV_PAD"),)
        + tensors(INPUT, "DQ") + _column_blocks("DQ_DESC", tma, split, 1, "BLOCK_M")
        + tensors("fp32", "LSE", "DELTA") + tensors(INPUT, "OUT")
        + tensors("fp32", "DLSE") + tensors(INPUT, "DS") + ds[0], ds[1],
        strides("q", "bhmd"), strides("k", "bhnd"), strides("v", "bhnd"), strides("g", "bhmd"),
        strides("dq", "bhmd"), strides("o", "bhmd"), *block_mask_tables("KV", "m", "n"),
        _SCALARS + buffers, features,
        constexprs("BLOCK_M", "BLOCK_N", "E", "E_PAD", "E_A", "E_B", "EV", "EV_PAD",
                   "HAS_BLOCK_MASK", "HAS_FULL_BLOCKS", "SPARSE_Q", "SPARSE_KV", "EVEN_L",
                   "EVEN_S", "GQA_GROUP", "HAS_DLSE", "DSCORE_IS_ONE", "HAS_BUFFER_GRADS",
                   "DETERMINISTIC", "INPUT_PRECISION", "DOT_UPCAST", "USE_TMA", "LOAD_DS",
                   "DS_TMA", "DROPOUT", "RAGGED_APART")))


def dkdv_params(tma: bool, ds_tma: bool, buffers: tuple[Param, ...],
                features: tuple[Param, ...] = (), split: bool = False,
                head_views: bool = False) -> KernelParams:
    """bwd_dkdv.tmpl's kernel (``tma``: Q, dO through descriptors, over the [B * H * L, d]
    rows or with ``head_views`` (ragged L) the [B * H, L, d] heads; ``ds_tma``: the dS
    workspace too; ``split``: the q/k head dim in two column blocks, Q with a descriptor
    each); ``buffers``: the mods' captured tensors; ``features``: ``feature_params``
    (dropout only)."""
    ds = _ds_workspace(ds_tma)
    rows = (1, "BLOCK_M") if head_views else ("BLOCK_M",)
    return KernelParams((
        tensors(INPUT, "Q", "K", "V", "DO") + _column_blocks("Q_DESC", tma, split, *rows)
        + (_pointer_or_descriptor("DO_DESC", tma, INPUT, *rows, "EV_PAD"),)
        + tensors(INPUT, "DK", "DV") + tensors("fp32", "LSE", "DELTA")
        + tensors(INPUT, "DS") + ds[0], ds[1],
        strides("q", "bhmd"), strides("k", "bhnd"), strides("v", "bhnd"), strides("g", "bhmd"),
        strides("dk", "bhnd"), strides("dv", "bhnd"), *block_mask_tables("Q", "n", "m"),
        _SCALARS + buffers, features,
        constexprs("BLOCK_M", "BLOCK_N", "E", "E_PAD", "E_A", "E_B", "EV", "EV_PAD",
                   "HAS_BLOCK_MASK", "HAS_FULL_BLOCKS", "SPARSE_Q", "SPARSE_KV", "EVEN_L",
                   "EVEN_S", "GQA_GROUP", "DSCORE_IS_ONE", "INPUT_PRECISION", "DOT_UPCAST",
                   "USE_TMA", "STORE_DS", "DS_TMA", "DROPOUT", "DV_LAST", "ONE_LOOP",
                   "ROW_OFFSETS", "RAGGED_L_APART")))


def delta_params() -> KernelParams:
    """bwd_common.tmpl's ``flexfa_bwd_delta``."""
    return KernelParams((
        tensors(INPUT, "OUT", "DOUT") + tensors("fp32", "DLSE", "DELTA"),
        strides("o", "bhmd"), strides("g", "bhmd"), ints("HQ", "L"),
        constexprs("BLOCK_M", "EV", "EV_PAD", "HAS_DLSE")))


def feature_params(sinks_dtype: str, dropout: bool) -> tuple[Param, ...]:
    """The parameters of a kernel's optional features, present only where the kernel has
    them: attention sinks (``SINKS``, one logit per query head, element type
    ``sinks_dtype``; "" for none) and dropout (``DROPOUT_SEED``: int64 [seed, offset];
    ``dropout_threshold``: round(p * 2**16); ``dropout_scale``: 1 / the keep rate,
    ``runtime.dropout.scale``)."""
    params = tensors(sinks_dtype, "SINKS") if sinks_dtype else ()
    if dropout:
        params += tensors("i64", "DROPOUT_SEED") + ints("dropout_threshold") + (
            Param("dropout_scale", FLOAT),)
    return params


def dropout_mask_params() -> KernelParams:
    """dropout_mask.tmpl's kernel: the keep mask (uint8 [B, H, L, S]) of a seed."""
    return KernelParams((tensors("u8", "KEEP") + tensors("i64", "SEED"),
                         ints("L", "S", "threshold"), constexprs("BLOCK_M", "BLOCK_N")))
