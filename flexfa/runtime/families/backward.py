"""The backward family: the dQ and dK/dV kernels of ``bwd_dq.tmpl`` / ``bwd_dkdv.tmpl``.

Two launches (dQ, which also stores delta = rowsum(dO * O) - dlse and accumulates the
captured-tensor gradients; then dK/dV), or with the dS workspace (``ds_workspace``, only with
kernel_options ``DS_WORKSPACE=True``) three (delta; dK/dV storing dS; dQ = dS @ K). P is
recomputed from the saved lse tile by tile. By default the only memory past the inputs and
their gradients is O(B * Hq * L) (delta, the lse gradient in float32) and the captured
tensors' accumulators (their own shapes): one dQ program per q tile owns its rows, and one
dK/dV program per kv tile loops over its GQA group's query heads, writing [B, Hkv, S, E].
Q/dO and K/V tiles go through tensor descriptors (TMA) on sm_90 where the layout allows
(kernel_options ``USE_TMA``). Tiles: measured defaults on sm_90 (docs/performance.md), tuned
per class at head dim 64, bounded by the caller's kernel_options.

Captured-tensor gradients are accumulated in float32 with atomics, or, with
``deterministic=True``, in int64 fixed point (integer addition is associative: bit-identical
runs), two words an entry (units of 2**-32, range +-2**31, and the rest in units of 2**-62),
beside an int64 bound on the magnitudes added: an entry whose magnitudes sum to 2**30 or
more (where the range may have been passed) comes back NaN, never wrapped.
"""
from __future__ import annotations

import dataclasses

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from ...blockmask.block_mask import BlockMask
from ...blockmask.density import density_class, record
from ...blockmask.validate import capturing, mark_checked
from ...codegen.backward import (BackwardSpec, backward_kernel, dscore_is_one,
                                 has_buffer_grads, joint_roots, wide_head_dims)
from ...codegen.fold import fold_joint
from ...codegen.ranges import Domain, int64_nodes, mods_int64_nodes
from ...codegen.spec import DTYPE_NAMES, head_dim_blocks, next_power_of_two
from ...errors import InputError
from ...frontend.grad import JointGraph, derive
from ...frontend.trace import TracedMod
from ...memo import BoundedMemo
from .. import autotune, binding, ds_workspace, plans
from ..call import AttentionCall
from ..debug import debug
from ..pipeline import prepare_mask
from ..kernels import generated_module
from ..launch import Step, TrustedDescriptor, cdiv
from ..registry import KernelFamily, register
from ..tables import (broadcast_strides, check_tile, dummy_table, has_full_blocks, largest_tile,
                      mask_blocks)
from ..target import Target
from .hopper import descriptor_layout_ok, geometry, head_geometry

# deterministic=True's accumulators (flexfa_grad_add in bwd_common.tmpl): the value in units of
# 2**-32 and its rest in units of 2**-62; a bound on the magnitudes added in units of 2**-12
# (and 2**-2 a nonzero term), an entry valid while it lies in 0 .. 2**BOUND_BITS - 1
# (magnitudes below 2**30, fewer than 2**32 terms; negative: wrapped)
FIXED_POINT_SCALE = 2.0 ** 32
REST_SCALE = 2.0 ** 62
BOUND_BITS = 42

