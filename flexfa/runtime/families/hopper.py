"""The Hopper forward family: ``fwd_hopper.tmpl`` (Q/K/V tiles through tensor descriptors,
wgmma-sized tiles, one flat pipelined loop per block table, longest q tiles first).

Applies on sm_90 to fp16/bf16 inputs with head dims 8..256 whose [B, H, len, dim] layout
flattens to 16-byte aligned rows (what tensor descriptors need), unless kernel_options say
``USE_TMA=False``. Under the interpreter it runs when forced (``BACKEND="HOPPER"`` or
``USE_TMA=True``): how CI tests it. Tiles are tuned per class on the GPU
(``flexfa.runtime.autotune``); a config that does not fit the GPU's shared memory falls back
to smaller ones at the first launch.

Split-KV (``split_count``): where the (q tile, head) programs leave the GPU's program slots
half idle (a chunked prefill: L = 512 queries against 8192 keys, B = 1, is 128 programs on
132 SMs), each program's live blocks are split over the grid's third axis and the float32
slices combined by their lse in one kernel of the module (``<name>_combine``).
"""
from __future__ import annotations

import torch
from triton.runtime.errors import OutOfResources
from triton.tools.tensor_descriptor import TensorDescriptor

from ...blockmask.density import density_class
from ...codegen.hopper import HOPPER_TEMPLATE, combine_constexprs, hopper_kernel, kv_heads
from ...codegen.spec import DTYPE_NAMES, KernelSpec, next_power_of_two
from ...errors import InputError
from .. import autotune, binding, plans
from ..call import AttentionCall
from ..debug import log
from ..kernels import generated_module
from ..launch import Step, TrustedDescriptor, cdiv
from ..outputs import (allocate_outputs, forward_grid, head_group, out_strides, present_or,
                       stat_args)
from ..registry import KernelFamily, register
from ..tables import largest_tile, mask_blocks
from ..target import Target
from .ampere import MIN_SPLIT_KEYS, int64_nodes, sm_count, split_out_strides, split_workspaces

# up to 256: the wide dims' tiles (autotune.HOPPER_CONFIGS[256], HOPPER_CONFIGS_WIDE_QK)
# compile without spills on sm_90
MAX_HEAD_DIM = 256
INTERPRET_CONFIG = (64, 64, 4, 1, 0)
# split-KV's rule: program slots per SM (the default tiles' occupancy: two 8-warp programs
# under the 128-register cap, 96 KB of shared memory each at head dim 128), the predicted
# fraction of the unsplit time a split must reach, and the most splits it picks
PROGRAMS_PER_SM = 2
MIN_SPLIT_GAIN = 0.8
MAX_AUTO_SPLITS = 4
COMBINE_LAUNCH = {"num_warps": 8, "num_stages": 1}  # 128 rows x 128 columns of float32


# tensor descriptors take int32 coordinates (Triton's descriptor loads and stores, and TMA's
# own): a matrix of more rows than this (a [B * H * n, d] view of q with B * H * n >= 2**31,
# 32 GiB at d = 8) is out of their reach: its heads' first rows (off_bh * L in the kernels)
# wrapped to other rows, silently. Such calls take the pointer kernels (int64 head bases)
MAX_DESCRIPTOR_ROWS = 2 ** 31 - 1


def _flat_rows(t: torch.Tensor) -> bool:
    """[B, H, n, d] is a [B * H * n, d] matrix with 16-byte aligned rows, within
    ``MAX_DESCRIPTOR_ROWS``."""
    B, H, n, _ = t.shape
    row = t.stride(2)
    return (B * H * n <= MAX_DESCRIPTOR_ROWS and t.stride(3) == 1
            and (row * t.element_size()) % 16 == 0
            and t.data_ptr() % 16 == 0 and (H == 1 or t.stride(1) == n * row)
            and (B == 1 or t.stride(0) == H * n * row))


