"""Direct launches of compiled Triton kernels, for calls whose signature is already cached.

Triton's ``JITFunction.run`` binds and specializes every argument on each call; a caller
whose cache key fixes every specialization (shapes, strides, alignment, dtypes) can keep the
``CompiledKernel`` of its first launch and call its launcher directly, as ``JITFunction.run``
does after its binding. The Hopper forward's plans and the backward's plans use this.
"""
from __future__ import annotations

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor


def direct_state(kernel, compiled, args: list, constexprs: dict):
    """(compiled kernel, constexpr values in parameter order) for ``launch_direct``, from the
    first JIT launch ``kernel[grid](*args, **constexprs, ...)`` that returned ``compiled``;
    None when the parameters after ``args`` are not exactly the constexprs."""
    names = [p.name for p in kernel.params[len(args):]]
    if sorted(names) != sorted(constexprs):
        return None
    return compiled, tuple(constexprs[n] for n in names)


def launch_direct(state, grid: tuple, device_index: int, args: list) -> None:
    """Launch ``state``'s compiled kernel on ``grid`` (2 or 3 dims) on the current stream of
    CUDA device ``device_index`` (the current device) with ``args`` (the non-constexpr ones)."""
    compiled, tail = state
    grid = (*grid, 1) if len(grid) == 2 else grid
    hooks = triton.knobs.runtime
    stream = torch._C._cuda_getCurrentRawStream(device_index)
    args = [*args, *tail]
    compiled.run(*grid, stream, compiled.function, compiled.packed_metadata,
                 compiled.launch_metadata(grid, stream, *args),
                 hooks.launch_enter_hook, hooks.launch_exit_hook, *args)


class TrustedDescriptor(TensorDescriptor):
    """A TensorDescriptor whose checks (alignment, strides, block shape) ran when its plan was
    made, for a plan whose key fixes them: per call only the base tensor changes."""

    def __post_init__(self):
        pass


def cdiv(a: int, b: int) -> int:
    """Ceiling division of ints (``triton.cdiv`` is a JIT function: slow to call on the host)."""
    return -(-a // b)