# sm_90 tiles (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, warps, stages) by padded head dim,
# measured on the H200 (docs/performance.md); the first is the default, the others are
# tuned at head dim 64 (at 128 one candidate: nothing to tune)
HOPPER_BACKWARD_CANDIDATES = {
    64: ((32, 64, 64, 32, 4, 3), (64, 64, 64, 64, 4, 3), (64, 64, 64, 64, 4, 2)),
    128: ((64, 64, 64, 64, 4, 2),),
}
# padded (E, Ev) past 128 on sm_90 with tensor descriptors, with the dQ kernel's own (warps,
# stages) last; the first timed on the H200 (benchmarks/bwd_kernel_sweep.py, B * S = 16384,
# causal with and without a softcap, 2026-12-02 results d_28208eb, d2_28208eb, d3_78e95f1):
# dQ programs of 128 rows over 8 warps walking 32 keys (Ev = 256) or 64 (Ev = 128) take 3.6
# and 2.1 ms at S = 8192 where 64 rows walking 16 / 32 took 15.4 and 7.1; dK/dV programs of
# 64 keys over 8 warps walking 64 query rows take 8.2 / 5.0 ms where 32 keys over 4 warps
# took 10.0 / 6.8. The others: less shared memory, for tuning. Without descriptors all of
# these spill 700..2700 bytes: the generic tiles.
HOPPER_BACKWARD_WIDE = {
    (256, 128): ((64, 64, 128, 64, 8, 2, 8, 2), (64, 32, 128, 32, 4, 2, 8, 2),
                 (32, 32, 32, 32, 4, 3, 4, 3)),
    (256, 256): ((64, 64, 128, 32, 8, 2, 8, 2), (32, 64, 128, 32, 8, 2, 8, 2),
                 (32, 32, 64, 32, 4, 2, 4, 2)),
}
# lengths that are not multiples of 128 take the bounds-checked code, where the 8-warp dK/dV
# programs spill 116..224 words (S = 8100 with a softcap, d4_78e95f1; the GPU runs report
# Triton's n_spills, local memory in 4-byte words): at Ev = 256 they lose (16.8 against
# 12.5 ms), at Ev = 128 they win by 7% (11.1 against 11.9); both take the 4-warp dK/dV
# programs of 32 keys there (no spills, d4_78e95f1 and the compile check; the 136 words of
# s28_bf48edf were 64 keys walking 32 rows, not these), with the 128-row dQ programs
# (2.4-3.2x faster than the 64-row ones; since their K/V loads and dQ stores go through
# per-head descriptors, 0 words of spills at 256 and 8 at 192/128 in the GPU's compile, 46
# and 60 before, and 0.66-0.70x the time: S = 8100 softcap + causal, s28_bf48edf). Since Q
# and dO come through per-head descriptors at ragged lengths (no bounds selects), the 8-warp
# 64-key programs at Ev = 256 under a block mask are faster again: those calls take the even
# lengths' default (``ragged_default``); without a block mask they still spill
HOPPER_BACKWARD_WIDE_RAGGED = {
    (256, 128): (64, 32, 128, 64, 4, 2, 8, 2),
    (256, 256): (32, 32, 128, 32, 4, 2, 8, 2),
}
RAGGED_TILE = 128  # lengths not a multiple of this are "ragged" for the wide tiles


def ragged_lengths(q, k) -> bool:
    """The query or key length is not a multiple of the widest backward tile: the kernels
    run their bounds-checked code, which the wide head dims' defaults tell apart."""
    return bool(q.shape[2] % RAGGED_TILE or k.shape[2] % RAGGED_TILE)


def ragged_default(q, k, v, call: AttentionCall) -> bool:
    """The wide head dims' ragged-length default applies (``HOPPER_BACKWARD_WIDE_RAGGED``):
    lengths that are not multiples of ``RAGGED_TILE``, except at padded head dims 256/256
    under a block mask. There, since Q and dO come through per-head descriptors (no bounds
    selects), the 8-warp 64-key dK/dV programs win at ragged lengths as at even ones (H200,
    S = 8100, the dK/dV kernel alone, ms against the 4-warp 32-key tiles: causal 6.7 / 10.2,
    softcap + causal 7.4 / 10.6, ALiBi + causal 7.0 / 10.3, document 1.7 / 2.5, causal GQA 4
    7.2 / 10.3, causal with dropout 14.1 / 14.5; fwd+bwd 1.23-1.28x, rag_67facf5 and
    mask_e08f18d). Without a mask their unmasked walk spills 736 bytes (66 local-memory
    instructions in the loop) in the sm_90 compile; at 192/128 the 4-warp tiles stay faster
    under a mask too (causal 5.1 / 5.6 ms, softcap + causal 5.4 / 7.4)."""
    wide_pair = (next_power_of_two(q.shape[3]), next_power_of_two(v.shape[3])) == (256, 256)
    return ragged_lengths(q, k) and not (wide_pair and call.block_mask is not None)


def hopper_candidates(head_dim_pad: int, head_dim_v_pad: int, ragged: bool = False) -> tuple:
    """The sm_90 candidates for padded head dims (E, Ev), the default first; ``ragged``:
    lengths that are not multiples of ``RAGGED_TILE`` (another default past 128)."""
    widest = max(head_dim_pad, head_dim_v_pad)
    if widest <= 128:
        return HOPPER_BACKWARD_CANDIDATES[64 if widest <= 64 else 128]
    pair = (head_dim_pad, head_dim_v_pad) if (head_dim_pad, head_dim_v_pad) in \
        HOPPER_BACKWARD_WIDE else (256, 256)
    candidates = HOPPER_BACKWARD_WIDE[pair]
    if ragged:
        first = HOPPER_BACKWARD_WIDE_RAGGED[pair]
        return (first,) + tuple(c for c in candidates if c != first)
    return candidates