def descriptor_layout_ok(*tensors) -> bool:
    """fp16/bf16 ``[B, H, n, d]`` tensors (one dtype) that the Hopper templates can read
    through tensor descriptors: 8 <= d <= MAX_HEAD_DIM, n > 0, and each a ``[B * H * n, d]``
    matrix with 16-byte aligned rows."""
    return tensors[0].dtype in (torch.float16, torch.bfloat16) and all(
        8 <= t.shape[3] <= MAX_HEAD_DIM and t.shape[2] > 0 and _flat_rows(t) for t in tensors)


def strided_ok(*tensors) -> bool:
    """``descriptor_layout_ok``'s dtypes and head dims, each tensor ``strided_layout_ok``."""
    return tensors[0].dtype in (torch.float16, torch.bfloat16) and all(
        8 <= t.shape[3] <= MAX_HEAD_DIM and t.shape[2] > 0 and strided_layout_ok(t)
        for t in tensors)


def geometry(t: torch.Tensor, block_rows: int, cols_pad: int) -> tuple:
    """(shape, strides, block) of the tensor descriptor over the [B * H * n, d] view of t."""
    B, H, n, d = t.shape
    return [B * H * n, d], [t.stride(2), 1], [block_rows, cols_pad]


def head_geometry(t: torch.Tensor, block_rows: int, cols_pad: int) -> tuple:
    """(shape, strides, block) of the tensor descriptor over the [B * H, n, d] view of t (a
    [B * H * n, d] matrix): a block past a head's last row reads TMA's zero fill and its
    stores there are dropped, where a [B * H * n, d] view would reach the next head. The
    backward's dQ kernel and, at a ragged L, dK/dV kernel need no bounds selects then (the
    dQ store no row mask), registers its tiles past 128 do not have; the Hopper forward's K
    and V at a ragged S read no other head's keys (an inf there made P @ V NaN)."""
    B, H, n, d = t.shape
    return [B * H, n, d], [n * t.stride(2), t.stride(2), 1], [1, block_rows, cols_pad]


def block_geometry(t: torch.Tensor, block: list[int]) -> tuple[list[int], list[int]]:
    """(shape, strides) of the descriptor over t for a block [rows, cols] (the [B * H * n, d]
    rows) or [1, rows, cols] (the [B * H, n, d] heads, ``head_geometry``)."""
    layout = head_geometry if len(block) == 3 else geometry
    return layout(t, *block[-2:])[:2]


# ---- strided q, k, v: one [rows, columns] matrix with each (batch, head) at its origin -------
#
# A [B, H, n, d] tensor whose rows (stride(2)) are 16-byte aligned is a matrix of rows of
# stride(2) elements; a batch or head step is then a whole number of rows (heads stacked, as
# the flat layout) or a column offset inside a row (heads side by side: [B, n, H, d] and
# packed [total, H, d] tensors, a fused qkv projection's slices), and each (b, h) starts at
# row b * rows_b + h * rows_h, column b * cols_b + h * cols_h (the kernel takes
# (b * stride_b + h * stride_h) // stride_n and % stride_n). The descriptor covers exactly the
# tensor's extent, so TMA's zero fill starts past its last element. What a tile that runs past
# a sequence's end reads must be the tensor's own elements (the next rows of another batch or
# head) or zero fill, never a gap between them (uninitialized memory, perhaps NaN, times a
# masked p of 0 is NaN): the row steps must tile the rows without gaps. A column block is
# E_PAD wide: with heads side by side it would read the next head's columns past d, so there
# d must be a power of two of 16 or more (E == E_PAD; next_power_of_two(8) is 16).


def _steps(t: torch.Tensor) -> list[tuple[int, int, int]] | None:
    """(size, rows, columns) of the batch and head steps of ``t`` (sizes > 1), or None where
    one is neither whole rows nor an aligned column offset."""
    row, steps = t.stride(2), []
    for size, stride in zip(t.shape[:2], t.stride()[:2]):
        rows, cols = divmod(stride, row)
        if size == 1:
            continue
        if rows and cols or (cols * t.element_size()) % 16:
            return None
        steps.append((size, rows, cols))
    return steps


