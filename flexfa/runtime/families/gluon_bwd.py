"""The Gluon backward family: ``bwd_gluon.tmpl`` (FlashAttention-3's backward on sm_90: one
program per 128 keys, two consumer warpgroups of 64 keys holding dK and dV, a TMA producer
warp walking the block mask's transposed tables, a dQ-writer warp adding each tile's fp32 dQ
partial into an accumulator with TMA reduce-adds); at head dims padding to 256
``bwd_gluon_wide.tmpl`` (64 keys a program, both consumers on them, dK / dV / dQ split along
E, dQ by atomic adds; v's head dim 128 allowed there, E = 192 with Ev = 128; by default at
E = Ev = 256 only), between the row kernels of
``bwd_gluon_rows.tmpl`` (lse2 and delta rows before, dQ's scale and cast after).

By default (``GLUON_BACKWARD`` 'AUTO') it runs where it measured faster than the Triton
backward on the H200 (``AUTO_CLASSES``; sparse masks where a program's walk is long and
the call large, ``SPARSE_WALK_ROWS``, ``SPARSE_MIN_TILES``), under ``GLUON_BACKWARD=True``
wherever it applies (whatever family ran the forward: it reads out and lse only); elsewhere
the Triton backward runs (``deterministic=True``, other head dims..., captured-tensor
gradients under 'AUTO'). Dropout draws the forward's keep mask again in the consumers
(both templates' DROPOUT); attention sinks need nothing of the kernel (lse holds them) and
take their gradient from lse and delta after it; captured tensors that want gradients
(learnable biases) get them under ``GLUON_BACKWARD=True`` from the wide kernel's consumer
tiles by atomic adds into fp32 accumulators (its HAS_BUFFER_GRADS; ``why_not_gluon_bwd``
says what else).
Memory past the inputs and gradients: the fp32 dQ accumulator of a part of the heads (about
a quarter: ``DQ_CHUNKS``); the two fp32 rows per query the kernel reads (lse2, delta) live in
dQ's own memory until the postprocess writes dQ there (``row_buffers``); nothing of size
L x S.
"""
from __future__ import annotations

import contextlib

import torch

from ...blockmask.density import density_class, visited_share
from ...codegen.backward import dscore_is_one, has_buffer_grads
from ...codegen.gluon import trims_columns
from ...codegen.gluon_bwd import (BLOCK_M, BLOCK_N, BLOCK_N_WIDE, POST, PRE, WIDE_HEAD_DIM, ZERO,
                                  GluonBackwardSpec, RowsSpec, descriptor_blocks,
                                  descriptor_layouts, gluon_bwd_kernel, rows_kernel)
from ...codegen.spec import DTYPE_NAMES, next_power_of_two
from ...errors import InputError
from .. import binding, plans
from ..autotune import SHORT_KV
from ..kernels import generated_module
from ..launch import MAX_GRID_Y, Step, cdiv
from ..registry import KernelFamily, register
from ..tables import has_full_blocks, mask_blocks
from ..target import Target
from .backward import Inputs, full_walk, int64_nodes_of, joint_graph
from .gluon import (SHARED_BYTES, descriptor_kinds, gluon_target, import_gluon,
                    why_not_gluon)
from .hopper import block_geometry, descriptor_layout_ok

# the Q/dO ring per padded head dim: 3 stages at E = 128 fill 226 KB of 227 (fwd+bwd 0.96x
# the time of 2 at S = 16384 full, 0.99x causal in bqb_02d71cb; mixed within 5% in
# bqb_339562a)
DEFAULT_STAGES = {64: 3, 128: 3, 256: 2}
# the head dims it takes pad to these (96 and 80 run at 128: TMA's zero fill past E on the
# loads, the stores and the dQ reduce-adds cut at E); 256 (and 192, 160) runs
# bwd_gluon_wide.tmpl's kernel ('AUTO' takes it at 256 only: auto_head_dim)
HEAD_DIMS = tuple(DEFAULT_STAGES)
# padded (E, Ev): v's head dim is q's, or 128 under E = 256 (bwd_gluon_wide.tmpl: DeepSeek's
# MLA, E = 192 with Ev = 128)
HEAD_DIM_PAIRS = frozenset({(e, e) for e in HEAD_DIMS} | {(WIDE_HEAD_DIM, 128)})


def keys_per_program(head_dim: int) -> int:
    """BLOCK_N: the keys of one program (64 where both consumers share them at 256)."""
    return BLOCK_N_WIDE if next_power_of_two(head_dim) == WIDE_HEAD_DIM else BLOCK_N