def default_tiles(head_dim_pad: int, dtype: torch.dtype, target: Target,
                  head_dim_v_pad: int | None = None, tma: bool = True,
                  ragged: bool = False) -> tuple:
    """(BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_warps, num_stages[, dQ's num_warps,
    dQ's num_stages]) for padded head dims E (and Ev, default E); ``tma``: Q, dO, K, V tiles
    through tensor descriptors (what the sm_90 tiles past 128 need); ``ragged``: lengths that
    are not multiples of ``RAGGED_TILE`` (``ragged_lengths``). The dK/dV program holds
    K, V and two fp32 accumulators of BLOCK_N1 x head_dim, the dQ program Q, dO and one;
    elsewhere than sm_90 a 4-warp shape (``python -m flexfa compile-check --only bwd`` prints
    registers and spills)."""
    if target.interpret:
        return 64, 64, 64, 64, 4, 1  # the interpreter's cost is per tile, not per element
    head_dim_v_pad = head_dim_v_pad or head_dim_pad
    widest = max(head_dim_pad, head_dim_v_pad)
    if target.is_sm90 and dtype != torch.float32 and (tma or widest <= 128):
        return hopper_candidates(head_dim_pad, head_dim_v_pad, ragged)[0]
    head_dim_pad = widest
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
    tile = min(tile, largest_tile(block))
    if tile < 16:
        raise InputError(
            f"block_mask has BLOCK_SIZE {tuple(call.block_mask.BLOCK_SIZE)}; the backward's "
            f"{what} tile must divide it and be >= 16: build the mask with a BLOCK_SIZE that is "
            "a multiple of 16")
    return tile


def use_tma(call: AttentionCall, target: Target, *tensors) -> bool:
    """Q, dO (dK/dV kernel) and K, V (dQ kernel) tiles through tensor descriptors: by default
    on sm_90 where every tensor is a [B * H * n, d] matrix with 16-byte aligned rows;
    ``USE_TMA=True`` wherever the layout allows (the interpreter too: how CI tests it)."""
    setting = call.options.bwd.use_tma
    if setting is False or (setting is None and not target.is_sm90):
        return False
    return descriptor_layout_ok(*tensors)


def dense_grad_out(call: AttentionCall, target: Target, x: Inputs) -> bool:
    """Whether the backward copies dO to a dense tensor first: where q, k, v take the tensor
    descriptors' tiles (``use_tma``) and dO alone fails their layout check, as the broadcast
    dO of ``out.sum().backward()`` (stride 0) does. Without the copy such a call took the
    pointer-load tiles, past head dim 128 one small untuned default (16 x 32 / 32 x 16): fwd+bwd
    6.99-8.64x the time at 192 / 128 and 256, 1.95x at 128 on an H100
    (gpu_2026-12-05/wo_b1c2b4e, docs/head-dims.md), and the routing (it sees q, k, v, not dO)
    did not expect it. The Gluon backward copies such a dO too. Costs one tensor of dO's
    size."""
    return (use_tma(call, target, x.q, x.k, x.v)
            and not descriptor_layout_ok(x.grad_out))


# BWD_FULL_WALK: a call without a block mask walked through the tables of a mask whose every
# block is full, so that at padded head dims 256 / 256 (one column block) the dK/dV kernel
# runs the one loop under a block mask (bwd_dkdv.tmpl's ONE_LOOP), where dS^T is formed under
# the mask's branch and S^T and dP^T split their columns between the warpgroups; the unmasked
# walk's tiles compute both in each warpgroup. fwd+bwd on an H100 (options_ab.py, 3 rounds,
# gpu_2026-12-05/fw_e9e070a, the Triton backward forced, dense): 0.82x the time at S = 8192
# (20.292 against 24.792 ms) and 0.83x at 2048 (5.248 against 6.330), and 0.87x and 0.69x the
# Gluon backward's (23.194, 7.616); at 1024 and 1000 3.566 and 3.670 ms against the Gluon
# backward's 4.466 and 4.501 (those runs made the full masks with create_block_mask). With this
# walk's own tables on an H200 ('AUTO', gpu_2026-12-05/wn_b990bbf, 3 rounds): 0.82x the
# unmasked walk's time at 8192 (20.205 against 24.781 ms), 0.83x at 2048, 0.77x at 1000, and
# 0.89x, 0.88x and 0.93x the Gluon backward's: 'AUTO' is the option's default
FULL_WALK_BLOCK = 128
_FULL_WALKS = BoundedMemo(64, "full-block walks")


