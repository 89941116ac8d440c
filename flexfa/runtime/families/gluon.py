"""The Gluon forward family: ``fwd_gluon.tmpl`` (FlashAttention-3's structure on sm_90: a TMA
producer warp, two consumer warpgroups of 64 query rows each, async wgmma overlapping the
softmax with the P @ V GEMM; docs/gluon.md).

Chosen by default only where it measured faster than the Hopper family (``AUTO_CLASSES``;
shorter queries where its grid fills ``AUTO_MIN_FILL`` of the SMs), anywhere it can run when
``kernel_options={"BACKEND": "GLUON"}`` forces it.
It needs an sm_90 GPU (or CPU tensors
under kernel_options GLUON_EMULATE, where runtime.gluon_emulator runs its sm_90 source; never
the Triton interpreter itself), fp16/bf16 inputs whose head dims pad to one of
``HEAD_DIM_PAIRS`` (E = Ev = 64, 128, 256, and E = 256 with Ev = 128; E = 192 with Ev = 128,
96 and 80 padded) in the layout the Hopper family reads through tensor descriptors, and a
block mask (if any) whose query blocks are multiples of the program's 128 rows. Tiles: 128 query
rows per program (fixed), BLOCK_N and the ring depth (num_stages) from kernel_options or the
defaults below; the register split is fixed (``MAX_REGISTERS``).
"""
from __future__ import annotations

import functools

import torch

from ...blockmask.density import density_class
from ...codegen.gluon import (CONSUMER_ROWS, CONSUMERS, GLUON_TEMPLATE, MAX_REGISTERS,
                              descriptor_blocks, descriptor_layout, gluon_constexprs,
                              gluon_kernel, trims_columns)
from ...codegen.ranges import Domain, static_score_max
from ...codegen.spec import DTYPE_NAMES, KernelSpec, next_power_of_two
from ...errors import InputError
from ...loader import interpret_mode
from .. import binding, plans
from ..autotune import SHORT_KV
from ..call import AttentionCall
from ..kernels import generated_module
from ..launch import Step, cdiv
from ..outputs import allocate_outputs, forward_grid, head_group, out_strides, stat_args
from ..registry import KernelFamily, register
from ..tables import largest_tile, mask_blocks
from ..target import EMULATED_SM90, Target
from .ampere import int64_nodes, sm_count, wants_split
from .hopper import block_geometry, descriptor_layout_ok

BLOCK_M = CONSUMERS * CONSUMER_ROWS
# (BLOCK_N, ring depth) per padded (E, Ev): K and V rings plus Q fit the H200's 227 KB of
# shared memory (E = 128: 32 KB of Q, 2 x 2 stages x 32 KB of K and V; E = 256: 64 KB of Q,
# 2 x 2 stages x 32 KB of 64-key tiles; 128-key tiles there spill the consumers' 240
# registers: a 64 x 256 fp32 accumulator is 128 of them; E = 192 padded to 256 with Ev = 128
# (DeepSeek's MLA): 64 KB of Q, 3 stages of 32 KB of K and 16 KB of V). Head dims between
# these are padded: the descriptors' boxes are the padded width, and TMA fills the columns
# past the tensor's with zeros (they add nothing to q.k; the output's are not stored)
DEFAULT_TILES = {(64, 64): (128, 3), (128, 128): (128, 2), (256, 256): (64, 2),
                 (256, 128): (64, 3)}
HEAD_DIM_PAIRS = frozenset(DEFAULT_TILES)
SHARED_BYTES = 227 * 1024  # sm_90's shared memory per block
FIXED_SMS = 132  # the H100/H200's SMs: a plan made without a GPU (compile tests, CPU tests)


def _sms(device) -> int:
    """The SM count of ``device``, ``FIXED_SMS`` for a CPU tensor's plan."""
    return sm_count(device) if device.type == "cuda" else FIXED_SMS


