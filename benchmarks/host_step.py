"""Host time of a fwd+bwd training step and any device synchronization inside it.

For a few variants at a small shape (where the kernels are short and the host can fall
behind), runs flexfa fwd+bwd steps: with ``torch.cuda.set_sync_debug_mode("warn")`` one
step, printing the Python stack of every synchronizing call; then the host time to enqueue
20 steps (no synchronize) against the time until they finish. A host time close to the total
means the GPU waited for the host.

    PYTHONPATH=. python benchmarks/host_step.py [S] [D] [variants]
"""
from __future__ import annotations

import sys
import time
import traceback
import warnings

import torch

import flexfa
from flexfa.bench import _variants


def main() -> None:
    S = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
    D = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    names = sys.argv[3].split(",") if len(sys.argv) > 3 else ["full", "causal", "document"]
    B, H = max(1, 16384 // S), 16
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)

    def report(message, category, filename, lineno, file=None, line=None):
        print(f"SYNC: {message}")
        traceback.print_stack(limit=12)
    warnings.showwarning = report
    warnings.simplefilter("always")
    for name in names:
        score_mod, mask_mod = _variants(S, H, "cuda")[name]
        mask = flexfa.create_block_mask(mask_mod, B, None, S, S, device="cuda") \
            if mask_mod else None

        def step():
            flexfa.flex_attention(q, k, v, score_mod, mask).backward(do)
            q.grad = k.grad = v.grad = None
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        print(f"-- {name}: one step under sync debug mode", flush=True)
        torch.cuda.set_sync_debug_mode("warn")
        step()
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        steps = 20
        start = time.perf_counter()
        for _ in range(steps):
            step()
        host = (time.perf_counter() - start) / steps * 1e3
        torch.cuda.synchronize()
        total = (time.perf_counter() - start) / steps * 1e3
        print(f"{name:9} host {host:.3f} ms/step to enqueue, {total:.3f} ms/step until done",
              flush=True)


if __name__ == "__main__":
    main()
