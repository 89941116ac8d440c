"""Spike (seventh session): a Gluon forward where the softmax overlaps a GEMM inside a program.

Dense bf16 attention only (no score_mod, no mask; L a multiple of the tiles), written in
Gluon (``triton.experimental.gluon``) because plain Triton 3.6 waits for every wgmma right
after issuing it (``benchmarks/experiments/wgmma_wait_probe.py``). Each iteration issues the q.k GEMM of
kv tile j and the P @ V GEMM of tile j - 1 asynchronously, waits for the first only
(``warpgroup_mma_wait(num_outstanding=1)``), computes tile j's softmax while P @ V runs, then
waits for it; K and V tiles arrive by TMA into rings of STAGES buffers, each refilled as soon
as its GEMM is done. Not used by flexfa: it measures whether this structure beats the Triton
template before anything is built on it.

    python benchmarks/experiments/gluon_forward_spike.py   # GPU: correctness vs SDPA and timings against
                                                # flexfa's forward; CPU: compile for sm_90

On the H200 (benchmarks/results/gluon_spike/): correct (relative error vs SDPA as flexfa's),
at best 497-501 TFLOP/s for E = 128, S = 16384 (128 x 128 tiles, 8 warps, 3 stages; or 64 x 64,
4 warps, 2 stages) against 519-526 for flexfa's Triton forward in the same runs: the overlap
alone does not beat two independent programs per SM; FA3 adds ping-pong between two
warpgroups and a producer warp (``gl.warp_specialize``).
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@gluon.jit
def _load(desc, smem, bars, row, t, STAGES: gl.constexpr):
    stage = t % STAGES
    bar = bars.index(stage)
    mbarrier.expect(bar, desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [row, 0], bar, smem.index(stage))


@gluon.jit
def attn_fwd(q_desc, k_desc, v_desc, o_desc, L, qk_scale,
             BM: gl.constexpr, BN: gl.constexpr, E: gl.constexpr, STAGES: gl.constexpr,
             num_warps: gl.constexpr):
    pid_m = gl.program_id(0)
    bh = gl.program_id(1)
    q_row = bh * L + pid_m * BM
    kv_row = bh * L
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BN, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, E, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BM, E], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BN, E], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BN, E], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)

    n = L // BN
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_bar, q_smem)
    for t in gl.static_range(STAGES):
        if t < n:
            _load(k_desc, k_smem, k_bars, kv_row + t * BN, t, STAGES)
            _load(v_desc, v_smem, v_bars, kv_row + t * BN, t, STAGES)
    mbarrier.wait(q_bar, phase=0)

    # tile 0
    mbarrier.wait(k_bars.index(0), phase=0)
    s = gl.zeros([BM, BN], gl.float32, layout=s_layout)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    if STAGES < n:  # K stage 0 is free
        _load(k_desc, k_smem, k_bars, kv_row + STAGES * BN, STAGES, STAGES)
    m = gl.max(s, axis=1) * qk_scale
    p = gl.exp2(s * qk_scale - m[:, None])
    l = gl.sum(p, axis=1)
    o = gl.zeros([BM, E], gl.float32, layout=o_layout)
    p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)

    for j in range(1, n):
        stage = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(k_bars.index(stage), phase=(j // STAGES) & 1)
        mbarrier.wait(v_bars.index(prev), phase=((j - 1) // STAGES) & 1)
        s = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), s, use_acc=False,
                          is_async=True)
        o = warpgroup_mma(p_op, v_smem.index(prev), o, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
        # K stage of tile j is free once S_j is done: refill it with tile j + STAGES
        if j + STAGES < n:
            _load(k_desc, k_smem, k_bars, kv_row + (j + STAGES) * BN, j + STAGES, STAGES)
        # softmax of tile j while P @ V of tile j - 1 runs
        m_new = gl.maximum(m, gl.max(s, axis=1) * qk_scale)
        alpha = gl.exp2(m - m_new)
        p = gl.exp2(s * qk_scale - m_new[:, None])
        l = l * alpha + gl.sum(p, axis=1)
        m = m_new
        p_bf = p.to(gl.bfloat16)
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o, ))
        # V stage of tile j - 1 is free: refill it with tile j - 1 + STAGES
        if j - 1 + STAGES < n:
            _load(v_desc, v_smem, v_bars, kv_row + (j - 1 + STAGES) * BN, j - 1 + STAGES,
                  STAGES)
        o = o * gl.convert_layout(alpha, row_o)[:, None]
        p_op = gl.convert_layout(p_bf, p_layout)

    last = (n - 1) % STAGES
    mbarrier.wait(v_bars.index(last), phase=((n - 1) // STAGES) & 1)
    o = warpgroup_mma(p_op, v_smem.index(last), o, is_async=True)
    o = warpgroup_mma_wait(num_outstanding=0, deps=(o, ))
    o = o / gl.convert_layout(l, row_o)[:, None]
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_bars.index(i))
        mbarrier.invalidate(v_bars.index(i))
    mbarrier.invalidate(q_bar)
    o_smem = gl.allocate_shared_memory(o_desc.dtype, [BM, E], o_desc.layout)
    o_smem.store(o.to(gl.bfloat16))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_row, 0], o_smem)
    tma.store_wait(pendings=0)


def descriptors(q, k, v, o, BM, BN):
    B, H, L, E = q.shape
    def desc(t, block):
        lay = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
        flat = t.reshape(B * H * L, E)
        return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), block, lay)
    return desc(q, [BM, E]), desc(k, [BN, E]), desc(v, [BN, E]), desc(o, [BM, E])


def gluon_attention(q, k, v, BM=128, BN=64, STAGES=2, num_warps=8, **options):
    """softmax(q k^T / sqrt(E)) v for contiguous [B, H, L, E] bf16 tensors (L % BM == 0 and
    L % BN == 0); ``options``: launch options such as ``maxnreg``."""
    B, H, L, E = q.shape
    o = torch.empty_like(q)
    qd, kd, vd, od = descriptors(q, k, v, o, BM, BN)
    scale = E ** -0.5 * 1.4426950408889634
    attn_fwd[(L // BM, B * H)](qd, kd, vd, od, L, scale, BM, BN, E, STAGES, num_warps=num_warps,
                               **options)
    return o


def compile_sm90(BM=128, BN=64, E=128, STAGES=2, num_warps=8):
    """The kernel compiled for sm_90 without a GPU (``triton.compile``)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type
    q = torch.zeros(1, 1, 256, E, dtype=torch.bfloat16)
    qd, kd, vd, od = descriptors(q, q, q, q.clone(), BM, BN)
    sig = {"q_desc": mangle_type(qd), "k_desc": mangle_type(kd), "v_desc": mangle_type(vd),
           "o_desc": mangle_type(od), "L": "i32", "qk_scale": "fp32",
           "BM": "constexpr", "BN": "constexpr", "E": "constexpr", "STAGES": "constexpr",
           "num_warps": "constexpr"}
    src = GluonASTSource(attn_fwd, sig, constexprs={"BM": BM, "BN": BN, "E": E, "STAGES": STAGES,
                                                    "num_warps": num_warps})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def main_cpu():
    """Compile for sm_90; print registers, spills, shared memory and the loop's order."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
    from flexfa.compile_check import ptxas_usage
    from wgmma_wait_probe import ptx_loop_events
    for BM, BN, stages, warps in ((128, 128, 3, 8), (64, 64, 2, 4)):
        compiled = compile_sm90(BM, BN, 128, stages, warps)
        registers, spills, _ = ptxas_usage(compiled.asm["ptx"], 90)
        print(f"{BM}x{BN} {stages} stages {warps} warps: {registers} registers, {spills} bytes "
              f"spilled, {compiled.metadata.shared} B shared; loop: "
              + " -> ".join(ptx_loop_events(compiled.asm["ptx"])))


def main_gpu():
    """Each config against SDPA (relative L2 error) and timed next to flexfa's forward."""
    import json

    import flexfa
    torch.manual_seed(0)
    rows = []
    for S in (16384, 4096):
        B, H, E = max(1, 16384 // S), 16, 128
        q, k, v = (torch.randn(B, H, S, E, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        flops = 4 * B * H * S * S * E
        base = triton.testing.do_bench(lambda: flexfa.flex_attention(q, k, v), rep=100,
                                       return_mode="median")
        err = (flexfa.flex_attention(q, k, v).float() - ref.float()).norm() / ref.float().norm()
        rows.append(dict(S=S, impl="flexfa (Triton template)", ms=base, tflops=flops / base / 1e9,
                         relerr=err.item()))
        for BN, STAGES, W, nreg in [(128, 3, 8, None), (64, 2, 4, None), (64, 3, 4, None),
                                    (128, 2, 4, None), (64, 2, 4, 168), (128, 2, 4, 168)]:
            BM = 128 if W == 8 else 64
            kw = {"maxnreg": nreg} if nreg else {}
            def fn():
                return gluon_attention(q, k, v, BM, BN, STAGES, W, **kw)
            try:
                out = fn()
                err = (out.float() - ref.float()).norm() / ref.float().norm()
                ms = triton.testing.do_bench(fn, rep=100, return_mode="median")
                rows.append(dict(S=S, impl=f"gluon BM{BM} BN{BN} st{STAGES} w{W} r{nreg}", ms=ms,
                                 tflops=flops / ms / 1e9, relerr=err.item()))
            except Exception as exc:
                rows.append(dict(S=S, impl=f"gluon BM{BM} BN{BN} st{STAGES} w{W} r{nreg}",
                                 error=f"{type(exc).__name__}: {str(exc)[:200]}"))
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'S':>6} {'impl':34} {'ms':>7} {'TF/s':>6} {'relerr':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['S']:>6} {r['impl']:34} {r['error']}")
        else:
            print(f"{r['S']:>6} {r['impl']:34} {r['ms']:7.3f} {r['tflops']:6.0f} {r['relerr']:8.1e}")


if __name__ == "__main__":
    main_gpu() if torch.cuda.is_available() else main_cpu()