# (head dim, density class, kv length class of runtime.autotune) where BACKEND="AUTO" takes
# this family: measured faster than the Hopper family on the H200 at L = S in {2048, 16384}
# (benchmarks/results/nextgen_gpu_2026-12-01/p_ff6ac64): E = 128 dense 1.15x (S = 2048) and
# 1.26x (16384); E = 128 masked at 16384 1.03-1.15x (causal, softcap, ALiBi). Not taken: E = 64
# (0.77-1.02x), E = 128 masked at 2048 (0.91-0.92x). E = 128 sparse since its work tiles come
# from an atomic counter under a block mask (GLUON_PERSISTENT's default;
# benchmarks/results/gpu_2026-12-04/sp_53ddddb, the project benchmark's sliding and document,
# 3 rounds): its time over the Hopper family's 0.88-0.92 at S = 8192 and 16384, document 0.95
# at 2048 (on the plain grid 0.94-0.97 at 8192 and 16384, 0.99-1.05 at 2048; in 2026-12-01's
# runs 0.87-0.99x the speed); E = 64 sparse 1.04-1.16x the Hopper family's time: not taken.
# The sliding window at 2048 (0.94, a "masked" short class) is not taken: causal there was not
# measured with the dynamic tiles.
# E = 256, every class (benchmarks/results/gpu_2026-12-02/k_390f66e, l_13bdec1, m_6e86b10):
# at S = 16384 full 2.21x, causal 2.36x (2.40x again in l), softcap + causal 2.31x, document
# 2.0x the Hopper family; at S = 2048 (B = 8) full 2.00x, causal 2.06x, document 1.98x.
# Padded head dims (benchmarks/results/gpu_2026-12-02/d6_96708f0, experiments/fwd_tiles.py,
# L = S = 8192 and 2048, causal and full): E = 192 with Ev = 128 1.41-1.50x the Hopper family
# (1.59-1.78x FlexAttention), E = 96 1.11-1.34x; sparse masks not measured there. E = 80
# (benchmarks/results/gpu_2026-12-02/ft_159240b, the same script, 2 rounds): 1.19x / 1.35x
# the Hopper family at 8192 causal / full, 1.13x / 1.33x at 2048; E = 48 0.98-1.05x: not
# taken. A class's head dims are E where Ev = E, else (E, Ev): only the pairs measured.
# Since the dynamic tiles take the heads in groups (HEAD_GROUP;
# benchmarks/results/gpu_2026-12-04/group_7623fd4, 3 rounds, B * H * L = 16 * 16384): E = 128
# masked at 2048 and 4096 (causal, sliding, ALiBi, softcap, prefix) 0.81-0.88x the Hopper
# family's time, E = 64 masked at 8192 and 16384 (causal, ALiBi, prefix, softcap) 0.93-0.98x;
# E = 64 sparse (document) still 1.15x.
AUTO_CLASSES = frozenset({(128, "dense", "short"), (128, "dense", "long"),
                          (128, "masked", "short"), (128, "masked", "long"),
                          (128, "sparse", "short"), (128, "sparse", "long"),
                          (64, "masked", "long"),
                          *((256, density, length) for density in ("dense", "masked", "sparse")
                            for length in ("short", "long")),
                          *((dims, density, length) for dims in ((192, 128), 96, 80)
                            for density in ("dense", "masked") for length in ("short", "long"))})
# With dropout_p (the Philox words of the keep mask computed while the other consumer's GEMMs
# run) also E = 128 masked at the short length: B=4 H=16 L=S=4096 causal, p = 0.1, forward
# 0.967 ms against the Hopper family's 1.111 (dense 1.768 against 2.014, E = 256 causal 0.792
# against 1.441; E = 64 causal 0.962 against 0.910, not taken;
# benchmarks/results/gpu_2026-12-03/gdrop_5d5eca0); B=8 L=S=2048 causal 0.608 against 0.650
# (gr_e96fd0a). E = 64 with dropout keeps the Hopper family (measured slower at 4096 above,
# not measured at the long length that AUTO_CLASSES takes without dropout).
DROPOUT_CLASSES = AUTO_CLASSES - {(64, "masked", "long")}
AUTO_MIN_LEN = 2048  # the shortest L = S measured: shorter keys keep the Hopper family
# Shorter queries against long keys (chunked prefill, E = 128, causal at an offset, 32x8 GQA;
# benchmarks/results/gpu_2026-12-02/y_f0f305c/prefill_sweep.log): the Gluon forward, one CTA
# per SM and unsplit, against the Hopper family with its key split: 1.45-1.63x where its grid
# had 128 to 512 programs (B = 1, L = 512; B = 4, L = 128 and 512; S = 8k and 32k), 0.71-0.82x
# where it had 32 (B = 1, L = 128, 4 of 132 SMs' worth of work in each of 32 programs). So
# it takes such calls where its programs fill AUTO_MIN_FILL of the SMs (between 32 and 128
# programs nothing was measured; the line sits near the faster side).
AUTO_MIN_FILL = 0.75


