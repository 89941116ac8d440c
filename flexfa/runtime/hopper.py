"""Running the Hopper forward template: when it applies, its tiles (tuned), one launch.

``use_hopper(q, k, v)`` is true on sm_90 for fp16/bf16 inputs with head dims 8..128 whose
[B, H, len, dim] layout flattens to 16-byte aligned rows (what tensor descriptors need);
everything else keeps the Ampere-class template, as do calls split for decoding
(``flexfa.runtime.forward.split_keys``). ``FLEXFA_FORWARD_TEMPLATE`` = ``hopper`` / ``ampere``
forces a choice (``hopper`` also under the interpreter, which is how CI tests this template).
"""
from __future__ import annotations

import dataclasses
import os

import torch
import triton
from triton.runtime.errors import OutOfResources
from triton.tools.tensor_descriptor import TensorDescriptor

from ..blockmask.validate import table_generations
from ..codegen.hopper import HOPPER_TEMPLATE, hopper_kernel
from ..codegen.spec import DTYPE_NAMES, KernelSpec, next_power_of_two
from ..errors import InputError
from ..frontend.trace import TracedMod
from . import autotune
from ..memo import BoundedMemo, MaskedMemo
from .debug import log
from .forward import (AttentionCall, _largest_tile, _table_args, allocate_outputs,
                      buffer_launch_args, call_int64_nodes, call_plan_key, forward_grid,
                      generated_kernel, stat_args, target_of)
from .launch import TrustedDescriptor, cdiv, direct_state, launch_direct

HOPPER_TARGETS = ("cuda:90",)
# wider heads keep the Ampere template: at E = 256 this one compiles (196 KB of shared memory)
# but spills about 600 bytes and was never measured on the H200
HOPPER_MAX_HEAD_DIM = 128
_INTERPRET_CONFIG = (64, 64, 4, 1, 0)


def _flat_rows(t: torch.Tensor) -> bool:
    """[B, H, n, d] is a [B * H * n, d] matrix with 16-byte aligned rows."""
    B, H, n, _ = t.shape
    row = t.stride(2)
    return (t.stride(3) == 1 and (row * t.element_size()) % 16 == 0
            and t.data_ptr() % 16 == 0 and (H == 1 or t.stride(1) == n * row)
            and (B == 1 or t.stride(0) == H * n * row))


def descriptor_layout_ok(*tensors) -> bool:
    """fp16/bf16 ``[B, H, n, d]`` tensors (one dtype) that the Hopper templates can read
    through tensor descriptors: 8 <= d <= HOPPER_MAX_HEAD_DIM, n > 0, and each a
    ``[B * H * n, d]`` matrix with 16-byte aligned rows."""
    return tensors[0].dtype in (torch.float16, torch.bfloat16) and all(
        8 <= t.shape[3] <= HOPPER_MAX_HEAD_DIM and t.shape[2] > 0 and _flat_rows(t)
        for t in tensors)


_LAYOUTS: dict[tuple, bool] = {}


def use_hopper(q, k, v) -> bool:
    forced = _template_setting()
    if forced == "ampere":
        return False
    key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, q.device,
           forced)
    usable = _LAYOUTS.get(key)
    if usable is None:
        if len(_LAYOUTS) > 4096:
            _LAYOUTS.clear()
        usable = _LAYOUTS[key] = (
            (forced == "hopper" or target_of(q.device) in HOPPER_TARGETS)
            and descriptor_layout_ok(q, k, v))
    # the base pointers are not part of the key: 16-byte alignment is checked every call
    return usable and not (q.data_ptr() % 16 or k.data_ptr() % 16 or v.data_ptr() % 16)


def _fits(config, sparse_q: int | None, sparse_kv: int | None) -> bool:
    block_m, block_n = config[:2]
    return sparse_q is None or (sparse_q % block_m == 0 and sparse_kv % block_n == 0)


def _candidates(head_dim_pad: int, sparse_q, sparse_kv) -> list[tuple[int, ...]]:
    configs = autotune.HOPPER_CONFIGS[max(16, min(256, head_dim_pad))]
    fitted = [c for c in configs if _fits(c, sparse_q, sparse_kv)]
    if fitted:
        return fitted
    # a block mask with small blocks: shrink the default's tiles to divide them
    block_m, block_n, warps, stages, _ = configs[0]
    return [(min(block_m, _largest_tile(sparse_q)), min(block_n, _largest_tile(sparse_kv)),
             4, stages, 0)]


