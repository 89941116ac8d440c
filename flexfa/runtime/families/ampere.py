"""The Ampere-class forward family: ``fwd.tmpl`` (pointer loads, tl.dot, num_stages
pipelining). Runs on every target: the interpreter, sm_80 and newer GPUs, fp32 inputs, any
layout and head dim; also split-KV decoding (``SPLIT_KV``).

Tiles: the defaults below (chosen so that ``ptxas`` reports no spills on sm_80), fitted to the
block mask's blocks and bounded by the caller's kernel_options.
"""
from __future__ import annotations

import functools

import torch

from ...codegen.forward import forward_kernel
from ...codegen.ranges import Domain, mods_int64_nodes
from ...codegen.spec import DTYPE_NAMES, KernelSpec, next_power_of_two
from .. import binding, plans
from ..call import AttentionCall
from ..kernels import generated_module
from ..launch import Step, cdiv
from ..outputs import allocate_outputs, out_strides, stat_args
from ..registry import KernelFamily, register
from ..tables import check_tile, largest_tile, mask_blocks
from ..target import Target

MIN_SPLIT_KEYS = 512  # split-KV decoding: the fewest keys a split walks


def default_tiles(head_dim_pad: int, dtype: torch.dtype, target: Target,
                  head_dim_v_pad: int | None = None) -> tuple:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for padded head dims E (and Ev, default E).
    Past 128 the [BLOCK_M, Ev] accumulator sets the tiles: 128 x 32 while Ev <= 128 (MLA's
    E = 192, Ev = 128), 64 x 16 at Ev = 256 (larger ones spill on sm_80 and sm_90)."""
    if target.interpret:
        return 64, 64, 4, 1  # big tiles: the interpreter's cost is per tile, not per element
    ev_pad = head_dim_v_pad or head_dim_pad
    if max(head_dim_pad, ev_pad) > 128:
        tiles = (128, 32, 8, 2) if ev_pad <= 128 else (64, 16, 8, 2)
    elif head_dim_pad <= 64:
        tiles = (128, 32, 4, 3)
    else:
        tiles = (128, 64, 8, 3)
    if dtype == torch.float32:  # twice the bytes per element: halve the kv tile
        tiles = (tiles[0], max(16, tiles[1] // 2), tiles[2], 2)
    return tiles


def choose_tiles(call: AttentionCall, head_dim_pad: int, dtype, target: Target,
                 head_dim_v_pad: int | None = None) -> tuple:
    """(BLOCK_M, BLOCK_N, warps, stages, SPARSE_Q, SPARSE_KV) from kernel_options or the
    defaults, fitted to the block mask's block sizes."""
    block_m, block_n, warps, stages = default_tiles(head_dim_pad, dtype, target, head_dim_v_pad)
    options = call.options.fwd
    sparse_q, sparse_kv = mask_blocks(call.block_mask)
    if sparse_q is not None:
        block_m = min(block_m, largest_tile(sparse_q))
        block_n = min(block_n, largest_tile(sparse_kv))
    block_m = options.block_m or block_m
    block_n = options.block_n or block_n
    if sparse_q is not None:
        for key, tile, block in (("BLOCK_M", block_m, sparse_q), ("BLOCK_N", block_n, sparse_kv)):
            check_tile(call.block_mask, key, tile, block)
    else:
        sparse_q, sparse_kv = block_m, block_n
    return (block_m, block_n, options.num_warps or warps, options.num_stages or stages,
            sparse_q, sparse_kv)


def int64_nodes(q, k, call: AttentionCall) -> tuple[str, ...]:
    """The ``wide_ints`` of a forward spec: the mods' INT nodes that need int64 over this
    call's indices (b < B, h < Hq, q_idx < L, kv_idx < S)."""
    return mods_int64_nodes((call.score, call.mask),
                            Domain(q.shape[0], q.shape[1], q.shape[2], k.shape[2]))


