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

    python benchmarks/wgmma_wait_probe.py
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


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
            m_new = tl.maximum(m, tl.max(qk, 1))
            p = tl.exp2(qk - m_new[:, None])
            alpha = tl.exp2(m - m_new)
            s = s * alpha + tl.sum(p, 1)
            v = tl.load(V + ((j - 1) * BN + offs_n[:, None]) * E + offs_e[None, :])
            acc = tl.dot(p.to(tl.bfloat16), v, acc * alpha[:, None])
            m, qk = m_new, qk_next
    else:
        for j in range(0, N):
            qk = tl.dot(q, tl.load(K + (j * BN + offs_n[None, :]) * E + offs_e[:, None]))
            m_new = tl.maximum(m, tl.max(qk, 1))
            p = tl.exp2(qk - m_new[:, None])
            alpha = tl.exp2(m - m_new)
            s = s * alpha + tl.sum(p, 1)
            v = tl.load(V + (j * BN + offs_n[:, None]) * E + offs_e[None, :])
            acc = tl.dot(p.to(tl.bfloat16), v, acc * alpha[:, None])
            m = m_new
    tl.store(O + offs_m[:, None] * E + offs_e[None, :], acc / s[:, None])


def loop_events(rotated: bool) -> list[str]:
    """The loop body's wgmma issues, waits and exponentials, in PTX order, runs collapsed."""
    signature = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*fp32", "N": "i32",
                 "BM": "constexpr", "BN": "constexpr", "E": "constexpr", "ROTATED": "constexpr"}
    source = ASTSource(_attention_loop, signature=signature,
                       constexprs={"BM": 128, "BN": 64, "E": 128, "ROTATED": int(rotated)})
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 8, "num_stages": 2}).asm["ptx"]
    body = ptx[ptx.index("$L__BB0_2:"):]  # the loop: from its label to its back branch
    body = body[:body.index("bra \t$L__BB0_2;")]
    events = []
    for line in body.splitlines():
        word = line.strip().split(" ")[0].split("\t")[0]
        name = ("wgmma" if word.startswith("wgmma.mma_async") else
                "wait" if word.startswith("wgmma.wait_group") else
                "ex2" if word.startswith("ex2.approx") else None)
        if name and (not events or events[-1] != name):
            events.append(name)
    return events


def main() -> None:
    for rotated in (False, True):
        print(f"{'rotated' if rotated else 'plain':8} loop body: {' -> '.join(loop_events(rotated))}")


if __name__ == "__main__":
    main()