def _why_not_auto(call: AttentionCall, q, k, v, sms: int) -> str | None:
    """Why BACKEND="AUTO" does not take this family for the call on ``sms`` SMs (None: it
    does)."""
    B, Hq, L, E = q.shape
    S = k.shape[2]
    if call.options.fwd.pins_tiles:
        return "kernel_options pin forward tiles (the Hopper family's); BACKEND='GLUON' forces it"
    if S < AUTO_MIN_LEN:
        return f"BACKEND='AUTO' takes it from S >= {AUTO_MIN_LEN}, not S={S}"
    Ev = v.shape[3]
    found = (E if E == Ev else (E, Ev), density_class(call.block_mask),
             "short" if S <= SHORT_KV else "long")
    if found not in (DROPOUT_CLASSES if call.dropout is not None else AUTO_CLASSES):
        return (f"BACKEND='AUTO' takes it only where it measured faster than the Hopper "
                f"family, not for (head dim, density, length) {found}"
                f"{' with dropout' if call.dropout is not None else ''}")
    if L < AUTO_MIN_LEN:
        programs = B * Hq * cdiv(L, BLOCK_M)
        if found[2] != "long" or programs < AUTO_MIN_FILL * sms:
            return (f"BACKEND='AUTO' takes it at L={L} < {AUTO_MIN_LEN} only against keys "
                    f"longer than {SHORT_KV} with programs for {AUTO_MIN_FILL:.0%} of the "
                    f"{sms} SMs, not S={S} with {programs} programs (the Hopper family "
                    f"splits the keys there)")
    return None


def padded_pair(q, v) -> tuple[int, int]:
    """(E, Ev) padded to powers of two (at least 16), as the kernels' tiles hold them."""
    return next_power_of_two(q.shape[3]), next_power_of_two(v.shape[3])


def why_not_gluon(target: Target, call: AttentionCall, q, k, v, blocks: tuple[int, int],
                  pairs: frozenset | None = None) -> str | None:
    """Why a Gluon kernel (the forward's or the backward's) cannot take this call: it runs
    compiled on sm_90 only (or emulated: GLUON_EMULATE), on fp16/bf16 q, k, v in the
    tensor-descriptor layout, and walks block masks whose (q, kv) blocks are multiples of its
    ``blocks``; head dims: any whose padded (E, Ev) is one of ``pairs`` (default the
    forward's, ``HEAD_DIM_PAIRS``)."""
    if call.options.gluon_emulate and not target.interpret:
        raise InputError(f"kernel_options GLUON_EMULATE=True runs the Gluon kernels on CPU "
                         f"tensors, but q is on {q.device}")
    if target.interpret and not call.options.gluon_emulate:
        return ("it is a compiled Gluon kernel, which the Triton interpreter (CPU tensors) "
                "cannot run (kernel_options GLUON_EMULATE=True runs it in flexfa's emulator)")
    if not target.interpret and not target.is_sm90:
        return f"it runs on sm_90, not {target}"
    E, Ev = q.shape[3], v.shape[3]
    pairs = HEAD_DIM_PAIRS if pairs is None else pairs
    if padded_pair(q, v) not in pairs:
        named = ", ".join(f"{e}/{ev}" for e, ev in sorted(pairs))
        return (f"it needs head dims E/Ev that pad to one of {named}, not E={E}, Ev={Ev} "
                f"(padded {'/'.join(map(str, padded_pair(q, v)))})")
    sparse_q, sparse_kv = mask_blocks(call.block_mask)
    if sparse_q is not None and (sparse_q % blocks[0] or sparse_kv % blocks[1]):
        return (f"it needs block-mask blocks that are multiples of {blocks}, not "
                f"{tuple(call.block_mask.BLOCK_SIZE)}")
    if not descriptor_layout_ok(q, k, v):
        return ("it needs fp16/bf16 q, k, v, each a [B * H * len, dim] matrix with 16-byte "
                "aligned rows, of fewer than 2**31 rows")
    return None