def strided_layout_ok(t: torch.Tensor) -> bool:
    """``t`` (fp16/bf16 [B, H, n, d]) reads as one matrix with each (b, h) at its origin
    (see above): aligned base and rows, head steps in whole rows without gaps or as column
    offsets that fit a row, a power-of-two d >= 16 where heads sit side by side, at most
    ``MAX_DESCRIPTOR_ROWS`` rows."""
    B, H, n, d = t.shape
    row = t.stride(2)
    if t.stride(3) != 1 or row <= 0 or (row * t.element_size()) % 16 or t.data_ptr() % 16:
        return False
    steps = _steps(t)
    if steps is None:
        return False
    columns = d + sum((size - 1) * cols for size, _, cols in steps)
    if columns > row or (columns > d and next_power_of_two(d) != d):
        return False
    span = n  # rows covered so far without a gap, from the smallest row step up
    for size, rows, _ in sorted(s for s in steps if s[1]):
        if rows > span:
            return False
        span += (size - 1) * rows
    return span <= MAX_DESCRIPTOR_ROWS  # (span: the matrix's rows, strided_geometry's)


def strided_geometry(t: torch.Tensor, block_rows: int, cols_pad: int) -> tuple:
    """(shape, strides, block) of the descriptor over the matrix of a ``strided_layout_ok``
    tensor: every (b, h)'s rows and columns, nothing past the tensor's last element."""
    steps = _steps(t)
    rows = t.shape[2] + sum((size - 1) * r for size, r, _ in steps)
    columns = t.shape[3] + sum((size - 1) * c for size, _, c in steps)
    return [rows, columns], [t.stride(2), 1], [block_rows, cols_pad]


def strided_head_geometry(t: torch.Tensor, block_rows: int, cols_pad: int) -> tuple:
    """(shape, strides, block) of the 4-D descriptor over a ``strided_layout_ok`` tensor's
    [B, H, n, d] itself: a block past n reads TMA's zero fill, never another head's or
    batch's rows. Its batch and head steps are whole rows or aligned column offsets (16-byte
    multiples, ``_steps``); a dimension of size 1 takes an aligned stride it never steps."""
    B, H, n, d = t.shape
    row = t.stride(2)
    steps = [stride if size > 1 else n * row for size, stride in zip(t.shape[:2], t.stride()[:2])]
    return [B, H, n, d], [*steps, row, 1], [1, 1, block_rows, cols_pad]


def _candidates(head_dim_pad: int, sparse_q, sparse_kv,
                head_dim_v_pad: int | None = None) -> list[tuple[int, ...]]:
    configs = autotune.hopper_configs(head_dim_pad, head_dim_v_pad or head_dim_pad)
    fitted = [c for c in configs
              if sparse_q is None or (sparse_q % c[0] == 0 and sparse_kv % c[1] == 0)]
    if fitted:
        return fitted
    # a block mask with small blocks: shrink the default's tiles to divide them
    block_m, block_n, warps, stages, _ = configs[0]
    return [(min(block_m, largest_tile(sparse_q)), min(block_n, largest_tile(sparse_kv)),
             4, stages, 0)]


