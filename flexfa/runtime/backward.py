"""Running the backward kernels: delta preprocess, dK/dV, dQ (+ captured-tensor gradients).

``run_backward(q, k, v, out, lse, grad_out, grad_lse, call)`` returns ``(dq, dk, dv,
{slot: grad})`` for the score_mod's captured tensors that require grad. P is recomputed from
the saved lse tile by tile and never stored. On sm_90 at head dim 128 (``use_ds_dq``) the
dK/dV kernel stores dS (q's dtype) in a workspace of block slots (``ds_bands``: the band of
q blocks each kv block meets, per head) that the dQ kernel reads instead of recomputing P and
dP, allocated for the duration of the backward within ``ds_budget``; otherwise nothing of
size L x S is allocated.

Captured-tensor gradients are accumulated in float32 with atomics, or, with
``kernel_options={"deterministic": True}``, in int64 fixed point with 32 fraction bits:
integer addition is associative, so the sum does not depend on the order in which programs
add, and two runs give bit-identical results. The trade-off: an absolute resolution of
2**-32 per tile contribution instead of float32's relative one, and a range of +-2**31
for any partial sum. dq, dk and dv are written by exactly one program each in both modes.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from ..blockmask.tables import transpose_ordered
from ..blockmask.validate import table_generations
from ..codegen.backward import BackwardSpec, backward_kernel, dscore_is_one, joint_roots
from ..codegen.ranges import Domain, int64_nodes, mods_int64_nodes
from ..codegen.spec import DTYPE_NAMES, INTERPRET, next_power_of_two
from ..errors import InputError
from ..frontend.grad import JointGraph, derive
from ..frontend.trace import TracedMod
from . import autotune
from ..memo import BoundedMemo, MaskedMemo
from .debug import debug
from .forward import (AttentionCall, _broadcast_strides, _largest_tile, buffer_launch_args,
                      load_generated, target_of)
from .hopper import HOPPER_TARGETS, _geometry, descriptor_layout_ok
from .launch import TrustedDescriptor, cdiv, direct_state, launch_direct

_FIXED_POINT_SCALE = 2.0 ** 32  # must match flexfa_grad_add in bwd_common.tmpl


# sm_90 tiles measured on the H200, fwd+bwd of bf16 attention, flat block loops, TMA loads
# (benchmarks/bwd_sweep.py, run of 2026-11-29 in benchmarks/results/bwd_sweep/; times in ms,
# FlexAttention in the same run): (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, warps, stages)
#   E=128 causal S=8192: (64, 64, 64, 64, 4, 2) 4.68 (FlexAttention 4.94); (64, 128, 128, 64,
#     8, 2) 5.11; (32, 64, 64, 32, 4, 2) 5.36; (64, 64, 64, 64, 4, 3) 6.49; (32, 128, 128, 32,
#     4, 2) 10.09. Full S=2048 and softcap S=8192 rank the same way.
#   E=64 causal S=16384: (64, 64, 64, 64, 4, 3) 6.00, (32, 64, 64, 32, 4, 3) 6.25,
#     (32, 128, 128, 32, 4, 3) 6.75 (FlexAttention 6.25); document S=2048: 1.37, 1.08, 1.14
#     (FlexAttention 0.86). (32, 64, 64, 32, 4, 3) is the better compromise of the two.
#
# sm_90 candidates of the backward's autotuning, (tiles, fused):
# the two kernels at the swept tiles (the first is the default when not tuning; at E = 128
# one candidate: nothing to tune), then, tuned only with FLEXFA_BACKWARD_FUSED=1, the fused
# dK/dV + dQ kernel at tiles that compile without spills for sm_90 (``ptxas -v``: E=128
# 64x64 8 warps 243 registers, 32x128 8 warps 234; E=64 64x128 8 warps 220, 64x64 4 warps
# 245; 64x64 4 warps at E=128 spills 512 bytes, 64x128 8 warps 320). Measured on the H200
# (benchmarks/tune_classes.py, benchmarks/results/tuning/): at E = 64 the 64 x 64 tiles won
# every class but dense short (1.051 vs 1.063 ms), by 6-7% in the long dense and masked ones.
# Each kernel alone (benchmarks/bwd_kernel_sweep.py, benchmarks/results/bwd_kernels/): at E =
# 64, 2 stages beat 3 by 2-5% in both kernels for causal S = 16384, sliding and document
# (dK/dV 2.449 vs 2.500 ms, dQ 1.470 vs 1.520, causal), 3 stay better for dK/dV of full
# S = 2048 (0.642 vs 0.723): both are candidates.
HOPPER_BACKWARD_CANDIDATES = {
    64: (((32, 64, 64, 32, 4, 3), False), ((64, 64, 64, 64, 4, 3), False),
         ((64, 64, 64, 64, 4, 2), False),
         ((64, 128, 128, 64, 8, 2), True), ((64, 64, 64, 64, 4, 3), True)),
    128: (((64, 64, 64, 64, 4, 2), False), ((64, 64, 64, 64, 8, 2), True),
          ((32, 128, 128, 32, 8, 2), True)),
}
# the tiles of the dS-workspace mode (BackwardSpec.ds_dq) on sm_90 by padded head dim:
# ((BLOCK_M1, BLOCK_N1, warps, stages) of dK/dV storing dS, (BLOCK_M2, BLOCK_N2, warps,
# stages) of dQ from dS). The dQ kernel does one GEMM per tile and streams dS: 128-row
# programs (K read half as often) with 8 warps and 3 stages measured fwd+bwd 3.0-3.4% faster
# than the tuned 64 x 64, 4-warp, 2-stage tiles (causal E=128 S=16384 8.288 -> 8.043 ms,
# full S=8192 8.607 -> 8.325; H200, benchmarks/results/bwd_kernels/dq_tiles/)
HOPPER_DS_TILES = {128: ((64, 64, 4, 2), (128, 64, 8, 3))}
# the default tiles when not tuning: each head dim's first candidate
HOPPER_BACKWARD_TILES = {"cuda:90": {e: c[0][0] for e, c in HOPPER_BACKWARD_CANDIDATES.items()}}


def default_backward_tiles(head_dim_pad: int, dtype: torch.dtype, target: str):
    """(BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_warps, num_stages).

    sm_90 uses the tiles measured on the H200 (``HOPPER_BACKWARD_TILES``). Elsewhere a 4-warp
    shape (8 warps on it measured 2.1x slower on the H200, before the flat loops);
    ``python -m flexfa compile-check --only bwd`` prints registers and spills. The dK/dV
    program holds K, V and two fp32 accumulators of BLOCK_N1 x head_dim, the dQ program Q, dO
    and one.
    """
    if target == INTERPRET:
        return 64, 64, 64, 64, 4, 1  # the interpreter's cost is per tile, not per element
    if target in HOPPER_BACKWARD_TILES and dtype != torch.float32 and head_dim_pad <= 128:
        return HOPPER_BACKWARD_TILES[target][64 if head_dim_pad <= 64 else 128]
    if head_dim_pad <= 128:
        tiles = (32, 64, 64, 32, 4, 2)
    else:  # not measured: 8 warps keep the E=256 accumulators out of local memory
        tiles = (16, 32, 32, 16, 8, 1)
    if dtype == torch.float32:  # twice the bytes per element: halve the owned tiles
        tiles = (tiles[0], max(16, tiles[1] // 2), max(16, tiles[2] // 2), tiles[3],
                 tiles[4], 1)
    return tiles


def _fit(tile: int, block: int | None, what: str, call: AttentionCall) -> int:
    if block is None:
        return tile
    tile = min(tile, _largest_tile(block))
    if tile < 16:
        raise InputError(
            f"block_mask has BLOCK_SIZE {tuple(call.block_mask.BLOCK_SIZE)}; the backward's "
            f"{what} tile must divide it and be >= 16: build the mask with a BLOCK_SIZE that is "
            "a multiple of 16")
    return tile


def use_backward_tma(target: str, *tensors) -> bool:
    """Q, dO (dK/dV kernel) and K, V (dQ kernel) tiles through tensor descriptors (TMA).

    On sm_90 for fp16/bf16 whenever every tensor is a [B * H * n, d] matrix with 16-byte
    aligned rows (as for the Hopper forward); ``FLEXFA_BACKWARD_TMA=0`` turns it off, ``=1``
    forces it where the layout allows (the interpreter too: how CI tests this path)."""
    setting = os.environ.get("FLEXFA_BACKWARD_TMA", "auto")
    if setting not in ("auto", "0", "1"):
        raise InputError(f"FLEXFA_BACKWARD_TMA must be auto, 0 or 1, got {setting!r}")
    if setting == "0" or (setting == "auto" and target not in HOPPER_TARGETS):
        return False
    return descriptor_layout_ok(*tensors)


def fused_modes(call: AttentionCall, fusable: bool) -> tuple[bool, ...]:
    """Whether dQ may come from the dK/dV kernel (True) or from the dQ kernel (False), the
    default first. ``fusable``: no captured tensor needs a gradient and dK, dV are wanted;
    never with ``deterministic=True`` (the float32 additions into dQ come in any order).
    ``FLEXFA_BACKWARD_FUSED=1`` selects the fused kernel where it may be used (the interpreter
    too: how CI tests it); ``auto`` (the default) and ``0`` keep the two kernels: on the H200
    the fused kernel lost to them in every tuning class (E = 128: 1.4x-2.1x slower, E = 64:
    1%-21% slower; benchmarks/results/tuning/), its dK/dV programs running the dQ GEMM and the
    reduce-adds in line with the rest, where FA3 overlaps them in other warps."""
    setting = os.environ.get("FLEXFA_BACKWARD_FUSED", "auto")
    if setting not in ("auto", "0", "1"):
        raise InputError(f"FLEXFA_BACKWARD_FUSED must be auto, 0 or 1, got {setting!r}")
    if not fusable or call.options.deterministic or setting != "1":
        return (False,)
    return (True,)


DS_DEFAULT_MAX_BYTES = 8 << 30  # 8 GiB: the benchmark's E = 128 S = 16384 cases, not S = 65536


def ds_budget(device: torch.device) -> int:
    """The most bytes the dS workspace may take: ``FLEXFA_BACKWARD_DS_MAX_BYTES`` if set, else
    ``DS_DEFAULT_MAX_BYTES`` (at most a quarter of the GPU's memory), and on a GPU never more
    than half of what is free now. A transient workspace of gigabytes is a trade of memory for
    speed that a long-context run may not want: the default keeps S = 65536 (causal, 8 heads:
    34 GB) on the kernels that allocate nothing L x S."""
    setting = os.environ.get("FLEXFA_BACKWARD_DS_MAX_BYTES")
    if device.type != "cuda":
        return int(setting) if setting else DS_DEFAULT_MAX_BYTES
    free, total = torch.cuda.mem_get_info(device)
    return min(int(setting) if setting else min(DS_DEFAULT_MAX_BYTES, total // 4), free // 2)


def ds_bands(block_mask, L: int, S: int, sparse_q: int, sparse_kv: int,
             device: torch.device) -> tuple[torch.Tensor, int]:
    """(band, slots) of the dS workspace's block slots (``BackwardSpec.ds_dq``).

    ``band[b, h, j] = (base_j, minq_j)``, int32 ``[Bm, Hm, NKV, 2]`` over the block mask's
    batch and head dims: kv block j meets q blocks ``minq_j`` to ``maxq_j`` (the first and last
    of its partial and full q tables), and (kv block j, q block i) is slot ``base_j + i -
    minq_j`` of its head, ``base_j`` counting the bands before it. ``slots`` is the largest
    count of any head, so the workspace holds ``B * HQ * slots`` tiles of ``sparse_kv x
    sparse_q``: for causal masks about half of L x S, for document or sliding-window masks
    their band. Without a block mask every (kv block, q block) has a slot."""
    nq, nkv = cdiv(L, sparse_q), cdiv(S, sparse_kv)
    if block_mask is None:
        j = torch.arange(nkv, dtype=torch.int32, device=device)
        band = torch.stack([j * nq, torch.zeros_like(j)], -1).reshape(1, 1, nkv, 2)
        return band, nq * nkv
    low = high = None
    for name in ("q", "full_q"):
        found = _tables(block_mask, name)
        if not found:
            continue
        num_blocks, indices = found
        valid = torch.arange(indices.shape[-1], device=indices.device) < num_blocks[..., None]
        indices = indices.long()
        lo = torch.where(valid, indices, nq).amin(-1) if indices.shape[-1] else None
        hi = torch.where(valid, indices, -1).amax(-1) if indices.shape[-1] else None
        if lo is not None:
            low = lo if low is None else torch.minimum(low, lo)
            high = hi if high is None else torch.maximum(high, hi)
    if low is None:  # no block meets any other: one empty band per kv block
        shape = tuple(block_mask.kv_num_blocks.shape[:2]) + (nkv,)
        return torch.zeros(*shape, 2, dtype=torch.int32, device=device), 1
    width = (high - low + 1).clamp(min=0)
    base = width.cumsum(-1) - width
    band = torch.stack([base, torch.where(width > 0, low, 0)], -1).to(torch.int32)
    return band.to(device).contiguous(), max(1, int(width.sum(-1).max()))


_DS_BANDS = MaskedMemo(64, per_mask=4, name="dS bands")


def _ds_bands_of(block_mask, L: int, S: int, sparse_q: int, sparse_kv: int, device) -> tuple:
    """``ds_bands``, memoized per block mask (under it: dropped with it), state of its tables
    (``table_generations``: an in-place edit changes the bands) and geometry."""
    contents = table_generations(block_mask)[1] if block_mask is not None else 0
    if contents is None:  # tables whose edits cannot be seen: computed every time
        return ds_bands(block_mask, L, S, sparse_q, sparse_kv, device)
    key = (contents, L, S, sparse_q, sparse_kv, device)
    entry = _DS_BANDS.get(block_mask, key)
    if entry is None:
        entry = ds_bands(block_mask, L, S, sparse_q, sparse_kv, device)
        _DS_BANDS.put(block_mask, key, entry)
    return entry


def use_ds_dq(fusable: bool, target: str, use_tma: bool, head_dim_pad: int,
              workspace_bytes, device: torch.device) -> bool:
    """Whether the dK/dV kernel stores dS for a dQ kernel that then needs one GEMM per tile
    instead of three (``BackwardSpec.ds_dq``). Only where ``fusable`` (no captured tensor needs
    a gradient, dK and dV are wanted) and the workspace (``workspace_bytes()``: the block
    slots of ``ds_bands``, computed only when the rest allows it) fits ``ds_budget``.
    ``FLEXFA_BACKWARD_DS``: ``auto`` (the default) on sm_90 with tensor descriptors at padded
    head dim 128, where the H200 measured it faster (causal E = 128 S = 16384 fwd+bwd 8.886 ->
    8.251 ms; at E = 64 it lost, 0.91x: the kernel reading dS is memory-bound there; see
    benchmarks/results/bwd_kernels/ds_workspace/); ``1`` wherever allowed (the interpreter
    too: how CI tests it); ``0`` never."""
    setting = os.environ.get("FLEXFA_BACKWARD_DS", "auto")
    if setting not in ("auto", "0", "1"):
        raise InputError(f"FLEXFA_BACKWARD_DS must be auto, 0 or 1, got {setting!r}")
    if not fusable or setting == "0":
        return False
    if setting == "auto" and not (target in HOPPER_TARGETS and use_tma and head_dim_pad == 128):
        return False
    return workspace_bytes() <= ds_budget(device)


def ds_tiles(target: str, head_dim_pad: int, dtype: torch.dtype) -> tuple | None:
    """The dS-workspace mode's own tiles (``HOPPER_DS_TILES``), or None: the mode keeps the
    two-kernel tiles (tuned or default)."""
    if target not in HOPPER_TARGETS or dtype == torch.float32:
        return None
    return HOPPER_DS_TILES.get(head_dim_pad)


def backward_spec(q, k, v, call: AttentionCall, has_dlse: bool,
                  target: str | None = None, grad_out=None, fusable: bool = False,
                  config: tuple | None = None, force_ds: bool = False) -> BackwardSpec:
    """The backward variant for these inputs; ``target`` defaults to the inputs' device,
    ``grad_out`` (for the TMA decision) to a tensor laid out like q; ``fusable``: see
    ``fused_modes``; ``config``: (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, warps, stages,
    fused) from the autotuning, else the default tiles and mode. Where the dS workspace is
    used (``use_ds_dq``; ``force_ds``: always, for the compile checks), both kernels take the
    tiles of ``HOPPER_DS_TILES`` instead."""
    E, Ev = q.shape[3], v.shape[3]
    target = target or target_of(q.device)
    e_pad = next_power_of_two(max(E, Ev))
    if config is None:
        config = (*default_backward_tiles(e_pad, q.dtype, target), fused_modes(call, fusable)[0])
    m1, n1, m2, n2, warps, stages, fused = config
    use_tma = use_backward_tma(target, q, k, v, q if grad_out is None else grad_out)
    spec = _tiled_spec(q, k, v, call, has_dlse, target, use_tma, (m1, n1, warps, stages),
                       (m2, n2, warps, stages), fused_dq=bool(fused))
    if fused and not force_ds:
        return spec
    tiles = ds_tiles(target, e_pad, q.dtype)
    if tiles is not None:
        ds_spec = _tiled_spec(q, k, v, call, has_dlse, target, use_tma, *tiles, ds_dq=True)
    else:
        ds_spec = dataclasses.replace(spec, fused_dq=False, ds_dq=True)
    if force_ds:
        return ds_spec

    def workspace() -> int:
        _, slots = _ds_bands_of(call.block_mask, q.shape[2], k.shape[2], ds_spec.sparse_q,
                                ds_spec.sparse_kv, q.device)
        tile = ds_spec.sparse_q * ds_spec.sparse_kv * q.element_size()
        return q.shape[0] * q.shape[1] * slots * tile
    if use_ds_dq(fusable, target, use_tma, e_pad, workspace, q.device):
        return ds_spec
    return spec


def _tiled_spec(q, k, v, call: AttentionCall, has_dlse: bool, target: str, use_tma: bool,
                dkdv: tuple, dq: tuple, **mode) -> BackwardSpec:
    """The BackwardSpec of these inputs at the dK/dV kernel's (BLOCK_M1, BLOCK_N1, warps,
    stages) and the dQ kernel's (BLOCK_M2, BLOCK_N2, warps, stages), bounded by the caller's
    kernel_options (tiles; warps and stages pinned for both) and fitted to the mask's blocks;
    ``mode``: fused_dq or ds_dq."""
    L, S = q.shape[2], k.shape[2]
    (m1, n1, warps, stages), (m2, n2, dq_warps, dq_stages) = dkdv, dq
    mask, options = call.block_mask, call.options
    if options.block_m:  # the caller's tiles bound the backward's as well
        m1, m2 = min(m1, options.block_m), min(m2, options.block_m)
    if options.block_n:
        n1, n2 = min(n1, options.block_n), min(n2, options.block_n)
    if options.num_warps:
        warps = dq_warps = options.num_warps
    if options.num_stages:
        stages = dq_stages = options.num_stages
    sparse_q, sparse_kv = (int(b) for b in mask.BLOCK_SIZE) if mask is not None else (None, None)
    m1, m2 = _fit(m1, sparse_q, "query", call), _fit(m2, sparse_q, "query", call)
    n1, n2 = _fit(n1, sparse_kv, "key", call), _fit(n2, sparse_kv, "key", call)
    if mask is None:
        sparse_q, sparse_kv = max(m1, m2), max(n1, n2)
        walk_q, walk_kv = m1, n2
    else:  # the kernels walk whole blocks: a ragged last block needs the bounds checks
        walk_q, walk_kv = sparse_q, sparse_kv
    return BackwardSpec(
        dtype=DTYPE_NAMES[q.dtype], head_dim=q.shape[3], head_dim_v=v.shape[3],
        block_m1=m1, block_n1=n1, block_m2=m2, block_n2=n2, num_warps=warps,
        num_stages=stages, has_block_mask=mask is not None,
        has_full_blocks=mask is not None and bool(_tables(mask, "full_q")),
        sparse_q=sparse_q, sparse_kv=sparse_kv, even_l1=L % walk_q == 0, even_s1=S % n1 == 0,
        even_l2=L % m2 == 0, even_s2=S % walk_kv == 0, gqa_group=call.gqa_group,
        deterministic=options.deterministic, has_dlse=has_dlse,
        input_precision=options.fp32_precision, target=target, use_tma=use_tma,
        dq_warps=0 if dq_warps == warps else dq_warps,
        dq_stages=0 if dq_stages == stages else dq_stages,
        wide_ints=backward_int64_nodes(q, k, call), **mode)


def backward_int64_nodes(q, k, call: AttentionCall) -> tuple[str, ...]:
    """The ``wide_ints`` of a backward spec: the INT nodes of the score_mod's joint graph
    (with the captured-tensor gradients' indices) and of the mask_mod that need int64 over
    this call's indices (b < B, h < Hq, q_idx < L, kv_idx < S)."""
    domain = Domain(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    keys = set(mods_int64_nodes((call.mask,), domain))
    joint = joint_graph(call.score)
    if joint is not None:
        dtypes = tuple(dtype for _, dtype in call.score.buffer_specs)
        keys.update(int64_nodes(joint_roots(joint), dtypes, domain))
    return tuple(sorted(keys))


_JOINTS = BoundedMemo(1024, "joint graphs")
_KERNELS = BoundedMemo(1024, "backward kernels")


def joint_graph(score: TracedMod | None) -> JointGraph | None:
    """The score_mod's joint graph for the captured tensors that require grad now."""
    if score is None:
        return None
    memo_key = (score.key, score.grad_buffers)
    joint = _JOINTS.get(memo_key)
    if joint is None:
        joint = _JOINTS[memo_key] = derive(score)
        debug(f"joint graph of score_mod {score.name}", joint.format())
    return joint


def get_backward_module(spec: BackwardSpec, joint, score, mask):
    memo_key = (spec, score.key if score else None, score.grad_buffers if score else None,
                mask.key if mask else None)
    module = _KERNELS.get(memo_key)
    if module is None:
        generated = backward_kernel(spec, joint, score, mask)
        module = load_generated(generated, spec.interpret)
        _KERNELS[memo_key] = module = (module, generated.name)
    return module  # (module, name)


@functools.cache
def _dummy(device: torch.device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32, device=device)


def _tables(block_mask, name: str) -> tuple:
    """(num_blocks, indices) of table ``name`` ("kv", "full_kv", "q", "full_q"), or ()
    when absent. q tables missing on a duck-typed mask are transposed from the kv tables."""
    num_blocks = getattr(block_mask, f"{name}_num_blocks", None)
    if num_blocks is not None:
        return num_blocks, getattr(block_mask, f"{name}_indices")
    if not name.endswith("q"):
        return ()
    source = _tables(block_mask, name[:-1] + "kv")
    return transpose_ordered(*source) if source else ()


def _table_args(block_mask, side: str, device) -> list:
    """``side`` "kv" (dQ walks kv tiles) or "q" (dK/dV walks the transposed q tables): the
    partial and full tables and their strides, 0 along broadcast batch/head dims."""
    if block_mask is None:
        return [_dummy(device)] * 4 + [0] * 14
    tables = list(_tables(block_mask, side))
    tables += list(_tables(block_mask, f"full_{side}")) or tables[:2]
    return [*tables, *(s for t in tables for s in _broadcast_strides(t))]


def run_backward(q, k, v, out, lse, grad_out, grad_lse, call: AttentionCall,
                 need_dkdv: bool = True):
    """(dq, dk, dv, {slot: grad of captured tensor slot}) for one flex_attention call.

    ``need_dkdv=False`` (key and value need no gradient) skips the dK/dV kernel; dk and dv
    are then None. The dQ kernel always runs: it also produces the captured-tensor
    gradients."""
    joint = joint_graph(call.score)
    grad_slots = joint.grad_slots if joint is not None else ()
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    accum = torch.int64 if call.options.deterministic else torch.float32
    grads = {s: torch.zeros(call.score.buffers[s].shape, dtype=accum, device=q.device)
             for s in grad_slots}
    if q.numel() and k.numel():
        # when there is no room for the dS workspace now (it fit when the signature was
        # planned), the call takes the plan without it (fusable=False: nothing L x S)
        for fusable in (need_dkdv and not grad_slots, False):
            spec, module, name, tables, compiled, statics = _plan(
                q, k, v, out, lse, grad_out, grad_lse, call, joint, fusable)
            try:
                # a plan's first launch checks its descriptors; its key fixes what they checked
                launches = backward_launches(spec, module, name, q, k, v, out, lse, grad_out,
                                             grad_lse, call, joint, grads, dq, dk, dv, tables,
                                             statics, trusted=compiled[0] is not None)
                break
            except torch.cuda.OutOfMemoryError:
                if not spec.ds_dq:
                    raise
        # dQ, dK/dV (fused: delta, dK/dV + dQ, convert; ds: delta, dK/dV storing dS, dQ)
        for i, launch in enumerate(launches):
            if i != 1 or need_dkdv:
                compiled[i] = launch.run(compiled[i])
    else:  # nothing to attend: all gradients are zero
        for t in (dq, dk, dv):
            t.zero_()
    buffer_grads = {}
    for slot, acc in grads.items():
        target = call.score.buffers[slot]
        value = acc.double() / _FIXED_POINT_SCALE if acc.dtype == torch.int64 else acc
        buffer_grads[slot] = value.to(target.dtype)
    if not need_dkdv:
        dk = dv = None
    return dq, dk, dv, buffer_grads


def _backward_label(config) -> str:
    m1, n1, m2, n2, warps, stages, fused = config
    tiles = f"{m1}x{n1}" if fused else f"{m1}x{n1}/{m2}x{n2}"
    return f"{'fused' if fused else '2k'} {tiles} w{warps} s{stages}"


def choose_backward_config(q, k, v, out, lse, grad_out, grad_lse, call: AttentionCall, joint,
                           fusable: bool, target: str) -> tuple | None:
    """The backward's (tiles..., fused) tuned per (target, head dims, dtype, mask density
    class, short/long kv length) on sm_90, stored like the forward's (``autotune``); None
    (the default tiles and mode) when not tuning: other GPUs, tiles pinned through
    kernel_options, FLEXFA_AUTOTUNE=0, little work, or captured tensors needing gradients
    (their atomics would add up over the timed runs)."""
    e_pad = next_power_of_two(max(q.shape[3], v.shape[3]))
    options = call.options
    modes = fused_modes(call, fusable)
    work = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
    if (target not in HOPPER_BACKWARD_TILES or q.dtype == torch.float32 or e_pad > 128
            or any((options.block_m, options.block_n, options.num_warps, options.num_stages))
            or not autotune.enabled() or work < autotune.MIN_TUNED_WORK
            or (joint is not None and joint.grad_slots)):
        return None
    candidates = [(*tiles, int(fused)) for tiles, fused in
                  HOPPER_BACKWARD_CANDIDATES[64 if e_pad <= 64 else 128] if fused in modes]
    if len(candidates) < 2:
        return None
    template = "bwd-fused" if modes[0] else "bwd"
    key = autotune.tune_key(template, target, e_pad, next_power_of_two(v.shape[3]),
                            DTYPE_NAMES[q.dtype], autotune.density_class(call.block_mask),
                            k.shape[2])

    def time_config(config) -> float:  # only called when no stored winner fits
        # timed with a dense upstream gradient, as most calls get it (``out.sum()`` gives a
        # broadcast one, which would time the pointer loads instead of the descriptors)
        dense = grad_out.contiguous()
        spec = backward_spec(q, k, v, call, has_dlse=grad_lse is not None, target=target,
                             grad_out=dense, fusable=fusable, config=config)
        module, name = get_backward_module(spec, joint, call.score, call.mask)
        launches = backward_launches(spec, module, name, q, k, v, out, lse, dense, grad_lse,
                                     call, joint, {}, torch.empty_like(q), torch.empty_like(k),
                                     torch.empty_like(v))
        return triton.testing.do_bench(lambda: [launch.run() for launch in launches],
                                       warmup=5, rep=25, return_mode="median")
    return autotune.tune(key, candidates, time_config, _backward_label)


# a block mask's plans live under it (their tables are the mask's) and go with it
_PLANS = MaskedMemo(256, per_mask=16, name="backward plans")


def _plan(q, k, v, out, lse, grad_out, grad_lse, call: AttentionCall, joint,
          fusable: bool) -> tuple:
    """(spec, module, kernel name, (q-side table args, kv-side table args), compiled,
    statics) of this call's signature, memoized: a cached call skips the spec, the module
    lookup, the tables' strides and the launches' constants (``launch_statics``), and launches
    the three compiled kernels directly (``compiled``: one ``Launch.run`` state per kernel).
    Host time between the forward and the backward kernels leaves the GPU idle where the
    kernels are short (S = 2048 on the H200)."""
    buffers = [t for mod in (call.score, call.mask) if mod is not None for t in mod.buffers]
    key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), out.stride(),
           grad_out.shape, grad_out.stride(), grad_out.dtype, q.dtype, q.device,
           None if grad_lse is None else (grad_lse.dtype, grad_lse.stride(),
                                          grad_lse.data_ptr() % 16 == 0),
           tuple(t.data_ptr() % 16 == 0 for t in (q, k, v, out, grad_out)),
           call.score.key if call.score else None,
           call.score.grad_buffers if call.score else None,
           call.mask.key if call.mask else None, call.options,
           table_generations(call.block_mask)[0],  # plans hold the tables
           call.gqa_group,
           tuple((t.shape, t.stride(), t.data_ptr() % 16 == 0) for t in buffers),
           os.environ.get("FLEXFA_BACKWARD_TMA"), os.environ.get("FLEXFA_BACKWARD_FUSED"),
           os.environ.get("FLEXFA_BACKWARD_DS"), os.environ.get("FLEXFA_BACKWARD_DS_MAX_BYTES"),
           fusable)
    plan = _PLANS.get(call.block_mask, key)
    if plan is not None:
        return plan
    target = target_of(q.device)
    config = choose_backward_config(q, k, v, out, lse, grad_out, grad_lse, call, joint, fusable,
                                    target)
    spec = backward_spec(q, k, v, call, has_dlse=grad_lse is not None, target=target,
                         grad_out=grad_out, fusable=fusable, config=config)
    module, name = get_backward_module(spec, joint, call.score, call.mask)
    tables = (_table_args(call.block_mask, "q", q.device),
              _table_args(call.block_mask, "kv", q.device))
    statics = launch_statics(spec, q, k, v, grad_out, joint)
    compiled = [None] * len(statics.grids)  # one direct-launch state per launch
    plan = (spec, module, name, tables, compiled, statics)
    _PLANS.put(call.block_mask, key, plan)
    return plan