def gluon_target(target: Target) -> Target:
    """The target a Gluon kernel is rendered for: sm_90 emulated for CPU tensors (they reach
    the family only under GLUON_EMULATE: ``why_not_gluon``), else the call's."""
    return EMULATED_SM90 if target.interpret else target


def gluon_tiles(call: AttentionCall, pair: tuple[int, int]) -> tuple[int, int]:
    """(BLOCK_N, num_stages) at padded head dims ``pair``: kernel_options, else the default,
    fitted to the mask's key blocks."""
    block_n, stages = DEFAULT_TILES[pair]
    sparse_kv = mask_blocks(call.block_mask)[1]
    if sparse_kv is not None:
        block_n = min(block_n, largest_tile(sparse_kv))
    options = call.options.fwd
    block_n = options.block_n or block_n
    if sparse_kv is not None and (sparse_kv % block_n or block_n < 64):
        raise InputError(f"block_mask has BLOCK_SIZE {tuple(call.block_mask.BLOCK_SIZE)}; "
                         f"kernel_options BLOCK_N={block_n} must divide it and be >= 64")
    if block_n < 64:  # (without a mask too: it launched 16- and 32-key tiles)
        raise InputError(f"kernel_options BLOCK_N={block_n}: the Gluon forward's key tile "
                         "must be >= 64")
    tma_store = call.options.gluon_tma_store
    if options.num_stages:
        stages = options.num_stages
    else:  # out's staging buffer may leave room for fewer stages than the default
        while stages > 2 and shared_bytes(*pair, block_n, stages, tma_store) > SHARED_BYTES:
            stages -= 1
    need = shared_bytes(*pair, block_n, stages, tma_store)
    if need > SHARED_BYTES:
        dims = str(pair[0]) if pair[0] == pair[1] else "{}/{}".format(*pair)
        raise InputError(
            f"the Gluon forward at (padded) head dim {dims} with BLOCK_N={block_n}, "
            f"num_stages={stages}{', GLUON_TMA_STORE' if tma_store else ''}"
            f" needs {need // 1024} KB of shared memory, more than sm_90's "
            f"{SHARED_BYTES // 1024} KB: pin fewer stages or a smaller BLOCK_N in "
            f"kernel_options (the default at this head dim is BLOCK_N={DEFAULT_TILES[pair][0]},"
            f" num_stages={DEFAULT_TILES[pair][1]})")
    return block_n, stages


def shared_bytes(head_dim: int, head_dim_v: int, block_n: int, stages: int,
                 tma_store: bool) -> int:
    """fwd_gluon.tmpl's shared memory (16-bit elements) at padded head dims: the program's Q,
    the K and V rings, out's staging buffer with the TMA store, and 4 KB for the barriers and
    the compiler's scratch (Triton 3.6 allocated 3.2 KB more than the buffers at E = 128 and
    256)."""
    rows = BLOCK_M * (head_dim + (head_dim_v if tma_store else 0))
    return 2 * (rows + stages * block_n * (head_dim + head_dim_v)) + 4096


def gluon_spec(q, k, v, call: AttentionCall, target: Target, return_lse: bool,
               return_max: bool) -> KernelSpec:
    L, E, S = q.shape[2], q.shape[3], k.shape[2]
    block_n, stages = gluon_tiles(call, padded_pair(q, v))
    mask = call.block_mask
    sparse_q, sparse_kv = mask_blocks(mask) if mask is not None else (BLOCK_M, block_n)
    persistent = call.options.gluon_persistent
    if persistent is None:  # AUTO: tiles from the counter under a block mask (docs/gluon.md)
        persistent = "DYNAMIC" if mask is not None else False
    return KernelSpec(
        dtype=DTYPE_NAMES[q.dtype], head_dim=E, head_dim_v=v.shape[3], block_m=BLOCK_M,
        block_n=block_n, num_warps=4, num_stages=stages, has_block_mask=mask is not None,
        has_full_blocks=mask is not None and getattr(mask, "full_kv_num_blocks", None) is not None,
        sparse_q=sparse_q, sparse_kv=sparse_kv, even_l=L % BLOCK_M == 0,
        even_s=S % sparse_kv == 0, return_lse=return_lse, gqa_group=call.gqa_group,
        input_precision=call.options.fp32_precision, target=target.name,
        template=GLUON_TEMPLATE, max_registers=MAX_REGISTERS, return_max=return_max,
        wide_ints=int64_nodes(q, k, call), pingpong=call.options.gluon_pingpong,
        tma_store=call.options.gluon_tma_store,
        persistent=persistent is not False, dynamic=persistent == "DYNAMIC",
        static_max=static_max(q, k, call, return_max), dropout=call.dropout is not None,
        sinks_dtype=call.sinks_dtype,
        qk_trim=qk_trim(call.options.gluon_qk_trim, E))