def split_count(setting, programs: int, sms: int, keys: int) -> int:
    """Splits of each program's live blocks (1: none) for ``kernel_options["SPLIT_KV"]`` =
    ``setting``: n exactly n, 0 none; None (the default) and "AUTO" the count s that
    minimizes the predicted time, cdiv(programs * s, slots) / s rounds of s-times shorter
    programs (slots = PROGRAMS_PER_SM * sms), where that is at most MIN_SPLIT_GAIN of the
    unsplit time, ties to the fewest; a split keeps at least MIN_SPLIT_KEYS of the ``keys``.
    ``sms`` = 0 (the interpreter): no automatic split. Training-shaped calls (programs of a
    few waves) do not split: their tail wave is a small part of the time."""
    if setting not in (None, "AUTO"):
        return max(1, setting)
    slots = PROGRAMS_PER_SM * sms
    if not slots:
        return 1
    most = max(1, min(MAX_AUTO_SPLITS, keys // MIN_SPLIT_KEYS))
    rounds = {s: cdiv(programs * s, slots) / s for s in range(1, most + 1)}
    best = min(rounds, key=lambda s: (rounds[s], s))
    return best if rounds[best] <= MIN_SPLIT_GAIN * rounds[1] else 1


def call_splits(call: AttentionCall, target: Target, q, k, block_m: int) -> int:
    """``split_count`` for this call with q tiles of ``block_m`` rows on its target."""
    B, Hq, L, _ = q.shape
    return split_count(call.options.split_kv, B * Hq * cdiv(L, block_m),
                       0 if target.interpret else sm_count(q.device), k.shape[2])


def hopper_spec(q, k, v, call: AttentionCall, target: Target, config, return_lse: bool,
                return_max: bool = False, split: bool = False) -> KernelSpec:
    L, E, S, Ev = q.shape[2], q.shape[3], k.shape[2], v.shape[3]
    block_m, block_n, warps, stages, max_registers = config
    mask = call.block_mask
    if mask is not None:
        sparse_q, sparse_kv = mask_blocks(mask)
        if sparse_q % block_m or sparse_kv % block_n or block_m < 16 or block_n < 16:
            raise InputError(f"block_mask has BLOCK_SIZE {tuple(mask.BLOCK_SIZE)}; kernel tiles "
                             f"BLOCK_M={block_m}, BLOCK_N={block_n} must divide it and be >= 16")
    else:
        sparse_q, sparse_kv = block_m, block_n
    return KernelSpec(
        dtype=DTYPE_NAMES[q.dtype], head_dim=E, head_dim_v=Ev, block_m=block_m, block_n=block_n,
        num_warps=warps, num_stages=stages, has_block_mask=mask is not None,
        has_full_blocks=mask is not None and getattr(mask, "full_kv_num_blocks", None) is not None,
        # EVEN_S also needs whole block-mask blocks: the flat loop visits every sub-tile of
        # a block, and a sub-tile past S would read the next head's rows unmasked
        sparse_q=sparse_q, sparse_kv=sparse_kv, even_l=L % block_m == 0, even_s=S % sparse_kv == 0,
        return_lse=return_lse or split, gqa_group=call.gqa_group,
        input_precision=call.options.fp32_precision, target=target.name,
        template=HOPPER_TEMPLATE, max_registers=max_registers, return_max=return_max,
        wide_ints=int64_nodes(q, k, call), strided_qkv=not descriptor_layout_ok(q, k, v),
        split_kv=split, sinks_dtype=call.sinks_dtype, dropout=call.dropout is not None)


class HopperForward(KernelFamily):
    name = "hopper"
    direction = "forward"
    priority = 10
    features = frozenset({"sinks", "dropout"})

    def why_not(self, target: Target, call, q, k, v) -> str | None:
        options = call.options
        if options.fwd.use_tma is False:
            return "kernel_options USE_TMA=False"
        forced = options.backend == "HOPPER" or options.fwd.use_tma
        if not (target.is_sm90 or (target.interpret and forced)):
            return f"it runs on sm_90 (and under the interpreter when forced), not {target}"
        if not (descriptor_layout_ok(q, k, v) or strided_ok(q, k, v)):
            return (f"it needs fp16/bf16 q, k, v with head dims 8..{MAX_HEAD_DIM} and 16-byte "
                    "aligned rows, each a [B * H * len, dim] matrix or strided with heads in "
                    "whole rows or side by side at power-of-two head dims of 16 or more (a "
                    "tile's columns are the head dim padded to one), of fewer than 2**31 "
                    "rows (tensor descriptors' int32 coordinates)")
        return None

    def first_call(self, key, target: Target, call, q, k, v, return_lse, return_max):
        out, lse, maxs = allocate_outputs(q, v, return_lse, return_max)
        config = self.choose_config(q, k, v, call, target, return_lse, out, lse)
        splits = call_splits(call, target, q, k, config[0])
        pinned = autotune.Pinned.of(call.options.fwd)
        error = None
        # captured-tensor reads are pipelined through shared memory too, so a score_mod with a
        # bias table can need more than the default tiles leave: smaller configs, not a failure
        for tried in _smaller_configs(config, pinned):
            plan = self.make_plan(q, k, v, call, target, tried, return_lse, return_max, splits)
            try:
                self.launch_plan(plan, call, q, k, v, out, lse, maxs)
            except OutOfResources as exc:
                error = exc
                continue
            if tried != config:
                log.info("forward tiles %s do not fit this GPU (%s); using %s", config, error,
                         tried)
            plans.keep(call, key, plan)
            return out, lse, maxs
        raise InputError(
            f"the forward kernel does not fit this GPU with tiles {config} or smaller ones: "
            f"{error}; pass smaller BLOCK_M/BLOCK_N/num_stages in kernel_options") from error

    def run(self, plan, call, q, k, v, return_lse, return_max):
        out, lse, maxs = allocate_outputs(q, v, return_lse, return_max)
        self.launch_plan(plan, call, q, k, v, out, lse, maxs)
        return out, lse, maxs

    def launch_plan(self, plan, call, q, k, v, out, lse, maxs) -> None:
        """Run ``plan`` into these outputs: directly, or with splits into float32 slices that
        the module's combine kernel then writes them from."""
        splits = plan.fixed["splits"]
        if splits == 1:
            self.launch(plan, call, q, k, v, out, lse, maxs)
            return
        parts, part_lse, part_max = split_workspaces(splits, out, maxs is not None)
        self.launch(plan, call, q, k, v, parts, part_lse, part_max)
        if lse is None:  # the combine kernel always writes lse (RETURN_LSE is on)
            lse = torch.empty(part_lse.shape[1:], dtype=torch.float32, device=q.device)
        plan.steps[1].launch_with(
            {"PARTS": parts, "PART_LSE": part_lse, "PART_MAX": present_or(part_max, part_lse),
             "OUT": out, "LSE": lse, "MAXS": present_or(maxs, lse),
             **binding.feature_values(call)},
            q.device)

    def make_plan(self, q, k, v, call, target, config, return_lse, return_max,
                  splits: int = 1) -> plans.Plan:
        spec = hopper_spec(q, k, v, call, target, config, return_lse, return_max, splits > 1)
        B, Hq, L, _ = q.shape
        loaded = generated_module(hopper_kernel, spec, call.score, call.mask)
        inputs = {}
        if spec.strided_qkv:
            inputs = {**binding.strides("q", "bhm", q.stride()[:3]),
                      **binding.strides("k", "bhn", k.stride()[:3]),
                      **binding.strides("v", "bhn", v.stride()[:3])}
        fixed = {**inputs, **binding.strides("o", "bhmd", split_out_strides(q, v) if splits > 1
                                             else out_strides(q, v)),
                 **binding.tables("KV", "m", "n", call.block_mask, "kv", q.device),
                 "HQ": Hq, "L": L, "S": k.shape[2], "HEAD_GROUP": head_group(call, q, k, v),
                 **binding.buffer_layout(call.score, call.mask)}
        step = Step(loaded.kernel(), (*forward_grid(B * Hq, cdiv(L, spec.block_m),
                                                    spec.has_block_mask), splits),
                    spec.constexprs(call.scores_first), spec.launch_options(),
                    binding.Binder(loaded.names(), fixed))
        layout = strided_geometry if spec.strided_qkv else geometry
        # at a ragged S, K and V per head (fwd_hopper.tmpl, codegen.hopper.kv_heads)
        keys = ((strided_head_geometry if spec.strided_qkv else head_geometry)
                if kv_heads(spec) else layout)
        descriptors = (layout(q, spec.block_m, spec.head_dim_pad),
                       keys(k, spec.block_n, spec.head_dim_pad),
                       keys(v, spec.block_n, spec.head_dim_v_pad))
        steps = [step]
        if splits > 1:  # the slices combined by their lse: one program per BLOCK_M flat rows
            combine = f"{loaded.name}_combine"
            steps.append(Step(loaded.kernel(combine), (cdiv(B * Hq * L, spec.block_m),),
                              combine_constexprs(spec), COMBINE_LAUNCH,
                              binding.Binder(loaded.names(combine), {
                                  **binding.strides("o", "bhmd", out_strides(q, v)), "HQ": Hq,
                                  "L": L, "ROWS": B * Hq * L, "SPLITS": splits})))
        return plans.Plan(self, spec, tuple(steps), {"descriptors": descriptors,
                                                     "splits": splits})

    @staticmethod
    def launch(plan, call, q, k, v, out, lse, maxs) -> None:
        step = plan.steps[0]
        # the descriptors' checks ran at the plan's first launch; its key fixes what they read
        kind = TrustedDescriptor if step.launched else TensorDescriptor
        (qs, qt, qb), (ks, kt, kb), (vs, vt, vb) = plan.fixed["descriptors"]
        stat_lse, stat_max = stat_args(out, lse, maxs)
        step.launch_with(
            {"Q_DESC": kind(q, qs, qt, qb), "K_DESC": kind(k, ks, kt, kb),
             "V_DESC": kind(v, vs, vt, vb), "OUT": out, "LSE": stat_lse, "MAXS": stat_max,
             "sm_scale": float(call.scale), **binding.call_values(call)}, q.device)

    def choose_config(self, q, k, v, call, target, return_lse, out, lse) -> tuple:
        """(BLOCK_M, BLOCK_N, num_warps, num_stages, maxnreg): pinned, stored, tuned now, or
        the default."""
        pinned = autotune.Pinned.of(call.options.fwd)
        sparse = mask_blocks(call.block_mask)
        if target.interpret:  # fixed tiles: the interpreter's cost is per tile
            block_m, block_n, warps, stages, cap = INTERPRET_CONFIG
            if sparse[0] is not None:
                block_m = min(block_m, largest_tile(sparse[0]))
                block_n = min(block_n, largest_tile(sparse[1]))
            return pinned.apply((block_m, block_n, warps, stages, cap))
        e_pad, ev_pad = next_power_of_two(q.shape[3]), next_power_of_two(v.shape[3])
        candidates = _candidates(e_pad, *sparse, ev_pad)
        work = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
        if (pinned.any or not autotune.enabled() or len(candidates) == 1
                or work < autotune.MIN_TUNED_WORK):
            return pinned.apply(candidates[0])
        # dropout's Philox makes a different kernel: its own winners
        key = autotune.tune_key(HOPPER_TEMPLATE + ("_dropout" if call.dropout else ""),
                                autotune.device_tag(target, q.device), e_pad, ev_pad,
                                DTYPE_NAMES[q.dtype], density_class(call.block_mask),
                                k.shape[2])

        def time_config(config) -> float:
            plan = self.make_plan(q, k, v, call, target, config, return_lse, False)
            return autotune.time_ms(lambda: self.launch(plan, call, q, k, v, out, lse, None),
                                    q.device)
        return autotune.tune(key, candidates, time_config)


def _smaller_configs(config, pinned: autotune.Pinned):
    """``config``, then one pipeline stage less at a time, then half the key tile: what to try
    when the GPU cannot hold the one before. Fields the caller pinned stay as they are."""
    block_m, block_n, warps, stages, cap = config
    yield config
    if pinned.num_stages is None:
        for fewer in range(stages - 1, 0, -1):
            yield block_m, block_n, warps, fewer, cap
    if pinned.block_n is None and block_n > 32:
        yield block_m, block_n // 2, warps, 1 if pinned.num_stages is None else stages, cap


HOPPER = register(HopperForward())