def shared_bytes(head_dim: int, stages: int, head_dim_v: int | None = None) -> int:
    """bwd_gluon.tmpl's shared memory (16-bit inputs) at ``head_dim`` padded to a power of
    two: the Q/dO ring with its lse2 and delta rows, K and V of the program's keys, two pairs
    of dS^T tiles, the consumers' fp32 dQ columns, and 1 KB for the barriers and the ring's
    tile codes (the sm_90 compiles: 193.6 KB at E = 128, 2 stages); bwd_gluon_wide.tmpl's
    at 256 (``head_dim_v``: v's, default q's)."""
    head_dim = next_power_of_two(head_dim)
    ev = next_power_of_two(head_dim_v or head_dim)
    if head_dim == WIDE_HEAD_DIM:  # K, V of 64 keys, P^T and dS^T; dQ by atomics
        ring = stages * (BLOCK_M * (head_dim + ev) * 2 + 2 * BLOCK_M * 4)
        return (ring + BLOCK_N_WIDE * (head_dim + ev) * 2 + 2 * BLOCK_N_WIDE * BLOCK_M * 2
                + 1024)
    ring = stages * (2 * BLOCK_M * head_dim * 2 + 2 * BLOCK_M * 4)
    keys = 2 * BLOCK_N * head_dim * 2
    ds = 2 * BLOCK_N * BLOCK_M * 2
    dq = BLOCK_M * head_dim * 4
    return ring + keys + ds + dq + 1024


def ring_stages(call, head_dim: int, head_dim_v: int | None = None) -> int:
    """The Q/dO ring depth: kernel_options GLUON_BWD_STAGES, else the default per head dim;
    a depth whose buffers do not fit sm_90's shared memory fails here, by name."""
    stages = call.options.gluon_bwd_stages or DEFAULT_STAGES[next_power_of_two(head_dim)]
    need = shared_bytes(head_dim, stages, head_dim_v)
    if need > SHARED_BYTES:
        fits = [n for n in (2, 3, 4) if shared_bytes(head_dim, n, head_dim_v) <= SHARED_BYTES]
        raise InputError(f"kernel_options GLUON_BWD_STAGES={stages}: the Gluon backward at "
                         f"head dim {head_dim} needs {need} bytes of shared memory for it, "
                         f"more than sm_90's {SHARED_BYTES}; stages that fit: {fits}")
    return stages


# rows per program of the row kernels (ROWS_WARPS warps): the postprocess reads 32 fp32 of
# dQ's accumulator per thread at 32 rows (38 registers on sm_90, 70 at 64 rows, compiled as
# launched: more programs a SM to keep loads in flight; not timed apart on a GPU: its GPU
# tests pass on the H200, t28_bf48edf)
ROWS_BLOCK = {PRE: 64, POST: 32, ZERO: 64}
ROWS_WARPS = 4
# the fp32 dQ accumulator holds at most 1 / DQ_CHUNKS of the (batch, kv head) pairs: the
# kernel and the postprocess run once per part (kernel_options GLUON_BWD_DQ_CHUNKS; 1: all
# at once). At 4 the accumulator is half of dQ's bf16 bytes: fwd+bwd peak extra memory
# at S = 16384, H = 16, E = 128 measured 291 MiB against FlexAttention's 258 (1.13x; the
# whole accumulator, 128 MiB, made it 387, 1.5x; bqb_339562a)
DQ_CHUNKS = 4


