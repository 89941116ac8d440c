"""What a GPU launch of a plan's step would be compiled for, recorded under the interpreter.

On a GPU a plan's steps launch their first launch's compiled kernel directly
(``flexfa.runtime.launch.Step``), so the plan's key must fix every argument Triton
specializes a kernel on: an int equal to 1 (compiled as the constant) or divisible by 16, a
pointer's dtype and 16-byte alignment, a tensor descriptor's dtype and block, except the
kernel's ``do_not_specialize`` parameters.
The interpreter specializes nothing, so ``specialization_spy`` records, per step, the names of
the arguments whose specialization differs from the step's first launch's."""
from __future__ import annotations

import torch

from flexfa.runtime import launch


def specialization(value, unspecialized: bool):
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if hasattr(value, "block_shape") and hasattr(value, "base"):  # a tensor descriptor
        # its type (the base's dtype and the block) is compiled in; its shape and strides
        # are per launch (launch_direct encodes it again where they differ)
        return "desc", value.base.dtype, tuple(value.block_shape), value.base.data_ptr() % 16 == 0
    if isinstance(value, bool) or not isinstance(value, int) or unspecialized:
        return None
    return "one" if value == 1 else value % 16 == 0


def specialization_spy(monkeypatch) -> tuple[list, list[str]]:
    """(the steps launched, the names of the arguments a step launched with another
    specialization than at its first launch), from the interpreter's kernels' parameter
    names and ``do_not_specialize``."""
    first, launched, changed, real = {}, [], [], launch.Step.launch

    def spy(step, args, device, grid=None, stream=None):
        kernel = step.kernel
        kept = set(kernel.kwargs.get("do_not_specialize") or ())
        seen = tuple(specialization(a, n in kept) for n, a in zip(kernel.arg_names, args))
        known = first.setdefault((id(step), id(kernel)), seen)
        launched.append(repr(step))
        changed.extend(n for n, a, b in zip(kernel.arg_names, known, seen) if a != b)
        return real(step, args, device, grid, stream)
    monkeypatch.setattr(launch.Step, "launch", spy)
    return launched, changed
