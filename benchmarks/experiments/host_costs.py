"""Host cost of the pieces of a training step on this machine (the GPU kept busy).

The floor torch itself sets (an autograd.Function whose forward and backward launch one small
kernel each), ``torch.empty``, and for flexfa's causal step at S = 2048, E = 64 each kernel
launch: the whole ``launch_direct`` call, Triton's launcher (``CompiledKernel.run``, which
encodes the tensor descriptors) and its C launch function alone with the arguments already
expanded. Microseconds, medians.

    PYTHONPATH=. python benchmarks/experiments/host_costs.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

import flexfa
from flexfa.runtime import backward, hopper, launch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from host_step import host_us  # noqa: E402


def _us(fn, calls: int = 200) -> float:
    return host_us(fn, calls, sleep_cycles=100_000_000)


class _Tiny(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def main() -> None:
    x = torch.randn(1024, device="cuda", requires_grad=True)
    g = torch.randn(1024, device="cuda")

    def tiny_step():
        _Tiny.apply(x).backward(g)
        x.grad = None
    print(f"torch floor: autograd.Function fwd+bwd, one tiny kernel each: {_us(tiny_step):.1f}")
    print(f"torch.empty (B, H, S, E): {_us(lambda: torch.empty(8, 16, 2048, 64, device='cuda')):.1f}")

    B, H, S, D = 8, 16, 2048, 64
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)
    mask = flexfa.create_block_mask(lambda b, h, qi, ki: qi >= ki, B, None, S, S, device="cuda")

    def step():
        flexfa.flex_attention(q, k, v, block_mask=mask).backward(do)
        q.grad = k.grad = v.grad = None
    print(f"flexfa causal fwd+bwd step: {_us(step, 50):.1f}")
    with torch.no_grad():
        print(f"flexfa causal forward (no grad): "
              f"{_us(lambda: flexfa.flex_attention(q, k, v, block_mask=mask), 100):.1f}")

    # each launch of the step, replayed: record (state, grid, device, args) per launch
    recorded = []
    original = launch.launch_direct

    def record(state, grid, device_index, args):
        recorded.append((state, grid, device_index, list(args)))
        return original(state, grid, device_index, args)
    hopper.launch_direct = backward.launch_direct = record
    step()
    hopper.launch_direct = backward.launch_direct = original
    torch.cuda.synchronize()
    for state, grid, device, args in recorded:
        compiled, tail = state.compiled, state.tail
        name = compiled.name
        grid3 = (*grid, 1) if len(grid) == 2 else grid
        stream = torch._C._cuda_getCurrentRawStream(device)
        full = [*args, *tail]
        direct_us = _us(lambda: original(state, grid, device, args))
        fast = state.c_launch is not None
        run_us = _us(lambda: compiled.run(*grid3, stream, compiled.function,
                                          compiled.packed_metadata, None, None, None, *full))
        inner = compiled.run.launch
        cells = [c.cell_contents for c in (getattr(inner, "__closure__", None) or ())]
        c_launch = next((c for c in cells if type(c).__name__ == "builtin_function_or_method"),
                        None)
        line = (f"{name[:40]:40} args {len(args):3}  launch_direct {direct_us:6.1f}  "
                f"CompiledKernel.run {run_us:6.1f}  (direct C launch: {fast})")
        if c_launch is not None:  # tensor-descriptor kernels: Triton wraps the C launch
            expanded = []
            captured = {}

            def capture(*final):
                captured["args"] = final
                return c_launch(*final)
            cell = next(c for c in inner.__closure__ if c.cell_contents is c_launch)
            cell.cell_contents = capture
            compiled.run(*grid3, stream, compiled.function, compiled.packed_metadata, None,
                         None, None, *full)
            cell.cell_contents = c_launch
            expanded = captured["args"]
            c_us = _us(lambda: c_launch(*expanded))
            line += f"  C launch alone {c_us:6.1f} ({len(expanded)} args)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