def forward_spec(q, k, v, call: AttentionCall, target: Target, return_lse: bool,
                 return_max: bool = False, split_keys: int = 0) -> KernelSpec:
    """The KernelSpec of the Ampere-class forward for these inputs; ``split_keys`` > 0:
    split-KV decoding, which always writes lse and leaves the sinks to ``combine_splits``."""
    L, E = q.shape[2], q.shape[3]
    S, Ev = k.shape[2], v.shape[3]
    block_m, block_n, warps, stages, sparse_q, sparse_kv = choose_tiles(
        call, next_power_of_two(E), q.dtype, target, next_power_of_two(Ev))
    mask = call.block_mask
    return KernelSpec(
        dtype=DTYPE_NAMES[q.dtype], head_dim=E, head_dim_v=Ev, block_m=block_m, block_n=block_n,
        num_warps=warps, num_stages=stages, has_block_mask=mask is not None,
        has_full_blocks=mask is not None and getattr(mask, "full_kv_num_blocks", None) is not None,
        sparse_q=sparse_q, sparse_kv=sparse_kv, even_l=L % block_m == 0, even_s=S % block_n == 0,
        return_lse=return_lse or split_keys > 0, gqa_group=call.gqa_group,
        input_precision=call.options.fp32_precision, target=target.name,
        max_registers=call.options.fwd.max_registers or 0, return_max=return_max,
        split_keys=split_keys, wide_ints=int64_nodes(q, k, call),
        sinks_dtype="" if split_keys else call.sinks_dtype, dropout=call.dropout is not None)


@functools.cache
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_keys(call: AttentionCall, target: Target, batch_heads: int, L: int, S: int,
               block_m: int, unit: int, device: torch.device) -> int:
    """Keys per split for split-KV decoding (0: none). ``kernel_options["SPLIT_KV"]``: 0 or None (the
    default: not yet measured on a GPU) never; ``"AUTO"`` splits on a GPU where the
    ``cdiv(L, block_m) * batch_heads`` programs would not fill half of its SMs, into about two
    programs per SM; ``n`` into about n splits (any target: how the interpreter tests it). A
    split is a power of two times ``unit`` (the mask's key block, the key tile without a
    mask), at least MIN_SPLIT_KEYS keys, and there are at least two."""
    setting = call.options.split_kv
    if not setting:  # None (the default) or 0
        return 0
    if setting == "AUTO":
        if target.interpret:
            return 0
        programs, sms = cdiv(L, block_m) * batch_heads, sm_count(device)
        if 2 * programs > sms:
            return 0
        wanted = cdiv(2 * sms, programs)
    else:
        wanted = setting
    if wanted < 2:
        return 0
    keys = unit * next_power_of_two(cdiv(cdiv(S, wanted), unit), minimum=1)
    while keys < MIN_SPLIT_KEYS:
        keys *= 2
    return keys if keys < S else 0


def wants_split(call: AttentionCall, target: Target, q, k) -> bool:
    """Whether split-KV decoding may apply (a bound needing no spec: tiles have at most 128
    rows), so that other families leave such calls to this one."""
    setting = call.options.split_kv
    if not setting:
        return False
    if setting == "AUTO":
        return not target.interpret and (
            2 * cdiv(q.shape[2], 128) * q.shape[0] * q.shape[1] <= sm_count(q.device))
    return True