@dataclasses.dataclass
class Launch:
    """One kernel launch: also what the compile-only check compiles."""

    kernel: object
    grid: tuple[int, int]
    args: list
    constexprs: dict
    options: dict

    def run(self, direct=None):
        """Launch; returns the state for a direct launch next time (CUDA only, see
        ``flexfa.runtime.launch``). ``direct``, from an earlier call of the same signature
        (shapes, strides, alignment, dtypes: every specialization fixed), skips Triton's
        argument binding, as the Hopper forward's plans do."""
        device = self.args[0].device
        if device.type != "cuda":
            self.kernel[self.grid](*self.args, **self.constexprs, **self.options)
            return None
        if direct is not None and device.index == torch.cuda.current_device():
            launch_direct(direct, self.grid, device.index, self.args)
            return direct
        with torch.cuda.device(device):
            compiled = self.kernel[self.grid](*self.args, **self.constexprs, **self.options)
        return direct_state(self.kernel, compiled, self.args, self.constexprs)


@dataclasses.dataclass(frozen=True)
class LaunchStatics:
    """What the launches of a backward pass take from its signature alone: their grids,
    constexprs and launch options, in launch order (dQ, dK/dV; fused: delta, dK/dV + dQ,
    dQ's conversion; ds_dq: delta, dK/dV storing dS, dQ from dS) and the descriptors' (shape,
    strides, block) for q, dO, k, v and the dQ accumulator (None without TMA)."""

    grids: tuple
    constexprs: tuple
    options: tuple
    geometry: dict | None