def full_walk(call: AttentionCall, target: Target, q, k, v, grad_out) -> bool:
    """The call runs through ``full_walk_mask``'s tables (kernel_options BWD_FULL_WALK,
    'AUTO' by default): never under a block mask or while a CUDA graph is captured (the
    tables are made on first use); 'AUTO' where measured faster: sm_90 with tensor
    descriptors, bf16 / fp16, q's and v's head dims both padding to 256 in one column block
    (E = 256, 224), no dropout."""
    if call.block_mask is not None or capturing():
        return False
    choice = call.options.bwd_full_walk
    if choice is not None:
        return choice
    return (target.is_sm90 and q.dtype != torch.float32 and call.dropout is None
            and next_power_of_two(q.shape[3]) == next_power_of_two(v.shape[3]) == 256
            and head_dim_blocks(q.shape[3])[1] == 0
            and use_tma(call, target, q, k, v, grad_out))


def every_key(b, h, q_idx, kv_idx):
    """The full walk's mask_mod: every key (no block is partial, so it never runs). Not
    noop_mask: a mask that is a constant leaves the one loop's mask branch with two equal
    arms, which the compiler merges, and with the branch goes the split of S^T and dP^T
    between the warpgroups (sm_90 compile: 56 bytes of spills, 5 local-memory instructions a
    tile, where this keeps 0)."""
    return q_idx >= 0


def full_walk_mask(L: int, S: int, device: torch.device) -> BlockMask:
    """The BlockMask over L x S whose every FULL_WALK_BLOCK block is full, its tables
    broadcast over batch and heads (an index row of each side, expanded: O(L + S) memory),
    kept per (L, S, device)."""
    key = (L, S, device)
    mask = _FULL_WALKS.get(key)
    if mask is not None:
        return mask
    rows, cols = cdiv(L, FULL_WALK_BLOCK), cdiv(S, FULL_WALK_BLOCK)

    def tables(n: int, m: int) -> tuple:
        """(empty partial count, indices; full count, indices) of n rows of m blocks."""
        zeros = torch.zeros(1, 1, n, dtype=torch.int32, device=device)
        every = torch.arange(m, dtype=torch.int32, device=device).expand(1, 1, n, m)
        return zeros, every, torch.full((1, 1, n), m, dtype=torch.int32, device=device), every
    mask = BlockMask((L, S), *tables(rows, cols), *tables(cols, rows),
                     BLOCK_SIZE=(FULL_WALK_BLOCK, FULL_WALK_BLOCK), mask_mod=every_key)
    mark_checked(mask)  # correct by construction
    record(mask, rows * cols, rows * cols)  # every tile visited (no device read)
    _FULL_WALKS[key] = mask
    return mask


def with_block_mask(call: AttentionCall, block_mask) -> AttentionCall:
    """``call`` under ``block_mask`` (its mask_mod traced; the block mask keeps the trace)."""
    return AttentionCall(call.score, prepare_mask(block_mask), block_mask, call.scale,
                         call.options, call.gqa_group, call.sinks, call.dropout)


_JOINTS = BoundedMemo(1024, "joint graphs")


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