# head dims where GLUON_QK_TRIM measured faster than the padded kernel (an H100, 2c4a86f,
# benchmarks/results/gpu_2026-12-05/wj_2c4a86f: 0.87-0.99x the forward's time at 80, 96,
# 160 and 192 / 128, causal, full, softcap, ALiBi, documents, S = 2048-16384); 'AUTO' trims
# at those E whatever Ev (160 was timed with Ev = 160, 192 with Ev = 128: the trim changes Q
# K^T alone); 224, the other head dim it would change, was never timed
QK_TRIM_MEASURED = (80, 96, 160, 192)


def qk_trim(option: bool | None, E: int) -> bool:
    """The spec's ``qk_trim`` under kernel_options GLUON_QK_TRIM (None: 'AUTO')."""
    if not trims_columns(E):
        return False
    return E in QK_TRIM_MEASURED if option is None else option


def static_max(q, k, call: AttentionCall, return_max: bool) -> float | None:
    """The spec's ``static_max``: with kernel_options GLUON_STATIC_MAX, the score_mod's proven
    upper bound (``codegen.ranges.static_score_max``) for bf16 inputs without max_scores, else
    None (fp16's P underflows below 2**-24: the running max keeps the row's largest P at 1;
    max_scores needs the true max)."""
    if not call.options.gluon_static_max or return_max or q.dtype != torch.bfloat16:
        return None
    return static_score_max(call.score, Domain(q.shape[0], q.shape[1], q.shape[2], k.shape[2]))


def out_geometry(q, v, block: list[int], dtype: str) -> tuple:
    """(shape, strides, block, layout) of the descriptor over the [B * H * L, Ev] rows of the
    output ``allocate_outputs`` gives: it is laid out in q's dimension order, so its rows are
    flat where q's are (``why_not_gluon``)."""
    B, H, L, _ = q.shape
    Ev = v.shape[3]
    sb, sh, sm, sd = out_strides(q, v)
    assert sd == 1 and (H == 1 or sh == L * sm) and (B == 1 or sb == H * L * sm), (
        f"out strides {(sb, sh, sm, sd)} of shape {(B, H, L, Ev)} are not [B * H * L, Ev] rows")
    return [B * H * L, Ev], [sm, 1], block, descriptor_layout(block, dtype)


def gluon_grid(spec: KernelSpec, batch_heads: int, q_tiles: int, device) -> tuple[int, ...]:
    """The launch grid: one program per (q tile, batch * head) (``forward_grid``), or with
    ``spec.persistent`` min(SMs, work tiles) programs walking the work tiles (a plan made
    without a GPU, as in the compile tests, counts the H100/H200's ``FIXED_SMS``)."""
    if not spec.persistent:
        return forward_grid(batch_heads, q_tiles, spec.has_block_mask)
    return (min(_sms(device), batch_heads * q_tiles),)


@functools.cache
def import_gluon() -> None:
    """Import ``triton.experimental.gluon`` once, with the interpreter's setting on: its
    standard library wraps triton.language's ``@jit`` functions and, with the setting off,
    asserts they were decorated compiled, which fails in a process that decorated them for
    the interpreter (a test session with CPU kernels). The wrappers are Gluon functions
    either way, and flexfa's Gluon kernels call none of them."""
    with interpret_mode(True):
        import triton.experimental.gluon.language  # noqa: F401


@functools.cache
def descriptor_kinds() -> tuple[type, type]:
    """(Gluon's TensorDescriptor, one that skips its checks), imported on first use."""
    import_gluon()
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    class Trusted(TensorDescriptor):
        """Checked when its plan was made; the plan's key fixes what the checks read."""

        def __post_init__(self):
            pass

    return TensorDescriptor, Trusted