def dq_parts(B: int, Hkv: int, chunks: int, slots: int = 1
             ) -> tuple[tuple[int, int], list[tuple]]:
    """((batches, kv heads) of one accumulator slot, [(first batch, first kv head, batches,
    kv heads) of each part]) for about ``chunks`` parts of the B x Hkv pairs, one batch's kv
    heads in runs or runs of whole batches; with ``slots`` slots, the accumulator's
    ceil(B * Hkv / chunks) pairs are shared out between them (parts of 1 / slots the size,
    slots many times as many; never fewer than one pair a slot)."""
    pairs = B * Hkv
    per = max(1, -(-pairs // max(1, min(chunks, pairs))) // max(1, slots))
    if per <= Hkv:
        return (1, per), [(b, h, 1, min(per, Hkv - h)) for b in range(B)
                          for h in range(0, Hkv, per)]
    nb = per // Hkv
    return (nb, Hkv), [(b, 0, min(nb, B - b), Hkv) for b in range(0, B, nb)]


def dq_slots(B: int, Hkv: int, chunks: int, overlap: bool) -> int:
    """Accumulator slots: 2 (a part's kernel runs on one stream while the part before it
    finishes on the other, each into its own slot) where the accumulator runs in parts and
    holds two pairs or more, else 1 (the parts one after another)."""
    pairs = B * Hkv
    per = -(-pairs // max(1, min(chunks, pairs)))
    return 2 if overlap and 2 <= per < pairs else 1


# (density class, both lengths past runtime.autotune.SHORT_KV) where GLUON_BACKWARD='AUTO'
# takes this family: fwd+bwd on the H200 at E = 128, S = 16384 (bqb_339562a, 2 rounds, with
# the default 3 stages and a quarter of the accumulator at a time), against the Triton
# backward: full 0.86x its time, causal 0.86x, softcap 0.81x, ALiBi 0.81x, prefix 0.88x;
# E = 64 full 0.89x, causal 0.88x; S = 65536 causal (H = 8) 0.83x. Shorter lengths were not
# measured.
AUTO_CLASSES = frozenset({"dense", "masked"})
# sparse masks too where a program's walk is long: the visited share times L (the mean
# query rows a 128-key program walks) at least this. sparse_bwd.py on the H200 (E = 128,
# S = 16384, 2 rounds, fwd+bwd, Gluon / Triton backward, with the host's launches of the
# parts cut, 11cb355): causal sliding windows of 256 (377 rows) 1.60x the time, 1024 (1114)
# 0.92x, 2048 (2048) 0.87x; causal documents of 256-2048 tokens (the benchmark's; 884 rows)
# 1.02x, of 576-4032 (1376) 0.96x. Programs with short walks pay their prologue, epilogue
# and the parts' launches on too little work. At E = 64 the Triton backward was faster on
# every such mask but a causal window of 2048 (0.97x; sp_f8a67d8: windows of 512 and 1024
# 1.47x and 1.22x, the benchmark's documents 1.51x): E = 64 keeps sparse masks on the Triton
# backward. And only calls of as much work as those (16 heads of 16384
# tokens visiting 7-13% of the tiles: at least SPARSE_MIN_TILES 128 x 128 tiles over the
# batch and heads): a smaller call's step waits on the host's launches of the parts
# (experiments/gluon_bwd_host.py: 0.98 ms of host time a step against 0.66 on the Triton
# backward).
# with dropout (the consumers draw the keep mask once, where the Triton backward draws it
# in both its kernels): 'AUTO' takes calls whose L and S are at least this, by padded head
# dim. fwd+bwd with p = 0.1 on the H200 against the Triton backward (dropout_ab.py, 2
# rounds, gpu_2026-12-03/gbd_094b28e): E = 128 causal 1.05x the time at S = 1024 (B = 16),
# 0.95x at 2048, 0.85x at 4096, 0.83x at 8192; dense 0.86x at 2048, 0.82-0.84x at 4096 and
# 8192; E = 64 causal 1.07x at 2048, 0.97x at 4096, 0.95x at 8192, dense 1.06x at 1024.
# Keyed by the padded (E, Ev) pair. The wide kernel (options_ab.py, 3 rounds,
# gpu_2026-12-05/we_001b317): 256 causal 0.79x at 8192 and 0.80x at 4096, dense 0.81x at
# 2048; 192 / 128 causal 0.90x at 8192 (it is taken with dropout alone: without, the Triton
# backward was faster at 192 / 128). Thirtieth session, shorter lengths on an H100
# (options_ab.py, 3 rounds, gpu_2026-12-05/dr_32693bf): 256 causal 0.92x at 1024 and 1.04x
# at 512, dense 0.94x at 1024; 192 / 128 causal 0.91x at 4096 and 0.96x at 2048, dense
# 0.88x at 4096
DROPOUT_MIN_LENGTH = {(64, 64): 4096, (128, 128): 2048, (256, 256): 1024, (256, 128): 2048}
# (of the pairs padding to 256 / 128 'AUTO' takes 192 / 128 alone: why_not_gluon_bwd)
# without a block mask the wide kernel from this length (not past SHORT_KV only): dense
# fwd+bwd at E = 256 0.94x the Triton backward's time at 4096 and 0.96x at 2048 (we_001b317;
# causal there 1.03x and 1.10x: masked calls keep SHORT_KV)
WIDE_DENSE_MIN_LENGTH = 2048
# and at lengths that are not multiples of 128 from this one, where the Triton backward runs
# its bounds-checked 4-warp 32-key dK/dV programs: dense at S = 1000 0.92x its time (at the
# tile multiples 1024 and 512 1.10x and 1.15x; dr_32693bf, H100; only 1000 measured ragged)
WIDE_DENSE_RAGGED_MIN_LENGTH = 1000
# at E = 192 / Ev = 128 without dropout the wide kernel where L or S is not a multiple of
# this: there the Triton backward's dK/dV runs its bounds-checked 32-key programs, and the
# Gluon backward took 0.98x its time causal and 0.95x dense at S = 8100 (at 8192 1.09x and
# 1.04x: tile multiples stay on the Triton backward; we_001b317)
MLA_RAGGED = 128
SPARSE_WALK_ROWS = 1024
# (at 256 sliding windows of 1024 and the benchmark's documents at S = 16384 took 1.11x and
# 1.07x the Triton backward's time, we_001b317: sparse masks stay there)
SPARSE_HEAD_DIMS = (128,)
SPARSE_MIN_TILES = 16384


def auto_head_dim(E: int, Ev: int) -> bool:
    """The head dims GLUON_BACKWARD='AUTO' takes (v's alike): 64, and 80 to 128, which all run its
    E = 128 kernel (TMA's zero fill past E; faster than the Triton backward where measured, at
    96 and 80: docs/gluon.md, "Padded head dims in the backward"), and 256
    (bwd_gluon_wide.tmpl). fwd+bwd on the H200 against the Triton backward
    (benchmarks/results/gpu_2026-12-05): at 256 the time of dense 0.87x at S = 16384, 0.90x at
    8192, 0.73x at 8100; softcap + causal 0.97x and ALiBi + causal 0.93x at 16384; causal 1.00x
    at 16384, 1.01-1.02x at 8192, 0.96x at 8100 (peak memory 577 MiB against 514: dQ's float32
    accumulator); the masked classes at 256 have gone back to the Triton backward since its
    dK/dV split dP^T between the warpgroups (why_not_gluon_bwd). E = 192 with Ev = 128 keeps the
    Triton backward (the wide kernel with E padded to 256 took 1.14x the time causal, 1.08x
    dense at 8192; 1.01x and 0.98x at 8100; with its 192-column layout (we_001b317, 3 rounds)
    1.09x causal, 1.04x dense, 1.03x softcap at 8192, 0.98x causal and 0.95x dense at 8100),
    except with dropout (why_not_gluon_bwd, DROPOUT_MIN_LENGTH); others (48, 160, 192 and 256 /
    128 without dropout, not measured) opt in with GLUON_BACKWARD=True."""
    return E == Ev and (E == 64 or 80 <= E <= 128 or E == WIDE_HEAD_DIM)


def why_not_gluon_bwd(target: Target, call, q, k, v) -> str | None:
    """Why the Gluon backward does not run this call (None: it does)."""
    choice = call.options.gluon_backward
    if choice is False:
        return "kernel_options GLUON_BACKWARD=False"
    block_n = keys_per_program(q.shape[3])
    reason = why_not_gluon(target, call, q, k, v, (BLOCK_M, block_n), HEAD_DIM_PAIRS)
    if reason is not None:
        return reason
    if block_n != BLOCK_N_WIDE and q.shape[3] != v.shape[3]:
        return (f"it needs v's head dim to be q's below E = 256 (bwd_gluon.tmpl), not "
                f"E={q.shape[3]}, Ev={v.shape[3]}")
    if choice is None:
        L, S, E, Ev = q.shape[2], k.shape[2], q.shape[3], v.shape[3]
        pair = (next_power_of_two(E), next_power_of_two(Ev))
        found = density_class(call.block_mask)
        # DeepSeek's MLA shape, E = 192 / Ev = 128 (the one measured of the pairs padding to
        # 256 / 128), with dropout (DROPOUT_MIN_LENGTH) or at a length that is not a multiple
        # of 128 (MLA_RAGGED)
        ragged = L % MLA_RAGGED or S % MLA_RAGGED
        if not (auto_head_dim(E, Ev) or ((E, Ev) == (192, 128)
                                         and (call.dropout is not None or ragged))):
            return (f"GLUON_BACKWARD='AUTO' takes head dims 64, 80 to 128 and 256, v's "
                    f"alike, and E = 192 with Ev = 128 with dropout or at lengths that are "
                    f"not multiples of {MLA_RAGGED} (measured faster there), not E={E}, "
                    f"Ev={Ev}, L={L}, S={S}")
        # at 256 under a block mask without dropout the Triton backward, whose one-loop dK/dV tiles
        # give S^T's and dP^T's GEMMs half the columns each warpgroup (bwd_dkdv.tmpl's ONE_LOOP,
        # since the thirtieth session) and took 0.81-0.90x the Gluon backward's time fwd+bwd on an
        # H100 (tree_ab.py, 3 rounds, gpu_2026-12-05/sp_0d1195a): causal 0.83x at 8192 and 16384,
        # 0.90x at 8100, GQA 4 0.82x at 8192, softcap + causal 0.87x, ALiBi + causal 0.83x, prefix
        # 0.81x at 16384; without a block mask the same through the full-block walk
        # (BWD_FULL_WALK 'AUTO', the default; backward.full_walk: 0.88-0.93x the Gluon
        # backward's time at 1000-8192 on an H200, wn_b990bbf), where the unmasked walk's tiles
        # were slower than the Gluon backward from 2048 (below, with the walk off)
        # (q stands for dO, which the choice does not see: the Triton backward copies a dO
        # that fails the descriptors' layout check where q, k, v pass it, backward.dense_grad_out)
        if pair == (WIDE_HEAD_DIM, WIDE_HEAD_DIM) and call.dropout is None and (
                call.block_mask is not None or full_walk(call, target, q, k, v, q)):
            return ("GLUON_BACKWARD='AUTO' leaves head dim 256 without dropout to the Triton "
                    "backward (under a block mask, or without one through the full-block walk "
                    "of BWD_FULL_WALK; measured faster there)")
        # with dropout under a block mask too, since the one loop draws the keep mask (the
        # thirty-third session): 0.86-0.98x the Gluon backward's time fwd+bwd on an H100
        # (tree_ab.py, 2-3 rounds, gpu_2026-12-06/wb_38feb86): causal 512 0.86x, 1024 0.91x,
        # 2048 0.92x, 4096 0.96x, softcap + causal 4096 0.98x, GQA 4 causal 8192 0.95x, the
        # benchmark's documents at 16384 0.92x
        if pair == (WIDE_HEAD_DIM, WIDE_HEAD_DIM) and call.dropout is not None \
                and call.block_mask is not None:
            return ("GLUON_BACKWARD='AUTO' leaves head dim 256 with dropout under a block mask "
                    "to the Triton backward (its one-loop dK/dV draws the keep mask; measured "
                    "faster there)")
        if call.dropout is not None:
            need = DROPOUT_MIN_LENGTH.get(pair)
            if pair == (WIDE_HEAD_DIM, WIDE_HEAD_DIM) and ragged:
                # without a mask at ragged lengths from 1000, as without dropout: 0.78x the
                # Triton backward's time dense at S = 1000 (wb_38feb86, H100)
                need = min(need, WIDE_DENSE_RAGGED_MIN_LENGTH)
            if need is None:
                return (f"GLUON_BACKWARD='AUTO' takes dropout at padded head dims (E, Ev) "
                        f"{sorted(DROPOUT_MIN_LENGTH)} (measured there), not {pair}")
            if min(L, S) < need:
                return (f"GLUON_BACKWARD='AUTO' takes dropout at head dim {E} for L "
                        f"and S of at least {need} (measured faster there), not L={L}, S={S}")
        elif min(L, S) <= SHORT_KV and not (
                pair == (WIDE_HEAD_DIM, WIDE_HEAD_DIM) and found == "dense"
                and min(L, S) >= (WIDE_DENSE_RAGGED_MIN_LENGTH if ragged
                                  else WIDE_DENSE_MIN_LENGTH)):
            return (f"GLUON_BACKWARD='AUTO' takes it for L and S past {SHORT_KV} (at E = 256 "
                    f"without a block mask from {WIDE_DENSE_MIN_LENGTH}, or from "
                    f"{WIDE_DENSE_RAGGED_MIN_LENGTH} at lengths that are not multiples of "
                    f"{MLA_RAGGED}; measured there), not L={L}, S={S}")
        if found not in AUTO_CLASSES:
            if E not in SPARSE_HEAD_DIMS:
                return (f"GLUON_BACKWARD='AUTO' takes sparse block masks at head dims "
                        f"{SPARSE_HEAD_DIMS} (measured there), not {q.shape[3]}")
            # (a sparse class implies a known share: a capture without it reads "masked")
            share = visited_share(call.block_mask)
            rows = share * L
            if rows < SPARSE_WALK_ROWS:
                return (f"GLUON_BACKWARD='AUTO' takes sparse block masks where a program "
                        f"walks {SPARSE_WALK_ROWS} query rows or more on average (measured "
                        f"faster there), not {rows:.0f}")
            tiles = share * q.shape[0] * q.shape[1] * L * S / (128 * 128)
            if tiles < SPARSE_MIN_TILES:
                return (f"GLUON_BACKWARD='AUTO' takes sparse block masks of at least "
                        f"{SPARSE_MIN_TILES} visited 128 x 128 tiles over the batch and heads "
                        f"(measured there), not {tiles:.0f}")
    if cdiv(k.shape[2], block_n) > MAX_GRID_Y:
        return (f"S={k.shape[2]}: the Gluon backward's {cdiv(k.shape[2], block_n)} kv blocks "
                f"of {block_n} keys exceed a grid's {MAX_GRID_Y} on its y axis")
    joint = joint_graph(call.score)
    if has_buffer_grads(joint):
        if choice is None:
            return ("GLUON_BACKWARD='AUTO' leaves captured-tensor gradients (learnable "
                    "biases) to the Triton backward (measured faster: the Gluon backward "
                    "took 1.03-1.43x its time on an H100; GLUON_BACKWARD=True takes them at "
                    "head dims padding to 256)")
        if block_n != BLOCK_N_WIDE:
            return ("captured-tensor gradients run on the Triton backward below E = 256: "
                    "with them the Gluon kernel's shared memory passes sm_90's (233096 of "
                    "232448 bytes on the H200)")
    options = call.options
    if options.deterministic:
        return "deterministic=True runs on the Triton backward (the dQ reduce-adds' order " \
               "varies)"
    if options.ds_workspace:
        return "the dS workspace (DS_WORKSPACE=True) is the Triton backward's"
    if options.bwd.pins_tiles:
        return "kernel_options pin backward tiles (the Triton backward's)"
    return None


def gluon_bwd_spec(q, k, call, target: Target, head_dim_v: int | None = None
                   ) -> GluonBackwardSpec:
    """The spec of a call (``head_dim_v``: v's head dim, default q's)."""
    L, E, S = q.shape[2], q.shape[3], k.shape[2]
    Ev = head_dim_v or E
    mask = call.block_mask
    block_n = keys_per_program(E)
    wide = block_n == BLOCK_N_WIDE
    sparse_q, sparse_kv = mask_blocks(mask)
    if mask is None:
        sparse_q, sparse_kv = BLOCK_M, block_n
    return GluonBackwardSpec(
        dtype=DTYPE_NAMES[q.dtype], head_dim=E, stages=ring_stages(call, E, Ev),
        has_block_mask=mask is not None, has_full_blocks=has_full_blocks(mask, "q"),
        sparse_q=sparse_q, sparse_kv=sparse_kv, even_l=L % sparse_q == 0,
        even_s=S % block_n == 0, gqa_group=call.gqa_group, target=target.name,
        wide_ints=int64_nodes_of(q, k, call), dropout=call.dropout is not None,
        block_n=block_n, head_dim_v=0 if Ev == E else Ev,
        # EARLY_DP's dP^T starts from -delta, which dropout's dS^T cannot use; the E = 256
        # kernel has no such option (its dP is issued after the mods)
        early_dp=call.options.gluon_bwd_early_dp and call.dropout is None and not wide,
        # S^T and dP^T over E's 32-column slices (the E <= 128 kernel; the wide one runs Q K^T
        # over E's 32-column slices always); 'AUTO' (None) trims: measured 0.95-1.01x the
        # padded kernel's fwd+bwd time at 80 and 96 (an H100, gpu_2026-12-05/wj_2c4a86f)
        qk_trim=call.options.gluon_bwd_qk_trim is not False and not wide and trims_columns(E))


@contextlib.contextmanager
def part_streams(device: torch.device, slots: int):
    """[the current stream] for one slot; for two, also a side stream that starts after
    everything queued so far and that the current stream waits for on the way out (a fork
    and join, which CUDA graph capture records too). None off CUDA devices."""
    if slots == 1 or device.type != "cuda":
        yield [None] * slots
        return
    main = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(main)
    try:
        yield [main, side]
    finally:
        main.wait_stream(side)


def padded_rows(L: int, spec: GluonBackwardSpec) -> int:
    """L_PAD: L rounded up to the walked q block (every walked tile inside its head's rows)."""
    return cdiv(L, spec.sparse_q) * spec.sparse_q


def row_steps(spec: RowsSpec, x: Inputs, l_pad: int, acc_heads: int | None = None
              ) -> tuple[Step, Step]:
    """The preprocess and postprocess launches of ``x``'s layout (bwd_gluon_rows.tmpl);
    ``acc_heads``: the dQ accumulator's heads per batch (HQ_CHUNK; all of them by default)."""
    rows = generated_module(rows_kernel, spec)
    B, Hq, L, _ = x.q.shape
    block = {name: 16 if spec.interpret else rows for name, rows in ROWS_BLOCK.items()}
    lengths = {"HQ": Hq, "L": L, "L_PAD": l_pad}
    launch = {"num_warps": ROWS_WARPS}
    pre = Step(rows.kernel(PRE), (cdiv(l_pad, block[PRE]), B * Hq), spec.constexprs(block[PRE]),
               launch, binding.Binder(rows.names(PRE), {
                   **lengths, **binding.strides("o", "bhmd", x.out.stride()),
                   **binding.strides("g", "bhmd", x.grad_out.stride())}))
    post = Step(rows.kernel(POST), (cdiv(L, block[POST]), Hq, B),
                spec.constexprs(block[POST]), launch, binding.Binder(rows.names(POST), {
                    "L": L, "L_PAD": l_pad, "HQ_CHUNK": acc_heads or Hq,
                    **binding.strides("dq", "bhmd", x.dq.stride())}))
    return pre, post


def zero_step(spec: RowsSpec, acc_rows: int) -> Step:
    """The launch zeroing an accumulator slot's ``acc_rows`` rows (bwd_gluon_rows.tmpl)."""
    rows = generated_module(rows_kernel, spec)
    block = 16 if spec.interpret else ROWS_BLOCK[ZERO]
    return Step(rows.kernel(ZERO), (cdiv(acc_rows, block),), spec.constexprs(block),
                {"num_warps": ROWS_WARPS}, binding.Binder(rows.names(ZERO), {"ROWS": acc_rows}))


def kernel_grid(S: int, kv_heads: int, batches: int, block_n: int = BLOCK_N
                ) -> tuple[int, int, int]:
    """The Gluon backward's grid over ``kv_heads`` kv heads of ``batches`` batches: (kv
    heads, kv blocks of BLOCK_N keys, batches), read as program ids by bwd_gluon.tmpl. The
    heads are on the fast axis, so a launch starts every head's kv block 0 (under causal-like
    masks the longest walk) first, then every head's block 1, and so on: with the heads on
    the slow axis a part's second head started its long programs only after the first head's
    short ones, which the part on the other stream waits behind (a dispatch model of causal
    GQA 4, B = 2, Hkv = 8, S = 8192 in eight parts on two streams: 18% over the ideal
    against 1.5%; 0.9% against 0.2% at B = 1, H = 16, S = 16384; experiments/
    grid_order_model.py). On the H200 that GQA case's fwd+bwd took 0.94x the time, the
    other unchanged (grid_f8a67d8)."""
    return kv_heads, cdiv(S, block_n), batches


def row_buffers(x: Inputs, l_pad: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(lse2, delta, in dQ): [B * Hq, l_pad] float32 views with a common row stride (each
    row 16-byte aligned, as TMA reads them). Where they fit, in the memory of dQ itself: the
    bytes of head bh's dQ rows hold lse2's then delta's row bh, which only the kernel of the
    part holding head bh reads, before that part's postprocess writes dQ there (on the same
    stream; another part reads other heads' rows). That is two fp32 rows per query less
    memory (issue 26's rule at causal GQA 4, B = 2, Hq = 32, S = 8192: 390 MiB against
    FlexAttention's 324 with their own buffer, 1.204x). dQ is always a fresh contiguous
    tensor here (runtime.backward); else, or where the caller wants delta afterwards, or the
    rows do not fit, one buffer of their own."""
    B, Hq, L, E = x.q.shape
    dq, rows = x.dq, None
    if (x.delta is None and dq is not None and dq.is_contiguous() and dq.element_size() == 2
            and dq.data_ptr() % 16 == 0 and (L * E) % 8 == 0 and 4 * l_pad <= L * E):
        rows = dq.view(-1).view(torch.float32).view(B * Hq, L * E // 2)
    in_dq = rows is not None
    if not in_dq:
        rows = torch.empty(B * Hq, 2 * l_pad, dtype=torch.float32, device=x.q.device)
    return rows[:, :l_pad], rows[:, l_pad:2 * l_pad], in_dq


def run_pre(pre: Step, x: Inputs, l_pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(lse2, delta) as [B * Hq, l_pad] float32 rows (``row_buffers``): lse * log2(e) (+inf
    for empty and padding rows) and rowsum(dO * O) - dlse (0 on padding rows)."""
    lse2, delta, _ = row_buffers(x, l_pad)
    dlse = x.grad_lse.float().contiguous() if x.grad_lse is not None else lse2
    pre.launch_with({"OUT": x.out, "DOUT": x.grad_out, "LSE": x.lse.contiguous(),
                     "DLSE": dlse, "LSE2": lse2, "DELTA": delta, "ROW_STRIDE": lse2.stride(0)},
                    x.q.device)
    return lse2, delta


def run_post(post: Step, dq_acc: torch.Tensor, x: Inputs, scale: float,
             part: tuple[int, int, int, int] | None = None) -> None:
    """x.dq = scale * the float32 accumulator's rows, in dq's dtype, for ``part`` (first
    batch, first query head, batches, query heads; by default all of them): the accumulator
    holds that part as [batches, HQ_CHUNK, l_pad, E] rows."""
    b0, h0, nb, nh = part or (0, 0, x.q.shape[0], x.q.shape[1])
    post.launch(post_args(post, dq_acc, x, scale, b0, h0), x.q.device, (post.grid[0], nh, nb))


def post_args(post: Step, dq_acc: torch.Tensor, x: Inputs, scale: float, b0: int = 0,
              h0: int = 0) -> list:
    """The postprocess's arguments for the accumulator ``dq_acc`` and a part from batch b0,
    query head h0."""
    return post.binder.bind({"DQ_ACC": dq_acc, "DQ": x.dq, "sm_scale": float(scale),
                             "B0": b0, "H0": h0})


class GluonBackward(KernelFamily):
    name = "gluon_bwd"  # not a BACKEND value: GLUON_BACKWARD=True opts in, Triton the fallback
    direction = "backward"
    priority = 10  # before triton_bwd (0) where it applies
    # dropout: the keep mask drawn again (bwd_gluon.tmpl's DROPOUT); sinks: nothing in the
    # kernel (the forward's lse holds each row's sink, so P is the keys' share alone), their
    # gradient from lse and delta after it (runtime.backward.sinks_grad; row_buffers then
    # keeps delta apart from dQ's memory)
    features = frozenset({"dropout", "sinks"})

    def why_not(self, target: Target, call, q, k, v) -> str | None:
        return why_not_gluon_bwd(target, call, q, k, v)

    def check_options(self, call, q, k, v) -> None:
        ring_stages(call, q.shape[3], v.shape[3])  # (GLUON_BWD_STAGES that do not fit)

    def first_call(self, key, target: Target, call, x: Inputs, fusable: bool, need_dkdv: bool):
        plan = self.make_plan(call, x, target)
        plan.depends = plans.q_tables_depends(call.block_mask)
        plans.keep_backward(call, key, plan)
        return self.run(plan, call, x, fusable, need_dkdv)

    def make_plan(self, call, x: Inputs, target: Target) -> plans.Plan:
        import_gluon()
        q, k = x.q, x.k
        B, Hq, L, E = q.shape
        Hkv, S = k.shape[1], k.shape[2]
        chunks = call.options.gluon_bwd_dq_chunks or DQ_CHUNKS
        slots = dq_slots(B, Hkv, chunks, call.options.gluon_bwd_overlap)
        (acc_b, acc_hkv), parts = dq_parts(B, Hkv, chunks, slots)
        group = call.gqa_group
        spec = gluon_bwd_spec(q, k, call, gluon_target(target), x.v.shape[3])
        joint = joint_graph(call.score)
        l_pad = padded_rows(L, spec)
        main = generated_module(gluon_bwd_kernel, spec, joint, call.score, call.mask)
        rows = RowsSpec(E, x.grad_lse is not None, target.name, spec.head_dim_v)
        pre, post = row_steps(rows, x, l_pad, acc_hkv * group)
        acc_heads = acc_b * acc_hkv * group  # the (batch, query head) pairs a slot holds
        zero = zero_step(rows, acc_heads * l_pad)
        lengths = {"HQ": Hq, "L": L, "S": S, "L_PAD": l_pad, "HQ_CHUNK": acc_hkv * group}
        kernel = Step(main.kernel(), kernel_grid(S, Hkv, B, spec.block_n),
                      spec.constexprs(dscore_is_one(joint), has_buffer_grads(joint)),
                      spec.launch_options(),
                      binding.Binder(main.names(), {
                          **lengths, **binding.strides("dk", "bhnd", x.dk.stride()),
                          **binding.strides("dv", "bhnd", x.dv.stride()),
                          **binding.tables("Q", "n", "m", call.block_mask, "q", q.device),
                          **binding.buffer_layout(call.score, call.mask),
                          # the accumulators are contiguous in their captured tensors' shapes
                          **binding.gradient_strides(x.grads)}))
        return plans.Plan(self, spec, (pre, kernel, post, zero), {
            "l_pad": l_pad, "layouts": descriptor_layouts(spec),
            "blocks": {name: block for name, (block, _) in descriptor_blocks(spec).items()},
            "acc_heads": acc_heads, "parts": parts, "slots": slots,
            # what run() allocates for the fp32 dQ accumulator (memory reports read it)
            "accumulator_bytes": slots * acc_heads * l_pad * E * 4})

    def run(self, plan, call, x: Inputs, fusable: bool, need_dkdv: bool):
        pre, kernel, post, zero = plan.steps
        B, Hq, L, E = x.q.shape
        l_pad, device = plan.fixed["l_pad"], x.q.device
        lse2, delta = run_pre(pre, x, l_pad)
        acc_rows, slots = plan.fixed["acc_heads"] * l_pad, plan.fixed["slots"]
        # each part zeroes its slot on its stream before its kernel. (The postprocess leaving
        # the rows zeroed for the slot's next part instead, f2fa661, gave wrong dQ on the
        # H200 where one slot ran several parts, pz_f2fa661; the reason was not found)
        dq_accs = [torch.empty(acc_rows, E, dtype=torch.float32, device=device)
                   for _ in range(slots)]
        grad_out = x.grad_out if descriptor_layout_ok(x.grad_out) else x.grad_out.contiguous()
        kind = descriptor_kinds()[1 if kernel.launched else 0]
        layouts, blocks = plan.fixed["layouts"], plan.fixed["blocks"]

        def descriptor(name, t, shape, strides):
            return kind(t, shape, strides, blocks[name], layouts[name])
        descriptors = {name: descriptor(name, t, *block_geometry(t, blocks[name]))
                       for name, t in (("Q_DESC", x.q), ("DO_DESC", grad_out), ("K_DESC", x.k),
                                       ("V_DESC", x.v))}
        descriptors.update(
            LSE_DESC=descriptor("LSE_DESC", lse2, [B * Hq, l_pad], [lse2.stride(0), 1]),
            DELTA_DESC=descriptor("DELTA_DESC", delta, [B * Hq, l_pad], [delta.stride(0), 1]))
        # the accumulator as a descriptor (bwd_gluon.tmpl's TMA reduce-adds) or a pointer
        # (bwd_gluon_wide.tmpl's atomic adds)
        wide = plan.spec.wide
        acc_name = "DQ_ACC" if wide else "DQ_DESC"
        dq_descs = dq_accs if wide else [descriptor("DQ_DESC", acc, [acc_rows, E], [E, 1])
                                         for acc in dq_accs]
        # the fused kernel writes dK and dV whether or not they are wanted (a cached call
        # without them binds none: runtime.backward), in the strides its plan fixed
        dk, dv = (x.dk, x.dv) if x.dk is not None else (
            torch.empty_like(x.k, memory_format=torch.contiguous_format),
            torch.empty_like(x.v, memory_format=torch.contiguous_format))
        args = {**descriptors, "DK": dk, "DV": dv, "sm_scale": float(call.scale),
                **binding.buffer_pointers(call.score, call.mask),
                **binding.gradient_pointers(x.grads)}
        if call.dropout is not None:
            args.update(binding.feature_values(call))
        group = call.gqa_group
        # every launch's arguments bound once; a part changes three of them in a copy (the
        # host's time per part is what a sparse mask's short backward waits on)
        main_args = kernel.binder.bind({**args, acc_name: dq_descs[0], "B0": 0, "HKV0": 0})
        at_desc, at_b0, at_h0 = (kernel.binder.position(n) for n in (acc_name, "B0", "HKV0"))
        posts = [post_args(post, acc, x, call.scale) for acc in dq_accs]
        post_b0, post_h0 = post.binder.position("B0"), post.binder.position("H0")
        zeros = [zero.binder.bind({"DQ_ACC": acc}) for acc in dq_accs]
        # part i in slot i % slots, on that slot's stream: a part's programs fill the SMs
        # the part before it leaves idle at its end (the parts touch disjoint heads)
        with part_streams(device, slots) as streams:
            for i, (b0, h0, nb, nh) in enumerate(plan.fixed["parts"]):
                slot = i % slots
                stream = streams[slot]
                zero.launch(zeros[slot], device, None, stream)
                part = main_args.copy()
                part[at_desc], part[at_b0], part[at_h0] = dq_descs[slot], b0, h0
                kernel.launch(part, device, kernel_grid(x.k.shape[2], nh, nb, plan.spec.block_n),
                              stream)
                part = posts[slot].copy()
                part[post_b0], part[post_h0] = b0, h0 * group
                post.launch(part, device, (post.grid[0], nh * group, nb), stream)
        if x.delta is not None:  # the caller wants delta (the sinks' gradient; row_buffers
            # then keeps delta out of dQ, whose postprocess overwrites it)
            x.delta.copy_(delta[:, :L].reshape(x.delta.shape))
        if x.grads:
            poison_buffer_grads(x.lse, x.grads)


def poison_buffer_grads(lse: torch.Tensor, grads: dict) -> None:
    """The wide kernel's captured-tensor gradients, made wholly NaN when any row's forward
    saw a +inf or NaN score (lse +inf or NaN), where torch's are NaN in the entries such a
    row read: the kernel's tiles cannot tell a +inf row's entries from masked ones (P is 0
    at both, its delta NaN at both; the Triton dQ kernel, which has the mask there, gives
    torch's entries). Wider than torch's, never finite where it is NaN; no device sync."""
    poisoned = ~(lse < float("inf")).all()
    for acc in grads.values():
        acc.masked_fill_(poisoned, float("nan"))


GLUON_BWD = register(GluonBackward())
