"""The decode family: ``fwd_decode.tmpl`` for calls with few query rows (decoding, speculative
verification, small chunks of a prefill) against a long key sequence.

One program per (batch, kv head, split): the GQA group's query heads times the query rows are
the rows of one tile, so K and V are read once per kv head instead of once per query head,
and L = 1 does not pad a 128-row tile. It runs every mod and block mask the other families do
and returns the same out, lse and row max, so the backward (``triton_bwd``) trains through it.

When it applies (``why_not``): L <= MAX_Q_LEN and G * L <= MAX_PACKED_ROWS, where packing
reads each K/V tile for all G * L rows at once; longer calls keep the Ampere and Hopper
families. ``kernel_options["BACKEND"] = "DECODE"`` forces it. ``flexfa.flex_decode`` runs it
with per-sequence lengths and query offsets and on paged KV caches (``DecodeInputs``).

Splits (``split_count``): kernel_options ``SPLIT_KV`` = n forces n (1: none); by default and
with ``"AUTO"`` the (batch, kv head) programs are split until there are about WAVES programs per
SM (a notional INTERPRET_SMS under the interpreter, so tests see splits), each split keeping
at least MIN_SPLIT_TILES key tiles. The count depends only on the call's shapes, so a CUDA graph
captured for a shape replays with it.
"""
from __future__ import annotations

import dataclasses

import torch

from ...blockmask.coarsen import block_size_text
from ...blockmask.union import union_tables
from ...blockmask.validate import capturing, table_generations
from ...codegen import decode as decode_codegen
from ...codegen.decode import OFFSETS_NONE, DecodeSpec, decode_kernel
from ...codegen.ranges import Domain, mods_int64_nodes
from ...codegen.spec import DTYPE_NAMES, next_power_of_two
from ...errors import InputError
from .. import binding, plans
from ..call import AttentionCall
from ..decode_inputs import (MAX_Q_LEN, NO_INPUTS, OFFSETS, DecodeInputs, kv_geometry,
                             split_workspaces)
from ..kernels import generated_module
from ..launch import Step, cdiv
from ..layout import int32_addressable
from ..outputs import allocate_outputs, present_or, stat_args
from ..registry import KernelFamily, register
from ..tables import dummy_table, largest_tile, mask_blocks
from ..target import Target, target_of
from .ampere import sm_count

# the light module's names for the kernel's offset modes are the codegen's
assert OFFSETS == (decode_codegen.OFFSETS_NONE, decode_codegen.OFFSETS_FROM_LENS,
                  decode_codegen.OFFSETS_TENSOR)
MAX_PACKED_ROWS = 128  # G * L: one tile's rows
WAVES = 2  # programs per SM the default split count aims at
INTERPRET_SMS = 4  # the notional SM count under the interpreter
MIN_SPLIT_TILES = 4  # key tiles a split keeps at least
MAX_SPLITS = 128


def kv_strides(t, inputs: DecodeInputs) -> tuple[int, int, int, int]:
    """(batch or page, head, key, dim) strides, as fwd_decode.tmpl's stride_k* read them."""
    if inputs.paged:
        return t.stride(0), t.stride(2), t.stride(1), t.stride(3)
    return tuple(t.stride())