def int64_nodes_of(q, k, call: AttentionCall) -> tuple[str, ...]:
    """The ``wide_ints`` of a backward spec: the INT nodes of the score_mod's joint graph
    (and the mask_mod) that need int64 over this call's indices."""
    domain = Domain(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    joint = joint_graph(call.score)
    wide = set(mods_int64_nodes((call.mask,), domain))
    if joint is not None:
        dtypes = tuple(dtype for _, dtype in call.score.buffer_specs)
        wide.update(int64_nodes(joint_roots(joint), dtypes, domain))
        folded = fold_joint(joint)  # what the kernels render where a factor folds (new keys)
        if folded is not None:
            wide.update(int64_nodes(joint_roots(folded.joint), dtypes, domain))
    return tuple(sorted(wide))


def backward_spec(q, k, v, call: AttentionCall, has_dlse: bool, target: Target,
                  grad_out=None, fusable: bool = False, config: tuple | None = None,
                  force_ds: bool = False) -> BackwardSpec:
    """The backward variant for these inputs; ``grad_out`` (for the TMA decision) defaults
    to a tensor laid out like q; ``fusable``: no captured tensor needs a gradient and dK, dV
    are wanted (the dS workspace may be used); ``config``: (BLOCK_M1, BLOCK_N1, BLOCK_M2,
    BLOCK_N2, warps, stages[, dQ's warps, dQ's stages]) from the autotuning, else the
    defaults. Where the dS workspace is used (``force_ds``: always, for the compile checks)
    both kernels take its tiles."""
    e_pad = next_power_of_two(max(q.shape[3], v.shape[3]))
    tma = use_tma(call, target, q, k, v, q if grad_out is None else grad_out)
    m1, n1, m2, n2, warps, stages, *dq = config or default_tiles(
        next_power_of_two(q.shape[3]), q.dtype, target, next_power_of_two(v.shape[3]), tma,
        ragged_default(q, k, v, call))
    dq_warps, dq_stages = dq or (warps, stages)
    spec = _tiled_spec(q, k, v, call, has_dlse, target, tma, (m1, n1, warps, stages),
                       (m2, n2, dq_warps, dq_stages))
    tiles = ds_workspace.tiles(target, e_pad, q.dtype)
    if tiles is not None:
        ds_spec = _tiled_spec(q, k, v, call, has_dlse, target, tma, *tiles, ds_dq=True)
    else:
        ds_spec = dataclasses.replace(spec, ds_dq=True)
    if force_ds:
        return ds_spec

    def workspace() -> int:
        _, slots = ds_workspace.bands_of(call.block_mask, q.shape[2], k.shape[2],
                                         ds_spec.sparse_q, ds_spec.sparse_kv, q.device)
        tile = ds_spec.sparse_q * ds_spec.sparse_kv * q.element_size()
        return q.shape[0] * q.shape[1] * slots * tile
    if ds_workspace.allowed(call, fusable, workspace, q.device):
        return ds_spec
    return spec


def _tiled_spec(q, k, v, call: AttentionCall, has_dlse: bool, target: Target, tma: bool,
                dkdv: tuple, dq: tuple, **mode) -> BackwardSpec:
    """The BackwardSpec at the dK/dV kernel's (BLOCK_M1, BLOCK_N1, warps, stages) and the dQ
    kernel's (BLOCK_M2, BLOCK_N2, warps, stages), bounded by the caller's kernel_options (the
    forward's tiles bound both kernels', torch's BLOCK_M1..N2 set them; warps and stages are
    pinned for both) and fitted to the mask's blocks; ``mode``: ds_dq."""
    L, S = q.shape[2], k.shape[2]
    (m1, n1, warps, stages), (m2, n2, dq_warps, dq_stages) = dkdv, dq
    mask, options = call.block_mask, call.options.bwd
    if options.block_m:
        m1, m2 = min(m1, options.block_m), min(m2, options.block_m)
    if options.block_n:
        n1, n2 = min(n1, options.block_n), min(n2, options.block_n)
    m1, n1 = options.block_m1 or m1, options.block_n1 or n1
    m2, n2 = options.block_m2 or m2, options.block_n2 or n2
    if options.num_warps:
        warps = dq_warps = options.num_warps
    if options.num_stages:
        stages = dq_stages = options.num_stages
    sparse_q, sparse_kv = mask_blocks(mask)
    if mask is not None:  # a pinned tile is taken as it is, or refused (the forward's too)
        for key, tile, block in (("BLOCK_M1", options.block_m1, sparse_q),
                                 ("BLOCK_N1", options.block_n1, sparse_kv),
                                 ("BLOCK_M2", options.block_m2, sparse_q),
                                 ("BLOCK_N2", options.block_n2, sparse_kv)):
            if tile:
                check_tile(mask, key, tile, block, "backward")
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
        has_full_blocks=has_full_blocks(mask, "q"),
        sparse_q=sparse_q, sparse_kv=sparse_kv, even_l1=L % walk_q == 0, even_s1=S % n1 == 0,
        even_l2=L % m2 == 0, even_s2=S % walk_kv == 0, gqa_group=call.gqa_group,
        deterministic=call.options.deterministic, has_dlse=has_dlse,
        input_precision=call.options.fp32_precision, target=target.name, use_tma=tma,
        dq_warps=0 if dq_warps == warps else dq_warps,
        dq_stages=0 if dq_stages == stages else dq_stages,
        wide_ints=int64_nodes_of(q, k, call), dropout=call.dropout is not None,
        split_head_dim=split_head_dim(q.shape[3], target), **mode)


def split_head_dim(head_dim: int, target: Target) -> bool:
    """The kernels hold Q, K, dQ and dK in two column blocks (``head_dim_blocks``: 192 as
    128 + 64, no padding to 256) wherever such blocks exist on sm_90 and under the
    interpreter (which tests what sm_90 runs), elsewhere past 128 only: sm_80's kernels at
    E = 96 and 80 spill with them (compile check: dK/dV 96 bytes, dQ 12 and 4) and not
    without (docs/head-dims.md)."""
    return head_dim_blocks(head_dim)[1] > 0 and (
        target.is_sm90 or target.interpret or head_dim > 128)