def launch_statics(spec: BackwardSpec, q, k, v, grad_out, joint) -> LaunchStatics:
    B, Hq, L, E = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    delta_block = 16 if spec.interpret else 64
    one, small = dscore_is_one(joint), {"num_warps": 4}
    has_grads = bool(joint is not None and joint.grad_slots)
    dq = ((cdiv(L, spec.block_m2), B * Hq), spec.dq_constexprs(one, has_grads),
          spec.dq_launch_options())
    if spec.fused_dq:  # delta (zeroing the dQ accumulator), dK/dV + dQ, dQ's conversion
        first = ((cdiv(L, delta_block), B * Hq), spec.delta_constexprs(delta_block), small)
        last = ((cdiv(L, delta_block), B * Hq), spec.convert_constexprs(delta_block), small)
    elif spec.ds_dq:  # delta, dK/dV (storing dS), dQ from dS
        first = ((cdiv(L, delta_block), B * Hq), spec.delta_constexprs(delta_block), small)
        last = dq
    else:  # dQ (storing delta), dK/dV
        first, last = dq, None
    dkdv = ((cdiv(S, spec.block_n1), B * Hkv), spec.dkdv_constexprs(one), spec.launch_options())
    launches = (first, dkdv, last) if last else (first, dkdv)
    geometry = None
    if spec.use_tma:
        e_pad, ev_pad = next_power_of_two(E), next_power_of_two(v.shape[3])
        dq_acc_shape = [B * Hq * L, E], [E, 1], [spec.block_m1, e_pad]
        geometry = {"q": _geometry(q, spec.block_m1, e_pad),
                    "do": _geometry(grad_out, spec.block_m1, ev_pad),
                    "k": _geometry(k, spec.block_n2, e_pad),
                    "v": _geometry(v, spec.block_n2, ev_pad),
                    "dq_acc": dq_acc_shape}
    return LaunchStatics(grids=tuple(x[0] for x in launches),
                         constexprs=tuple(x[1] for x in launches),
                         options=tuple(x[2] for x in launches), geometry=geometry)


