"""Where Triton 3.6 waits for an asynchronous wgmma (no GPU needed: compiles for sm_90).

FlashAttention-3 overlaps the softmax of kv tile j with the q.k GEMM of tile j + 1 inside one
warpgroup: it issues the next GEMM, computes the current tile's exponentials, then waits. This
probe writes the loop both ways in plain Triton, the second rotated so that ``qk_next =
tl.dot(q, k_next)`` comes before the current tile's softmax and is consumed only in the next
iteration, compiles both for sm_90 and prints, for the rotated loop, the order of wgmma
issues, ``wgmma.wait_group`` and the first ``ex2`` in the loop body. In Triton 3.6 the wait
follows the next tile's GEMM immediately, before any exponential: the overlap cannot be
expressed this way (Gluon's ``warpgroup_mma(..., is_async=True)`` and ``warpgroup_mma_wait``
can).

    python benchmarks/experiments/wgmma_wait_probe.py
"""
from __future__ import annotations

import re

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def _softmax_step(qk, v, m, s, acc):
    """One kv tile's online-softmax update of (m, s, acc) from its scores and V tile."""
    m_new = tl.maximum(m, tl.max(qk, 1))
    p = tl.exp2(qk - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    s = s * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(tl.bfloat16), v, acc * alpha[:, None])
    return m_new, s, acc


@triton.jit
def _attention_loop(Q, K, V, O, N, BM: tl.constexpr, BN: tl.constexpr, E: tl.constexpr,
                    ROTATED: tl.constexpr):
    offs_m, offs_n, offs_e = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, E)
    q = tl.load(Q + offs_m[:, None] * E + offs_e[None, :])
    acc = tl.zeros([BM, E], tl.float32)
    m = tl.full([BM], -float("inf"), tl.float32)
    s = tl.zeros([BM], tl.float32)
    if ROTATED:
        qk = tl.dot(q, tl.load(K + offs_n[None, :] * E + offs_e[:, None]))
        for j in range(1, N):
            qk_next = tl.dot(q, tl.load(K + (j * BN + offs_n[None, :]) * E + offs_e[:, None]))
            v = tl.load(V + ((j - 1) * BN + offs_n[:, None]) * E + offs_e[None, :])
            m, s, acc = _softmax_step(qk, v, m, s, acc)
            qk = qk_next
    else:
        for j in range(0, N):
            qk = tl.dot(q, tl.load(K + (j * BN + offs_n[None, :]) * E + offs_e[:, None]))
            v = tl.load(V + (j * BN + offs_n[:, None]) * E + offs_e[None, :])
            m, s, acc = _softmax_step(qk, v, m, s, acc)
    tl.store(O + offs_m[:, None] * E + offs_e[None, :], acc / s[:, None])


def ptx_loop_events(ptx: str) -> list[str]:
    """The main loop's wgmma issues, waits (with their outstanding counts: ``wait0``) and
    exponentials, in PTX order, runs collapsed; the loop is the block of the last conditional
    branch, which in these kernels branches back to the loop's label."""
    label = re.findall(r"@%p\d+ bra \t(\$L__BB0_\d+);", ptx)[-1]
    body = ptx[ptx.index(label + ":"):]
    body = body[:body.index(f"bra \t{label};")]
    events = []
    for line in body.splitlines():
        words = line.split()
        if not words:
            continue
        name = ("wgmma" if words[0].startswith("wgmma.mma_async") else
                f"wait{words[-1].rstrip(';')}" if words[0].startswith("wgmma.wait_group") else
                "ex2" if words[0].startswith("ex2.approx") else None)
        if name and (not events or events[-1] != name):
            events.append(name)
    return events


def loop_events(rotated: bool) -> list[str]:
    """``ptx_loop_events`` of the plain or the rotated loop compiled for sm_90."""
    signature = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*fp32", "N": "i32",
                 "BM": "constexpr", "BN": "constexpr", "E": "constexpr", "ROTATED": "constexpr"}
    source = ASTSource(_attention_loop, signature=signature,
                       constexprs={"BM": 128, "BN": 64, "E": 128, "ROTATED": int(rotated)})
    return ptx_loop_events(triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                          options={"num_warps": 8, "num_stages": 2}).asm["ptx"])


def main() -> None:
    for rotated in (False, True):
        print(f"{'rotated' if rotated else 'plain':8} loop body: {' -> '.join(loop_events(rotated))}")


if __name__ == "__main__":
    main()