class GluonForward(KernelFamily):
    name = "gluon"
    direction = "forward"
    priority = 15  # before Hopper (10) in AUTO_CLASSES, after the decode family (20)
    # dropout: the keep mask on P (fwd_gluon.tmpl's DROPOUT); sinks: each row's sink joins
    # its denominator in the epilogue (HAS_SINKS)
    features = frozenset({"dropout", "sinks"})

    def why_not(self, target: Target, call, q, k, v) -> str | None:
        reason = why_not_gluon(target, call, q, k, v, (BLOCK_M, 64))
        block_m = call.options.fwd.block_m
        if reason is None and block_m not in (None, BLOCK_M):
            reason = f"its programs have BLOCK_M={BLOCK_M} query rows, not {block_m}"
        if reason is None and wants_split(call, target, q, k):
            reason = "split-KV (kernel_options SPLIT_KV) runs the Hopper or Ampere family"
        if reason is None and call.options.backend != "GLUON":
            reason = _why_not_auto(call, q, k, v, _sms(q.device))
        return reason

    def first_call(self, key, target: Target, call, q, k, v, return_lse, return_max):
        plan = self.make_plan(q, k, v, call, target, return_lse, return_max)
        plans.keep(call, key, plan)
        return self.run(plan, call, q, k, v, return_lse, return_max)

    def run(self, plan, call, q, k, v, return_lse, return_max):
        out, lse, maxs = allocate_outputs(q, v, return_lse, return_max)
        step = plan.steps[0]
        # the descriptors' checks ran at the plan's first launch; its key fixes what they read
        kind = descriptor_kinds()[1 if step.launched else 0]
        descriptors = {name: kind(t, shape, strides, block, layout) for t, (
            name, (shape, strides, block, layout)) in zip((q, k, v, out),
                                                          plan.fixed["descriptors"])}
        stat_lse, stat_max = stat_args(out, lse, maxs)
        # the dynamic tiles' counter, from 0 for each launch
        counter = {"TILE_COUNTER": torch.zeros(1, dtype=torch.int32, device=q.device)} \
            if plan.spec.dynamic else {}
        step.launch_with({**descriptors, **counter, "OUT": out, "LSE": stat_lse,
                          "MAXS": stat_max, "sm_scale": float(call.scale),
                          **binding.buffer_pointers(call.score, call.mask),
                          **binding.feature_values(call)}, q.device)
        return out, lse, maxs

    def make_plan(self, q, k, v, call, target, return_lse, return_max) -> plans.Plan:
        import_gluon()
        spec = gluon_spec(q, k, v, call, gluon_target(target), return_lse, return_max)
        B, Hq, L, _ = q.shape
        # fwd_gluon.tmpl stores out's columns as contiguous
        assert out_strides(q, v)[3] == 1, f"out strides {out_strides(q, v)} of q {q.stride()}"
        loaded = generated_module(gluon_kernel, spec, call.score, call.mask)
        fixed = {**binding.strides("o", "bhmd", out_strides(q, v)),
                 **binding.tables("KV", "m", "n", call.block_mask, "kv", q.device),
                 "HQ": Hq, "L": L, "S": k.shape[2], "BATCH_HEADS": B * Hq,
                 "HEAD_GROUP": head_group(call, q, k, v),
                 **binding.buffer_layout(call.score, call.mask)}
        step = Step(loaded.kernel(), gluon_grid(spec, B * Hq, cdiv(L, BLOCK_M), q.device),
                    gluon_constexprs(spec, call.scores_first), spec.launch_options(),
                    binding.Binder(loaded.names(), fixed))
        descriptors = []
        for t, (name, block) in zip((q, k, v), descriptor_blocks(spec).items()):
            # K and V at a ragged S by heads (rank-3 blocks, codegen.hopper.kv_heads)
            shape, strides = block_geometry(t, block)
            descriptors.append((name, (shape, strides, block,
                                       descriptor_layout(block, spec.dtype))))
        if spec.tma_store:  # the fourth, over the call's out
            descriptors.append(("O_DESC", out_geometry(q, v, descriptor_blocks(spec)["O_DESC"],
                                                       spec.dtype)))
        return plans.Plan(self, spec, (step,), {"descriptors": tuple(descriptors)})


GLUON = register(GluonForward())