def backward_launches(spec, module, name, q, k, v, out, lse, grad_out, grad_lse, call, joint, grads,
                      dq, dk, dv, tables=None, statics: LaunchStatics | None = None,
                      trusted: bool = False) -> list[Launch]:
    """The launches of a backward pass, in order, the dK/dV kernel always second: dQ, which
    also stores delta = rowsum(dO * O) (- dlse) for the next, and dK/dV (with
    ``spec.fused_dq``: delta, which also zeroes the float32 dQ accumulator, dK/dV + dQ, and
    the accumulator's conversion to dq; with ``spec.ds_dq``: delta, dK/dV storing dS in a
    workspace, and dQ = dS @ K from it); ``tables`` (the q-side and kv-side block-mask table
    arguments) and ``statics`` when the caller has them already; ``trusted``: the tensor
    descriptors' checks passed for this signature before."""
    B, Hq, L, E = q.shape
    S = k.shape[2]
    device = q.device
    if statics is None:
        statics = launch_statics(spec, q, k, v, grad_out, joint)
    lse = lse.contiguous()
    delta = torch.empty(B, Hq, L, dtype=torch.float32, device=device)
    dlse = grad_lse.float().contiguous() if grad_lse is not None else delta
    mod_args = buffer_launch_args(call.score) + buffer_launch_args(call.mask)
    mod_args = [a.detach() if isinstance(a, torch.Tensor) else a for a in mod_args]
    grad_args = [x for g in grads.values() for x in (g, *g.stride())]
    scale = float(call.scale)
    if tables is None:
        tables = (_table_args(call.block_mask, "q", device),
                  _table_args(call.block_mask, "kv", device))
    # the fused kernel's float32 dQ accumulator, zeroed by the delta kernel; else unused
    dq_acc = torch.empty(B, Hq, L, E, dtype=torch.float32, device=device) \
        if spec.fused_dq else delta
    dq_desc = dq_acc
    # the dS workspace of block slots (ds_dq: ds_bands), else unused
    if spec.ds_dq:
        band, slots = _ds_bands_of(call.block_mask, L, S, spec.sparse_q, spec.sparse_kv, device)
        ds_rows = B * Hq * slots * spec.sparse_kv
        ds = torch.empty(ds_rows * spec.sparse_q, dtype=q.dtype, device=device)
        band_args = [band, *_broadcast_strides(band)[:3], slots]
    else:
        ds_rows, ds = 1, delta
        band_args = [_dummy(device), 0, 0, 0, 0]
    ds_store = ds_load = ds
    if statics.geometry is not None:
        kind, geometry = TrustedDescriptor if trusted else TensorDescriptor, statics.geometry
        q_desc, do_desc = kind(q, *geometry["q"]), kind(grad_out, *geometry["do"])
        k_desc, v_desc = kind(k, *geometry["k"]), kind(v, *geometry["v"])
        if spec.fused_dq and not spec.interpret:
            dq_desc = kind(dq_acc, *geometry["dq_acc"])
        if spec.ds_dq:  # the workspace's rows as dK/dV stores and dQ loads its tiles
            view = ([ds_rows, spec.sparse_q], [spec.sparse_q, 1])
            ds_store = kind(ds, *view, [spec.block_n1, spec.block_m1])
            ds_load = kind(ds, *view, [spec.block_n2, spec.block_m2])
    else:  # unused pointers in the kernels' descriptor slots
        q_desc, do_desc, k_desc, v_desc = q, grad_out, k, v
    grids, constexprs, options = statics.grids, statics.constexprs, statics.options
    dkdv = Launch(getattr(module, f"{name}_dkdv"), grids[1],
                  [q, k, v, grad_out, q_desc, do_desc, dk, dv, lse, delta, dq_acc, dq_desc,
                   ds, ds_store, *band_args, *q.stride(),
                   *k.stride(), *v.stride(), *grad_out.stride(), *dk.stride(), *dv.stride(),
                   *tables[0], Hq, L, S, scale, *mod_args],
                  constexprs[1], options[1])
    dq_index = 2 if spec.ds_dq else 0
    dq_launch = Launch(getattr(module, f"{name}_dq"), grids[dq_index],
                       [q, k, v, grad_out, k_desc, v_desc, dq, lse, delta, out, dlse, ds, ds_load,
                        *band_args, *q.stride(), *k.stride(), *v.stride(),
                        *grad_out.stride(), *dq.stride(), *out.stride(), *tables[1],
                        Hq, L, S, scale, *mod_args, *grad_args],
                       constexprs[dq_index], options[dq_index])
    if spec.fused_dq or spec.ds_dq:
        delta_launch = Launch(module.flexfa_bwd_delta, grids[0],
                              [out, grad_out, dlse, delta, dq_acc, *out.stride(),
                               *grad_out.stride(), Hq, L],
                              constexprs[0], options[0])
        if spec.ds_dq:
            return [delta_launch, dkdv, dq_launch]
        return [delta_launch, dkdv,
                Launch(module.flexfa_bwd_dq_convert, grids[2],
                       [dq_acc, dq, *dq.stride(), Hq, L, scale], constexprs[2], options[2])]
    return [dq_launch, dkdv]