def _spec(q, k, v, call: AttentionCall, return_lse: bool, target: str, config,
          return_max: bool = False) -> KernelSpec:
    L, E, S, Ev = q.shape[2], q.shape[3], k.shape[2], v.shape[3]
    block_m, block_n, warps, stages, max_registers = config
    mask = call.block_mask
    if mask is not None:
        sparse_q, sparse_kv = (int(b) for b in mask.BLOCK_SIZE)
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
        return_lse=return_lse, gqa_group=call.gqa_group,
        input_precision=call.options.fp32_precision, target=target, template=HOPPER_TEMPLATE,
        max_registers=max_registers, return_max=return_max,
        wide_ints=call_int64_nodes(q, k, call))


_KERNELS = BoundedMemo(1024, "hopper kernels")


def get_hopper_kernel(spec: KernelSpec, score: TracedMod | None, mask: TracedMod | None):
    """The launchable Hopper forward kernel."""
    return generated_kernel(_KERNELS, hopper_kernel, spec, score, mask)


@dataclasses.dataclass
class _Plan:
    """Everything about a launch that depends only on the call's signature (shapes, strides,
    dtypes, mods, block mask object, options): made once, then each call only allocates the
    outputs, wraps q/k/v in descriptors and launches the compiled kernel directly."""

    spec: KernelSpec
    kernel: object  # the JITFunction (or InterpretedFunction)
    grid: tuple[int, int, int]
    fixed: list  # out strides, block-mask tables, HQ, L, S
    constexprs: dict
    descriptors: tuple = ()  # (shape, strides, block) of the q, k, v descriptors
    out_strides: tuple = ()
    direct: object = None  # after the first launch (CUDA): launch.direct_state's state


def _args(plan: _Plan, q, k, v, out, lse, maxs, call: AttentionCall, trusted: bool) -> list:
    kind = TrustedDescriptor if trusted else TensorDescriptor  # use_hopper checks alignment
    (q_shape, q_strides, q_block), (k_shape, k_strides, k_block), (v_shape, v_strides, v_block) = (
        plan.descriptors)
    return [kind(q, q_shape, q_strides, q_block), kind(k, k_shape, k_strides, k_block),
            kind(v, v_shape, v_strides, v_block), out, *stat_args(out, lse, maxs),
            *plan.out_strides, *plan.fixed, float(call.scale),
            *buffer_launch_args(call.score), *buffer_launch_args(call.mask)]


def _geometry(t: torch.Tensor, block_rows: int, cols_pad: int) -> tuple:
    B, H, n, d = t.shape
    return [B * H * n, d], [t.stride(2), 1], [block_rows, cols_pad]


def _make_plan(q, k, v, call: AttentionCall, spec: KernelSpec) -> _Plan:
    B, Hq, L, _ = q.shape
    kernel = get_hopper_kernel(spec, call.score, call.mask)
    fixed = [*_table_args(call.block_mask, q.device), Hq, L, k.shape[2]]
    descriptors = (_geometry(q, spec.block_m, spec.head_dim_pad),
                   _geometry(k, spec.block_n, spec.head_dim_pad),
                   _geometry(v, spec.block_n, spec.head_dim_v_pad))
    out_strides = (Hq * L * v.shape[3], L * v.shape[3], v.shape[3], 1)  # a fresh contiguous out
    grid = (*forward_grid(B * Hq, cdiv(L, spec.block_m), spec.has_block_mask), 1)
    return _Plan(spec, kernel, grid, fixed, spec.constexprs(call.scores_first), descriptors,
                 out_strides)


def _launch_plan(plan: _Plan, q, k, v, out, lse, maxs, call: AttentionCall) -> None:
    if plan.direct is not None and q.device.index == torch.cuda.current_device():
        # cached: the compiled kernel's launcher directly (the plan's key fixes every
        # specialization); another current device takes the path below, which switches to
        # q's device
        launch_direct(plan.direct, plan.grid, q.device.index,
                      _args(plan, q, k, v, out, lse, maxs, call, True))
        return
    args = _args(plan, q, k, v, out, lse, maxs, call, False)
    options = plan.spec.launch_options()
    if q.device.type == "cuda":
        with torch.cuda.device(q.device):
            compiled = plan.kernel[plan.grid[:2]](*args, **plan.constexprs, **options)
        plan.direct = direct_state(plan.kernel, compiled, args, plan.constexprs)
    else:
        plan.kernel[plan.grid[:2]](*args, **plan.constexprs, **options)