def default_tiles(head_dim_pad: int, dtype: torch.dtype, target: Target,
                  rows: int = 16) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for ``rows`` packed rows: a memory-bound loop over
    key tiles (two stages in flight; 8 warps for 64 rows or more, whose score and output tiles
    would spill with 4; chosen from ptxas's register and spill counts, not timed yet)."""
    if target.interpret:
        return 64, 4, 1  # the interpreter's cost is per tile
    block_n = 16 if dtype == torch.float32 else 32  # 64 keys spill at head dim 128
    return block_n, 8 if rows >= 64 else 4, 2


def choose_block_n(call: AttentionCall, inputs: DecodeInputs, head_dim_pad: int, dtype,
                   target: Target, q_len: int) -> tuple[int, int, int]:
    """(BLOCK_N, warps, stages): the defaults or kernel_options, fitted to the mask's key
    block and the page size (a key tile never crosses either)."""
    block_n, warps, stages = default_tiles(head_dim_pad, dtype, target,
                                           next_power_of_two(call.gqa_group * q_len))
    options = call.options.fwd
    limits = [(f"block_mask {block_size_text(call.block_mask)}",
               mask_blocks(call.block_mask)[1])] if call.block_mask is not None else []
    if inputs.paged:
        limits.append((f"page size {inputs.page_size}", inputs.page_size))
    for _, size in limits:
        block_n = min(block_n, largest_tile(size))
    block_n = options.block_n or block_n
    for what, size in limits:
        if block_n < 16 or size % block_n:
            raise InputError(f"{what}: the decode kernel's key tile BLOCK_N={block_n} must divide "
                             f"{size} and be >= 16 (use a multiple of 16, or pass a smaller "
                             "kernel_options 'BLOCK_N')")
    return block_n, options.num_warps or warps, options.num_stages or stages


def split_count(call: AttentionCall, target: Target, programs: int, key_tiles: int,
                device) -> int:
    """Splits of each (batch, kv head) program's keys (see the module docstring)."""
    setting = call.options.split_kv
    if isinstance(setting, int) and setting > 0:
        return setting
    if setting == 0:
        return 1
    sms = INTERPRET_SMS if target.interpret else sm_count(device)
    wanted = cdiv(WAVES * sms, programs)
    return max(1, min(wanted, key_tiles // MIN_SPLIT_TILES, MAX_SPLITS))


def table_heads(call: AttentionCall) -> int:
    """Block-mask heads per kv head: the group's own tables, or 1 where they are shared."""
    mask = call.block_mask
    if mask is None or mask.kv_num_blocks.shape[1] == 1:
        return 1
    return call.gqa_group


def q_block_span(q_len: int, sparse_q: int, offsets: int) -> int:
    """The q blocks of the mask that Q_LEN consecutive positions can touch: from 0 exactly,
    from any offset one more where a run of them can cross a block's end."""
    if offsets == OFFSETS_NONE:
        return (q_len - 1) // sparse_q + 1
    return 1 if q_len == 1 else cdiv(q_len - 1, sparse_q) + 1


def query_positions(offsets: int, q_len: int, S: int) -> int:
    """The query positions the mods see, and a block mask covers: below S where offsets
    place the rows, else below q_len."""
    return q_len if offsets == OFFSETS_NONE else S


def union_walk(call: AttentionCall, members: int) -> bool:
    """Whether a block mask is walked as the union of the group's members' blocks (kernel
    option DECODE_WALK): by default where there are several members, each of whose own walk
    would read the K/V tiles they share again."""
    if call.block_mask is None or call.options.decode_walk == "MEMBERS":
        return False
    if capturing():
        # the union tables are derived from the mask's contents on the host (one sync):
        # a graph would replay them stale after an edit of the mask, so a capture walks the
        # members' own blocks, which the kernel reads from the tables at each replay
        if call.options.decode_walk == "UNION":
            raise InputError("kernel_options DECODE_WALK='UNION' cannot run inside a CUDA graph "
                             "capture: its tables are computed from the block mask's contents "
                             "on the host; leave DECODE_WALK unset ('AUTO' walks the members' "
                             "blocks there) or set it to 'MEMBERS'")
        return False
    return members > 1 or call.options.decode_walk == "UNION"


def walk_depends(call: AttentionCall, spec: DecodeSpec) -> tuple | None:
    """``Plan.depends`` of a decode plan: the union walk's tables hold the mask's contents
    of one generation, outside a capture; the members' walk that a capture takes where the
    union walk runs outside is for captures only (a plan key has neither)."""
    if spec.union_walk:
        return False, table_generations(call.block_mask)[1]
    if (spec.table_g * spec.qb_span > 1 and call.options.decode_walk != "MEMBERS"
            and capturing()):
        return True, None
    return None


def union_args(spec: DecodeSpec, call: AttentionCall, Hkv: int, S: int, device) -> dict:
    """The union tables of the plan's mask (``flexfa.blockmask.union``) over the q blocks of
    the call's query positions as the kernel's UNION_* arguments, or dummies without the
    union walk."""
    if not spec.union_walk:
        return {"UNION_NUM": dummy_table(device), "UNION_IDX": dummy_table(device),
                "UNION_STATUS": dummy_table(device, torch.int8), "union_sb": 0,
                "UNION_NQB": 0, "UNION_W": 0}
    count, blocks, status = union_tables(call.block_mask, Hkv, spec.table_g, spec.qb_span,
                                         cdiv(query_positions(spec.offsets, spec.q_len, S),
                                              spec.sparse_q),
                                         cdiv(S, spec.sparse_kv))
    B, _, nqb, width = blocks.shape
    return {"UNION_NUM": count, "UNION_IDX": blocks, "UNION_STATUS": status,
            "union_sb": 0 if B == 1 else Hkv * nqb, "UNION_NQB": nqb, "UNION_W": width}


def decode_spec(q, k, v, call: AttentionCall, target: Target, inputs: DecodeInputs,
                return_lse: bool, return_max: bool, write_parts: bool = False) -> DecodeSpec:
    B, Hq, L, E = q.shape
    Ev = v.shape[-1]
    _, S = kv_geometry(k, inputs)
    block_n, warps, stages = choose_block_n(call, inputs, next_power_of_two(E), q.dtype, target,
                                            L)
    mask = call.block_mask
    sparse_q, sparse_kv = mask_blocks(mask)
    if mask is None:
        sparse_q, sparse_kv = 16, block_n
    rows = call.gqa_group * L
    table_g = table_heads(call)
    qb_span = q_block_span(L, sparse_q, inputs.offsets) if mask is not None else 1
    q_positions = query_positions(inputs.offsets, L, S)
    return DecodeSpec(
        dtype=DTYPE_NAMES[q.dtype], head_dim=E, head_dim_v=Ev,
        block_m=next_power_of_two(rows), block_n=block_n, num_warps=warps, num_stages=stages,
        q_len=L, gqa_group=call.gqa_group, has_block_mask=mask is not None,
        has_full_blocks=mask is not None and getattr(mask, "full_kv_num_blocks", None) is not None,
        sparse_q=sparse_q, sparse_kv=sparse_kv, table_g=table_g, qb_span=qb_span,
        union_walk=union_walk(call, table_g * qb_span),
        even_s=inputs.kv_lens is None and S % sparse_kv == 0, return_lse=return_lse,
        return_max=return_max, input_precision=call.options.fp32_precision, target=target.name,
        offsets=inputs.offsets, has_kv_lens=inputs.kv_lens is not None, paged=inputs.paged,
        page_size=inputs.page_size, write_parts=write_parts,
        wide_ints=mods_int64_nodes((call.score, call.mask), Domain(B, Hq, q_positions, S)),
        max_registers=call.options.fwd.max_registers or 0, sinks_dtype=call.sinks_dtype)


class DecodeForward(KernelFamily):
    name = "decode"
    direction = "forward"
    priority = 20  # before Hopper and Ampere: where it applies, it reads K and V once per group
    features = frozenset({"sinks"})  # in the epilogue, or once in the combine kernel

    def why_not(self, target: Target, call, q, k, v) -> str | None:
        L = q.shape[2]
        if L > MAX_Q_LEN:
            return f"it runs calls of at most {MAX_Q_LEN} query rows, not {L}"
        if call.gqa_group * L > MAX_PACKED_ROWS:
            return (f"{call.gqa_group} query heads per kv head x {L} rows = "
                    f"{call.gqa_group * L} packed rows; it packs at most {MAX_PACKED_ROWS}")
        if call.options.fwd.use_tma:
            return "kernel_options USE_TMA=True asks for the tensor-descriptor (Hopper) family"
        if call.block_mask is not None and largest_tile(mask_blocks(call.block_mask)[1]) < 16:
            return (f"block_mask BLOCK_SIZE {tuple(call.block_mask.BLOCK_SIZE)} has key blocks "
                    "that no 16-wide tile divides")
        return None

    def first_call(self, key, target: Target, call, q, k, v, return_lse, return_max,
                   inputs: DecodeInputs = NO_INPUTS):
        B, Hq, L, _ = q.shape
        Hkv, S = kv_geometry(k, inputs)
        spec = decode_spec(q, k, v, call, target, inputs, return_lse, return_max)
        splits = split_count(call, target, B * Hkv, cdiv(S, spec.block_n), q.device)
        if splits > 1:
            spec = dataclasses.replace(spec, write_parts=True)
        loaded = generated_module(decode_kernel, spec, call.score, call.mask)
        table = inputs.page_table
        fixed = {**binding.strides("q", "bhmd", q.stride()),
                 **binding.strides("k", "bhnd", kv_strides(k, inputs)),
                 **binding.strides("v", "bhnd", kv_strides(v, inputs)),
                 **binding.strides("pt", "bp", table.stride() if table is not None else (0, 0)),
                 **binding.tables("KV", "m", "n", call.block_mask, "kv", q.device),
                 **union_args(spec, call, Hkv, S, q.device),
                 "HKV": Hkv, "S": S, **binding.buffer_layout(call.score, call.mask)}
        steps = [Step(loaded.kernel(), (B * Hkv, splits), spec.constexprs(call.scores_first),
                      spec.launch_options(), binding.Binder(loaded.names(), fixed))]
        if splits > 1:
            combine = f"{loaded.name}_combine"
            steps.append(Step(loaded.kernel(combine), (B * Hkv,), spec.combine_constexprs(),
                              {"num_warps": 4, "num_stages": 1},
                              binding.Binder(loaded.names(combine),
                                             {"HKV": Hkv, "SPLITS": splits})))
        plan = plans.Plan(self, spec, tuple(steps),
                          {"splits": splits, "rows": (B * Hkv, call.gqa_group * L)},
                          walk_depends(call, spec))
        if plan.depends != (False, None):
            plans.keep(call, key, plan)  # union tables of unknown contents: built every call
        return self.run(plan, call, q, k, v, return_lse, return_max, inputs)

    def run(self, plan, call, q, k, v, return_lse, return_max, inputs: DecodeInputs = NO_INPUTS):
        if inputs.workspace is not None:
            out, lse, maxs, parts, part_lse, part_max = inputs.workspace.buffers(
                plan, q, v, return_lse, return_max)
        else:
            out, lse, maxs = allocate_outputs(q, v, return_lse, return_max)
            parts, part_lse, part_max = split_workspaces(plan, v)
        stat_lse, stat_max = stat_args(out, lse, maxs)
        dummy = dummy_table(q.device)
        outputs = {"OUT": out, "LSE": stat_lse, "MAXS": stat_max,
                   **binding.strides("o", "bhmd", out.stride()), **binding.feature_values(call)}
        workspaces = {"PARTS": parts, "PART_LSE": part_lse, "PART_MAX": part_max} \
            if parts is not None else {"PARTS": stat_lse, "PART_LSE": stat_lse,
                                       "PART_MAX": stat_lse}
        main = plan.steps[0]
        main.launch_with(
            {"Q": q, "K": k, "V": v, **outputs, **workspaces,
             "KV_LENS": present_or(inputs.kv_lens, dummy),
             "Q_OFFSETS": present_or(inputs.q_offsets, dummy),
             "PAGE_TABLE": present_or(inputs.page_table, dummy), "sm_scale": float(call.scale),
             **binding.buffer_pointers(call.score, call.mask)}, q.device)
        if len(plan.steps) > 1:
            plan.steps[1].launch_with({**outputs, **workspaces}, q.device)
        return out, lse, maxs


def decode_plan_key(q, k, v, call: AttentionCall, inputs: DecodeInputs, return_lse: bool,
                    return_max: bool) -> tuple:
    # (a union walk's dependence on the mask's contents and on captures: Plan.depends)
    return ("decode", return_lse, return_max, inputs.key(), *plans.layout_key(q, k, v, call))


def run_decode(q, k, v, call: AttentionCall, inputs: DecodeInputs, return_lse: bool,
               return_max: bool = False) -> tuple:
    """(out, lse or None, row max or None) of a validated ``flex_decode`` call."""
    if not inputs.paged:  # (a paged cache's offsets inside a page are small)
        k, v = int32_addressable(k, "key"), int32_addressable(v, "value")
    key = decode_plan_key(q, k, v, call, inputs, return_lse, return_max)
    plan = plans.find(call, key)
    if plan is not None:
        return DECODE.run(plan, call, q, k, v, return_lse, return_max, inputs)
    target = target_of(q.device)
    if call.options.backend not in ("AUTO", "DECODE"):
        raise InputError(f"flex_decode runs the decode family; kernel_options BACKEND="
                         f"{call.options.backend!r} names another")
    reason = DECODE.why_not(target, call, q, k, v)
    if reason is not None:
        raise InputError(f"flex_decode cannot run this call: {reason}")
    return DECODE.first_call(key, target, call, q, k, v, return_lse, return_max, inputs)


DECODE = register(DecodeForward())