class AmpereForward(KernelFamily):
    name = "ampere"
    direction = "forward"
    priority = 0
    features = frozenset({"sinks", "dropout"})

    def why_not(self, target: Target, call, q, k, v) -> str | None:
        if call.options.fwd.use_tma:
            return "kernel_options USE_TMA=True asks for the tensor-descriptor (Hopper) family"
        return None

    def first_call(self, key, target: Target, call, q, k, v, return_lse, return_max):
        B, Hq, L, _ = q.shape
        S = k.shape[2]
        spec = forward_spec(q, k, v, call, target, return_lse, return_max)
        split = split_keys(call, target, B * Hq, L, S, spec.block_m, spec.sparse_kv, q.device)
        if split:
            spec = forward_spec(q, k, v, call, target, return_lse, return_max, split)
        loaded = generated_module(forward_kernel, spec, call.score, call.mask)
        splits = cdiv(S, split) if split else 1
        out_strides_ = split_out_strides(q, v) if split else out_strides(q, v)
        fixed = {**binding.strides("q", "bhmd", q.stride()),
                 **binding.strides("k", "bhnd", k.stride()),
                 **binding.strides("v", "bhnd", v.stride()),
                 **binding.strides("o", "bhmd", out_strides_),
                 **binding.tables("KV", "m", "n", call.block_mask, "kv", q.device),
                 "HQ": Hq, "L": L, "S": S, **binding.buffer_layout(call.score, call.mask)}
        step = Step(loaded.kernel(), (cdiv(L, spec.block_m), B * Hq, splits),
                    spec.constexprs(call.scores_first), spec.launch_options(),
                    binding.Binder(loaded.names(), fixed))
        plan = plans.Plan(self, spec, (step,), {"splits": splits if split else 0})
        plans.keep(call, key, plan)
        return self.run(plan, call, q, k, v, return_lse, return_max)

    def run(self, plan, call, q, k, v, return_lse, return_max):
        out, lse, maxs = allocate_outputs(q, v, return_lse, return_max)
        splits = plan.fixed["splits"]
        if splits:  # split-KV decoding: float32 slices per split, combined below
            results = out, lse, maxs
            out, lse, maxs = split_workspaces(splits, out, return_max)
        stat_lse, stat_max = stat_args(out, lse, maxs)
        plan.steps[0].launch_with(
            {"Q": q, "K": k, "V": v, "OUT": out, "LSE": stat_lse, "MAXS": stat_max,
             "sm_scale": float(call.scale), **binding.call_values(call)}, q.device)
        if splits:
            combine_splits(out, lse, maxs, *results, sinks=call.sinks)
            return results
        return out, lse, maxs


def split_out_strides(q, v) -> tuple[int, int, int, int]:
    """The [B, Hq, L, Ev] strides of a split's slice of ``split_workspaces``' output."""
    _, Hq, L, _ = q.shape
    Ev = v.shape[3]
    return Hq * L * Ev, L * Ev, Ev, 1


def split_workspaces(splits: int, out, return_max: bool) -> tuple:
    """What split-KV kernels write instead of (out, lse, maxs): contiguous float32 slices per
    split ([splits, B, Hq, L, Ev] and [splits, B, Hq, L]; maxs only where wanted), which
    ``combine_splits`` turns into the outputs."""
    parts = torch.empty(splits, *out.shape, dtype=torch.float32, device=out.device)
    part_lse = torch.empty(splits, *out.shape[:3], dtype=torch.float32, device=out.device)
    return parts, part_lse, torch.empty_like(part_lse) if return_max else None


def combine_splits(parts, part_lse, part_max, out, lse, maxs, sinks=None) -> None:
    """Write split-KV decoding's result into ``out`` (and ``lse``, ``maxs`` where wanted) from
    the splits' normalized outputs ``parts`` [n, B, H, L, Ev], their lse and row maxima
    [n, B, H, L]: out = sum over splits of exp(lse_s - lse) * out_s, lse = logsumexp(lse_s).
    A split without keys for a row has lse -inf and weight 0; a row without any keys gets
    out 0 and lse -inf, as the kernel gives it. ``sinks`` [H] join lse as one more term
    with no output (a row without keys then gets lse = its sink)."""
    if sinks is not None:
        sink_lse = sinks.detach().float().view(1, 1, -1, 1).expand(1, *part_lse.shape[1:])
        part_lse = torch.cat([part_lse, sink_lse])
        parts = torch.cat([parts, torch.zeros_like(parts[:1])])
    total = torch.logsumexp(part_lse, dim=0)
    weights = torch.exp(part_lse - torch.where(total == float("-inf"), 0.0, total))
    out.copy_((weights.unsqueeze(-1) * parts).sum(0))
    if lse is not None:
        lse.copy_(total)
    if maxs is not None:
        torch.amax(part_max, dim=0, out=maxs)


AMPERE = register(AmpereForward())