@dataclasses.dataclass(slots=True)
class Inputs:
    """The tensors of one backward pass; ``grads``: the float32 (or int64 fixed-point)
    accumulators of the captured tensors' gradients by slot; ``delta``: where the kernels
    store rowsum(dO * O) - dlse [B, Hq, L] float32 for the caller (the sinks' gradient),
    None for a buffer of their own; ``dk``, ``dv``: None in a cached call that wants no dK/dV
    (the plan's dK/dV kernel does not run; a plan is made with them). Made per call (not
    frozen: a frozen dataclass's __init__ costs a few microseconds of every cached
    backward)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    grad_out: torch.Tensor
    grad_lse: torch.Tensor | None
    dq: torch.Tensor
    dk: torch.Tensor | None
    dv: torch.Tensor | None
    grads: dict
    delta: torch.Tensor | None = None


def make_steps(spec: BackwardSpec, loaded, x: Inputs, call: AttentionCall,
               joint) -> tuple[Step, ...]:
    """The launches in order, the dK/dV kernel always second: (dQ, dK/dV) or, with the dS
    workspace, (delta, dK/dV storing dS, dQ from dS); each binds its arguments by name, the
    layout (strides, tables, lengths) fixed here."""
    B, Hq, L, _ = x.q.shape
    Hkv, S = x.k.shape[1], x.k.shape[2]
    one = dscore_is_one(joint)
    has_grads = has_buffer_grads(joint)
    layout = {**binding.strides("q", "bhmd", x.q.stride()),
              **binding.strides("k", "bhnd", x.k.stride()),
              **binding.strides("v", "bhnd", x.v.stride()),
              **binding.strides("g", "bhmd", x.grad_out.stride()),
              **binding.strides("o", "bhmd", x.out.stride()),
              "HQ": Hq, "L": L, "S": S, **binding.buffer_layout(call.score, call.mask),
              # the accumulators are contiguous in their captured tensors' shapes (the key's)
              **binding.gradient_strides(x.grads)}
    device = x.q.device
    if not spec.ds_dq:  # no workspace: its band table and strides are dummies
        layout.update({"DS_BAND": dummy_table(device), "MAX_SLOTS": 0,
                       **binding.strides("band_", "bhn", (0, 0, 0))})

    def step(kernel: str, grid, constexprs, options, fixed) -> Step:
        function = f"{loaded.name}_{kernel}" if kernel in ("dq", "dkdv") else kernel
        return Step(loaded.kernel(function), grid, constexprs, options,
                    binding.Binder(loaded.names(function), {**layout, **fixed}))
    dq = step("dq", (cdiv(L, spec.block_m2), B * Hq), spec.dq_constexprs(one, has_grads),
              spec.dq_launch_options(),
              {**binding.strides("dq", "bhmd", x.dq.stride()),
               **binding.tables("KV", "m", "n", call.block_mask, "kv", device)})
    dkdv = step("dkdv", (cdiv(S, spec.block_n1), B * Hkv), spec.dkdv_constexprs(one),
                spec.launch_options(),
                {**binding.strides("dk", "bhnd", x.dk.stride()),
                 **binding.strides("dv", "bhnd", x.dv.stride()),
                 **binding.tables("Q", "n", "m", call.block_mask, "q", device)})
    if not spec.ds_dq:
        return dq, dkdv
    delta_block = 16 if spec.interpret else 64
    delta = step("flexfa_bwd_delta", (cdiv(L, delta_block), B * Hq),
                 spec.delta_constexprs(delta_block), {"num_warps": 4}, {})
    return delta, dkdv, dq


def descriptor_geometry(spec: BackwardSpec, x: Inputs) -> dict | None:
    """The descriptors' (shape, strides, block) for q, dO (dK/dV kernel), k, v and dq (dQ
    kernel), and where the q/k head dim is split (``head_dim_blocks``) q_b, k_b and dq_b, the
    second column block's (the kernels load and store it at column E_A); None without
    TMA."""
    if not spec.use_tma:
        return None
    e_a, e_b = spec.column_blocks
    ev_pad = next_power_of_two(x.v.shape[3])
    # Q and dO of the dK/dV kernel: per head where L is ragged (bwd_dkdv.tmpl, not EVEN_L)
    rows = geometry if spec.even_l1 else head_geometry
    blocks = {"q": rows(x.q, spec.block_m1, e_a),
              "do": rows(x.grad_out, spec.block_m1, ev_pad),
              "k": head_geometry(x.k, spec.block_n2, e_a),
              "v": head_geometry(x.v, spec.block_n2, ev_pad),
              "dq": head_geometry(x.dq, spec.block_m2, e_a)}
    if e_b:
        blocks.update(q_b=rows(x.q, spec.block_m1, e_b),
                      k_b=head_geometry(x.k, spec.block_n2, e_b),
                      dq_b=head_geometry(x.dq, spec.block_m2, e_b))
    return blocks


def call_values(plan, call: AttentionCall, x: Inputs) -> dict:
    """A backward call's values by parameter name: the tensors, the statistics, delta, the dS
    workspace, the scale and the captured tensors (and their gradients' pointers); what the
    plan's key fixes (strides, without the workspace its dummy band) is in its steps."""
    spec = plan.spec
    delta = x.delta if x.delta is not None else torch.empty_like(
        x.lse, dtype=torch.float32, memory_format=torch.contiguous_format)
    values = {"Q": x.q, "K": x.k, "V": x.v, "DO": x.grad_out, "DOUT": x.grad_out,
              "OUT": x.out, "DQ": x.dq, "DK": x.dk, "DV": x.dv, "LSE": x.lse.contiguous(),
              "DELTA": delta,
              "DLSE": x.grad_lse.float().contiguous() if x.grad_lse is not None else delta,
              "sm_scale": float(call.scale),
              **binding.buffer_pointers(call.score, call.mask),
              **binding.feature_values(call), **binding.gradient_pointers(x.grads)}
    geometry_ = plan.fixed["geometry"]
    if geometry_ is not None:
        # a plan's first launch checks the descriptors; its key fixes what they read
        kind = TrustedDescriptor if plan.steps[0].launched else TensorDescriptor
        values.update(Q_DESC=kind(x.q, *geometry_["q"]),
                      DO_DESC=kind(x.grad_out, *geometry_["do"]),
                      K_DESC=kind(x.k, *geometry_["k"]), V_DESC=kind(x.v, *geometry_["v"]),
                      DQ_DESC=kind(x.dq, *geometry_["dq"]))
        if "q_b" in geometry_:
            values.update(Q_DESC_B=kind(x.q, *geometry_["q_b"]),
                          K_DESC_B=kind(x.k, *geometry_["k_b"]),
                          DQ_DESC_B=kind(x.dq, *geometry_["dq_b"]))
    else:  # unused pointers in the kernels' descriptor slots
        values.update(Q_DESC=x.q, DO_DESC=x.grad_out, K_DESC=x.k, V_DESC=x.v, DQ_DESC=x.dq,
                      Q_DESC_B=x.q, K_DESC_B=x.k, DQ_DESC_B=x.dq)
    if not spec.ds_dq:  # delta in the workspace's unused pointer slots
        values["DS"] = values["DS_STORE"] = values["DS_LOAD"] = delta
        return values
    # the workspace of block slots: its bands follow the tables' contents (memoized on them)
    B, Hq, L, _ = x.q.shape
    S = x.k.shape[2]
    band, slots = ds_workspace.bands_of(call.block_mask, L, S, spec.sparse_q, spec.sparse_kv,
                                        x.q.device)
    ds_rows = B * Hq * slots * spec.sparse_kv
    ds = torch.empty(ds_rows * spec.sparse_q, dtype=x.q.dtype, device=x.q.device)
    values.update({"DS": ds, "DS_BAND": band, "MAX_SLOTS": slots,
                   **binding.strides("band_", "bhn", broadcast_strides(band)[:3])})
    # the workspace as dK/dV stores its tiles and as dQ loads them (descriptors of two block
    # shapes with TMA, else the pointer): DS_DESC of each kernel, set per step by ``run``
    values["DS_STORE"] = values["DS_LOAD"] = ds
    if geometry_ is not None:
        view = ([ds_rows, spec.sparse_q], [spec.sparse_q, 1])
        values["DS_STORE"] = kind(ds, *view, [spec.block_n1, spec.block_m1])
        values["DS_LOAD"] = kind(ds, *view, [spec.block_n2, spec.block_m2])
    return values


def step_args(plan, call: AttentionCall, x: Inputs) -> list[list]:
    """Each step's bound arguments, in launch order (what ``Backward.run`` launches)."""
    values = call_values(plan, call, x)
    args = []
    for i, step in enumerate(plan.steps):
        values["DS_DESC"] = values["DS_STORE" if i == 1 else "DS_LOAD"]
        args.append(step.binder.bind(values))
    return args


class Backward(KernelFamily):
    name = "triton_bwd"
    direction = "backward"
    features = frozenset({"sinks", "dropout"})

    def first_call(self, key, target: Target, call, x: Inputs, fusable: bool, need_dkdv: bool):
        # the plan is kept under the call's own key; with the full walk it runs the call under
        # the full mask (``run``), the same mask for every call of this key (L, S, device).
        # A dO that fails the descriptors' layout check where q, k, v pass it is copied to a
        # dense one, every call of the key (``run``): the key holds dO's strides
        dense = dense_grad_out(call, target, x)
        if dense:
            x = dataclasses.replace(x, grad_out=x.grad_out.contiguous())
        walk = full_walk_mask(x.q.shape[2], x.k.shape[2], x.q.device) if full_walk(
            call, target, x.q, x.k, x.v, x.grad_out) else None
        inner = call if walk is None else with_block_mask(call, walk)
        joint = joint_graph(inner.score)
        config = self.choose_config(inner, x, joint, fusable, target)
        spec = backward_spec(x.q, x.k, x.v, inner, has_dlse=x.grad_lse is not None,
                             target=target, grad_out=x.grad_out, fusable=fusable, config=config)
        plan = self.make_plan(spec, inner, x, joint)
        plan.fixed["walk"] = walk
        plan.fixed["dense_grad_out"] = dense
        plan.depends = plans.q_tables_depends(inner.block_mask)
        plans.keep_backward(call, key, plan)
        return self.run(plan, call, x, fusable, need_dkdv)

    def make_plan(self, spec, call, x: Inputs, joint) -> plans.Plan:
        loaded = generated_module(backward_kernel, spec, joint, call.score, call.mask)
        return plans.Plan(self, spec, make_steps(spec, loaded, x, call, joint),
                          {"geometry": descriptor_geometry(spec, x)})

    def run(self, plan, call, x: Inputs, fusable: bool, need_dkdv: bool):
        walk = plan.fixed.get("walk")
        if walk is not None:  # the plan's tables are its full mask's (``full_walk``)
            call = with_block_mask(call, walk)
        if plan.fixed.get("dense_grad_out"):  # (``first_call``)
            x = dataclasses.replace(x, grad_out=x.grad_out.contiguous())
        for i, (step, args) in enumerate(zip(plan.steps, step_args(plan, call, x))):
            if i != 1 or need_dkdv:  # the dK/dV kernel is always the second
                step.launch(args, x.q.device)

    def choose_config(self, call, x: Inputs, joint, fusable: bool, target: Target):
        """The tiles tuned per (target, head dims, dtype, mask density class, short/long kv
        length) on sm_90, stored like the forward's (``autotune``); None (the defaults) when
        not tuning: other GPUs, tiles pinned through kernel_options, FLEXFA_AUTOTUNE=0,
        little work, head dims past 128 without tensor descriptors (one default), or captured
        tensors needing gradients (their atomics would add up over the timed runs)."""
        q, k, v = x.q, x.k, x.v
        e_pad, ev_pad = next_power_of_two(q.shape[3]), next_power_of_two(v.shape[3])
        work = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
        ragged = ragged_lengths(q, k)
        wide = wide_head_dims(q.shape[3], v.shape[3])
        candidates = hopper_candidates(e_pad, ev_pad, ragged_default(q, k, v, call))
        if (not target.is_sm90 or q.dtype == torch.float32
                or (wide and not use_tma(call, target, q, k, v, x.grad_out))
                or call.options.bwd.pins_tiles or not autotune.enabled()
                or work < autotune.MIN_TUNED_WORK or len(candidates) < 2
                or has_buffer_grads(joint)):
            return None
        # dropout's Philox makes a different kernel: its own winners; so do ragged lengths
        # past 128, whose default differs, and Q, K in column blocks (192 is not 256)
        family = "bwd_dropout" if call.dropout else "bwd"
        family += "_ragged" if ragged and wide else ""
        family += "_split" if split_head_dim(q.shape[3], target) else ""
        key = autotune.tune_key(family, autotune.device_tag(target, q.device),
                                max(e_pad, ev_pad), ev_pad,
                                DTYPE_NAMES[q.dtype], density_class(call.block_mask),
                                k.shape[2])

        def time_config(config) -> float:  # only called when no stored winner fits
            # a dense upstream gradient, as most calls get it (``out.sum()`` gives a broadcast
            # one, which would time the pointer loads instead of the descriptors)
            timed = dataclasses.replace(x, grad_out=x.grad_out.contiguous(), grads={},
                                        dq=torch.empty_like(q), dk=torch.empty_like(k),
                                        dv=torch.empty_like(v))
            spec = backward_spec(q, k, v, call, has_dlse=x.grad_lse is not None, target=target,
                                 grad_out=timed.grad_out, fusable=fusable, config=config)
            plan = self.make_plan(spec, call, timed, joint)
            return autotune.time_ms(lambda: self.run(plan, call, timed, fusable, True),
                                    q.device)
        return autotune.tune(key, candidates, time_config, _label)


def _label(config) -> str:
    m1, n1, m2, n2, warps, stages, *dq = config
    return f"{m1}x{n1}/{m2}x{n2} w{warps} s{stages}" + (" dq w{} s{}".format(*dq) if dq else "")


BACKWARD = register(Backward())
