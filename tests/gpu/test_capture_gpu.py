"""CUDA graphs replay with the block mask's tables as they are at replay, not as they were
at capture: a captured forward and backward over a mask of untileable blocks (coarsened inside
the capture) after its tables and captured tensor are edited in place, and a training step
compiled with mode="reduce-overhead" fed a new document mask every step (cudagraph trees copy
the new tables into the graph's inputs), each against eager flexfa on the same mask. In a
subprocess (Inductor's kernels cannot run under this process's TRITON_INTERPRET=1)."""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

SCRIPT = """
import torch
import flexfa

torch.manual_seed(0)
L, H, E = 1000, 4, 64
doc = torch.zeros(L, dtype=torch.long, device="cuda")

def document(b, h, q_idx, kv_idx):
    return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)

def documents(lengths):
    return torch.repeat_interleave(torch.arange(len(lengths)),
                                   torch.tensor(lengths))[:L].cuda()

q, k, v = (torch.randn(1, H, L, E, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3))
grad = torch.randn(1, H, L, E, device="cuda", dtype=torch.bfloat16)

def step(block_mask):
    out = flexfa.flex_attention(q, k, v, block_mask=block_mask)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    return out, dq, dk, dv

def check(got, want, what):
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2,
                                   msg=lambda m: f"{what} {name}: {m}")

# 1. torch.cuda.graph over a mask of 40-wide blocks (the kernels tile 80): causal at capture
doc.copy_(documents([L]))
mask = flexfa.create_block_mask(document, 1, None, L, L, device="cuda", BLOCK_SIZE=40)
stream = torch.cuda.Stream()
stream.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(stream):
    for _ in range(2):  # warm up: plans, tuning, the coarse mask's memo
        step(mask)
torch.cuda.current_stream().wait_stream(stream)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    captured = step(mask)
for lengths in ([300, 500, 200], [L], [120] * 9):
    doc.copy_(documents(lengths))
    new = flexfa.create_block_mask(document, 1, None, L, L, device="cuda", BLOCK_SIZE=40)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        getattr(mask, name).copy_(getattr(new, name))  # in place, as a static mask is edited
    graph.replay()
    check(captured, step(new), f"torch.cuda.graph, documents {lengths}")
print("captured graph follows edited tables")

# 2. the forward compiled with CUDA graphs (its backward too), a new mask each call
def forward(block_mask):
    return flexfa.flex_attention(q, k, v, block_mask=block_mask)

def trained(fn, block_mask):
    out = fn(block_mask)
    out.backward(grad)
    result = (out.detach().clone(), q.grad.clone(), k.grad.clone(), v.grad.clone())
    q.grad = k.grad = v.grad = None
    return result

compiled = torch.compile(forward, fullgraph=True, mode="reduce-overhead")
for lengths in ([L], [300, 500, 200], [120] * 9, [700, 300]):
    doc.copy_(documents(lengths))
    new = flexfa.create_block_mask(document, 1, None, L, L, device="cuda", BLOCK_SIZE=128)
    torch.compiler.cudagraph_mark_step_begin()
    check(trained(compiled, new), trained(forward, new), f"reduce-overhead, documents {lengths}")
print("reduce-overhead follows new masks")
"""


def test_cuda_graphs_read_the_tables_at_replay():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "captured graph follows edited tables" in result.stdout
    assert "reduce-overhead follows new masks" in result.stdout