def choose_config(q, k, v, call: AttentionCall, return_lse: bool, target: str, out, lse):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, maxnreg): pinned, stored, tuned now, or the
    default."""
    options = call.options
    pinned = autotune.Pinned.of(options)
    mask = call.block_mask
    sparse = tuple(int(b) for b in mask.BLOCK_SIZE) if mask is not None else (None, None)
    if target == "interpret":  # fixed tiles: the interpreter's cost is per tile
        block_m, block_n, warps, stages, cap = _INTERPRET_CONFIG
        if mask is not None:
            block_m, block_n = (min(block_m, _largest_tile(sparse[0])),
                                min(block_n, _largest_tile(sparse[1])))
        return pinned.apply((block_m, block_n, warps, stages, cap))
    e_pad, ev_pad = next_power_of_two(q.shape[3]), next_power_of_two(v.shape[3])
    candidates = _candidates(max(e_pad, ev_pad), *sparse)
    work = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
    if (pinned.any or not autotune.enabled() or len(candidates) == 1
            or work < autotune.MIN_TUNED_WORK):
        return pinned.apply(candidates[0])
    key = autotune.tune_key(HOPPER_TEMPLATE, target, e_pad, ev_pad, DTYPE_NAMES[q.dtype],
                            autotune.density_class(mask), k.shape[2])

    def time_config(config) -> float:
        plan = _make_plan(q, k, v, call, _spec(q, k, v, call, return_lse, target, config))
        return triton.testing.do_bench(lambda: _launch_plan(plan, q, k, v, out, lse, None, call),
                                       warmup=5, rep=25, return_mode="median")
    return autotune.tune(key, candidates, time_config)


# the plans of every call; a block mask's plans live under it and go with it
_PLANS = MaskedMemo(256, per_mask=16, name="hopper plans")


def _template_setting() -> str:
    return os.environ.get("FLEXFA_FORWARD_TEMPLATE", "auto")


def _plan_key(short_key: tuple, call: AttentionCall) -> tuple:
    """The key of ``_PLANS`` under the call's block mask: ``call_plan_key`` and what the call
    fixes (mods, options, GQA group, score-first mode)."""
    return short_key + (call.score.key if call.score else None,
                        call.mask.key if call.mask else None, call.options,
                        call.gqa_group, call.scores_first,
                        table_generations(call.block_mask)[0])  # plans hold the tables


def run_planned(q, k, v, call: AttentionCall, return_lse: bool, return_max: bool = False):
    """(out, lse, row max) through the cached plan of this call's signature, or None when there is
    none (or the base pointers lost the 16-byte alignment the descriptors need): the cached
    path of ``run_forward``, which skips ``use_hopper``'s own lookup, since a plan exists only
    for a signature (shapes, strides, dtype, device, template setting) it accepted."""
    template = _template_setting()
    if template == "ampere" or q.data_ptr() % 16 or k.data_ptr() % 16 or v.data_ptr() % 16:
        return None
    short_key = call_plan_key(q, k, v, call, return_lse, return_max, template)
    plan = _PLANS.get(call.block_mask, _plan_key(short_key, call))
    if plan is None:
        return None
    out, lse, maxs = allocate_outputs(q, v, return_lse, return_max)
    _launch_plan(plan, q, k, v, out, lse, maxs, call)
    return out, lse, maxs


def run_hopper_forward(q, k, v, call: AttentionCall, return_lse: bool, return_max: bool, out,
                       lse, maxs):
    """(out, lse, row max) as ``flexfa.runtime.forward.run_forward``, through the Hopper
    template, into the non-empty ``out``, ``lse`` and ``maxs`` from ``allocate_outputs``, for a
    signature without a cached plan (``run_planned`` launches those): picks the tiles, makes
    the plan, launches it and caches it."""
    target = target_of(q.device)
    config = choose_config(q, k, v, call, return_lse, target, out, lse)
    plan = _first_launch(q, k, v, call, return_lse, return_max, target, config, out, lse, maxs)
    short_key = call_plan_key(q, k, v, call, return_lse, return_max, _template_setting())
    _PLANS.put(call.block_mask, _plan_key(short_key, call), plan)
    return out, lse, maxs


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


def _first_launch(q, k, v, call: AttentionCall, return_lse: bool, return_max: bool, target: str,
                  config, out, lse, maxs) -> _Plan:
    """Make the plan and launch it once. Captured-tensor reads are pipelined through shared
    memory too, so a score_mod with a bias table can need more than the default tiles leave
    (H200, E = 64, 3 stages: 245,816 bytes of 232,448): such a config falls back to smaller
    ones instead of failing the call."""
    options = call.options
    pinned = autotune.Pinned.of(options)
    error = None
    for tried in _smaller_configs(config, pinned):
        plan = _make_plan(q, k, v, call,
                          _spec(q, k, v, call, return_lse, target, tried, return_max))
        try:
            _launch_plan(plan, q, k, v, out, lse, maxs, call)
        except OutOfResources as exc:
            error = exc
            continue
        if tried != config:
            log.info("forward tiles %s do not fit this GPU (%s); using %s", config, error, tried)
        return plan
    raise InputError(
        f"the forward kernel does not fit this GPU with tiles {config} or smaller ones: "
        f"{error}; pass smaller BLOCK_M/BLOCK_N/num_stages in kernel_options") from error
