"""Launching kernels: ``Step`` is the one launch path of every family; a cached plan's steps
launch their compiled kernels directly.

Triton's ``JITFunction.run`` binds and specializes every argument on each call; a caller
whose cache key fixes every specialization (shapes, strides, alignment, dtypes) can keep the
``CompiledKernel`` of its first launch and call its launcher directly, as ``JITFunction.run``
does after its binding. The Hopper forward's plans, the Ampere forward's direct launches
(``flexfa.runtime.forward._launch_cuda``) and the backward's plans use this.

Where Triton's CUDA launcher has the layout this module was written against (Triton 3.6: a C
``launch`` function, on sm_90 wrapped by a Python function that encodes each tensor
descriptor into a TMA descriptor on every call), ``launch_direct`` calls the C function itself
and keeps each encoded TMA descriptor per base address with the shape and strides it was
encoded for (the plan's key fixes the block, and most descriptors' shapes, but not the dS
workspace's rows, which follow the tables' contents), so the same address, shape and strides
give the same 128-byte descriptor, which the launch copies by value; without launch hooks (a
profiler's) it passes no launch metadata.
Anything else (another layout, hooks, scratch memory) takes Triton's own launcher.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from ..errors import InputError

_MAX_DESCRIPTORS = 16  # encoded TMA descriptors kept per descriptor argument of a plan


@dataclasses.dataclass
class DirectState:
    """A cached plan's compiled kernel: ``tail`` (constexpr values in parameter order) and,
    where the fast path applies, the C launch function (``c_launch``) with the positions of
    the tensor-descriptor arguments, their Triton metadata and encoded-descriptor caches."""

    compiled: object
    tail: tuple
    c_launch: object = None
    # (argument position, metadata, {base address: (shape, strides, encoded descriptor)})
    descriptors: tuple = ()
    prefix: tuple = ()  # (cooperative grid, PDL, global scratch, profile scratch, metadata)


def direct_state(kernel, compiled, args: list, constexprs: dict) -> DirectState | None:
    """The state for ``launch_direct`` from the first JIT launch ``kernel[grid](*args,
    **constexprs, ...)`` that returned ``compiled``; None when the parameters after ``args``
    are not exactly the constexprs."""
    names = [p.name for p in kernel.params[len(args):]]
    if sorted(names) != sorted(constexprs):
        return None
    state = DirectState(compiled, tuple(constexprs[n] for n in names))
    _attach_c_launch(state, len(args))
    return state


def _attach_c_launch(state: DirectState, n_args: int) -> None:
    """Fill ``c_launch`` and ``descriptors`` when the launcher is Triton 3.6's CudaLauncher
    without scratch memory; leave them empty (Triton's launcher) otherwise."""
    launcher = getattr(state.compiled, "_run", None)
    launch = getattr(launcher, "launch", None)
    if launch is None or getattr(launcher, "global_scratch_size", 1) or \
            getattr(launcher, "profile_scratch_size", 1) or not _known_c_arguments():
        return
    code = getattr(launch, "__code__", None)
    descriptors = ()
    if code is not None:  # Python: the tensor-descriptor wrapper around the C function
        if code.co_freevars != ("launcher", "tensordesc_indices", "tensordesc_meta"):
            return
        cells = dict(zip(code.co_freevars, (c.cell_contents for c in launch.__closure__)))
        indices, metas = sorted(cells["tensordesc_indices"]), cells["tensordesc_meta"]
        if any(m is None for m in metas) or indices[-1:] >= [n_args]:
            return  # descriptors lowered to pointers, or a descriptor among the constexprs
        descriptors = tuple((i, meta, {}) for i, meta in zip(indices, metas))
        launch = cells["launcher"]
        if getattr(launch, "__code__", None) is not None:
            return
    state.c_launch = launch
    state.descriptors = descriptors
    state.prefix = (launcher.launch_cooperative_grid, launcher.launch_pdl, None, None,
                    state.compiled.packed_metadata, None, None, None)


def _known_c_arguments() -> bool:
    """The C launch function takes the leading arguments ``prefix`` is built for: grid (3),
    stream, function, cooperative grid, PDL, two scratch buffers, kernel metadata, launch
    metadata and two hooks (Triton 3.6's ``_BASE_ARGS_FORMAT``)."""
    from triton.backends.nvidia import driver

    return getattr(driver, "_BASE_ARGS_FORMAT", None) == "iiiKKppOOOOOO"


def _encoded(desc: TensorDescriptor, meta: dict, cache: dict) -> list:
    """[TMA descriptor, *shape, *strides] of ``desc``, as Triton's launcher expands it; cached
    by base address with the shape and strides it was encoded for (``launch_direct`` reuses
    an entry only for the same ones: a plan's key fixes the block, not every descriptor's
    shape: the dS workspace's rows follow the tables' contents, and a larger workspace may
    come back at the address of the last one)."""
    from triton.backends.nvidia import driver

    expanded = driver.make_tensordesc_arg(desc, meta)
    if len(cache) >= _MAX_DESCRIPTORS:
        cache.clear()
    cache[desc.base.data_ptr()] = (desc.shape[:], desc.strides[:], expanded)
    return expanded


def _no_hooks(hooks) -> bool:
    """No launch hooks: each None, or (Triton 3.6) an empty HookChain, which Triton's launcher
    would still build launch metadata for and call twice per launch."""
    enter, leave = hooks.launch_enter_hook, hooks.launch_exit_hook
    return ((enter is None or getattr(enter, "calls", None) == [])
            and (leave is None or getattr(leave, "calls", None) == []))


def ensure_allocator() -> None:
    """A kernel that needs global scratch memory (device-side TMA descriptors; every kernel
    under Triton's concurrency sanitizer) asks ``triton.set_allocator``'s allocator, a context
    variable: the autograd engine's device threads, where backward kernels launch, start with
    Triton's null allocator, which raises. Set one allocating torch memory on the current
    device (a launch's) where none is set; a user's own allocator stays."""
    from triton.runtime import _allocation

    current = _allocation._allocator.get()
    if isinstance(current, _allocation.NullAllocator):
        triton.set_allocator(lambda size, alignment, stream: torch.empty(
            size, dtype=torch.int8, device="cuda"))


def launch_direct(state: DirectState, grid: tuple, device_index: int, args: list,
                  stream=None) -> None:
    """Launch ``state``'s compiled kernel on ``grid`` (1 to 3 dims) on ``stream`` (a
    torch.cuda.Stream; None: the current stream) of CUDA device ``device_index`` (the current
    device) with ``args`` (the non-constexpr ones)."""
    compiled = state.compiled
    grid = (*grid, 1, 1)[:3]  # the C launcher takes exactly three grid dims
    hooks = triton.knobs.runtime
    raw = (torch._C._cuda_getCurrentRawStream(device_index) if stream is None
           else stream.cuda_stream)
    if state.c_launch is not None and _no_hooks(hooks):
        final = [*grid, raw, compiled.function, *state.prefix]
        start = 0
        for position, meta, cache in state.descriptors:
            final += args[start:position]
            desc = args[position]
            entry = cache.get(desc.base.data_ptr())  # the common case, without a call
            final += (entry[2] if entry is not None and entry[0] == desc.shape
                      and entry[1] == desc.strides else _encoded(desc, meta, cache))
            start = position + 1
        final += args[start:]
        final += state.tail
        state.c_launch(*final)
        return
    args = [*args, *state.tail]
    if getattr(getattr(compiled, "_run", None), "global_scratch_size", 1):
        ensure_allocator()
    # with the launch's stream current: Triton's launcher takes scratch memory from the
    # allocator, torch memory of the current stream freed as the launch returns; on another
    # stream than the kernel's, that memory could be handed out again while the kernel runs
    with contextlib.nullcontext() if stream is None else torch.cuda.stream(stream):
        compiled.run(*grid, raw, compiled.function, compiled.packed_metadata,
                     compiled.launch_metadata(grid, raw, *args),
                     hooks.launch_enter_hook, hooks.launch_exit_hook, *args)


class TrustedDescriptor(TensorDescriptor):
    """A TensorDescriptor whose checks (alignment, strides, block shape) ran when its plan was
    made, for a plan whose key fixes them: per call only the base tensor changes (made on every
    cached call: no dataclass __init__ and __post_init__)."""

    def __init__(self, base, shape, strides, block_shape, padding="zero"):
        self.base, self.shape, self.strides = base, shape, strides
        self.block_shape, self.padding = block_shape, padding


# CUDA's limit on a grid's y and z sizes (x goes to 2**31 - 1), for the runtime's kernels that
# put kv blocks there (flexfa.inputs checks the (batch, head) pairs against its own
# MAX_CUDA_PROGRAM_ROWS: importing this module loads Triton, which `import flexfa` must not)
MAX_GRID_Y = 65535


def cdiv(a: int, b: int) -> int:
    """Ceiling division of ints (``triton.cdiv`` is a JIT function: slow to call on the host)."""
    return -(-a // b)


# CUDA's largest grid: 2**31 - 1 programs along x, 65535 along y and z (a launch past them
# fails inside Triton with an invalid-argument error; the interpreter would run it)
GRID_LIMITS = (2 ** 31 - 1, 65535, 65535)


def check_grid(kernel, grid) -> None:
    """An InputError where ``grid`` (a tuple of program counts) passes CUDA's limits, on
    every device alike: a call's batch * heads or q tiles lie along y or z in most kernels."""
    if not isinstance(grid, tuple):
        return
    for axis, (count, limit) in enumerate(zip(grid, GRID_LIMITS)):
        if count > limit:
            raise InputError(
                f"this call needs a launch grid of {tuple(grid)} programs for "
                f"{_kernel_name(kernel)}, {count} along {'xyz'[axis]}, past CUDA's {limit} "
                "there (the grids put batch * heads, or the query tiles, along y): split the "
                "batch or the heads over calls")


def _kernel_name(kernel) -> str:
    return getattr(kernel, "__name__", None) or getattr(
        getattr(kernel, "fn", None), "__name__", "kernel")


class Step:
    """One kernel launch of a plan: the kernel, its grid, constexprs and launch options.

    ``launch(args, device)``: on the CPU through the interpreter; on a GPU, the first launch
    through Triton (which compiles and checks), then the compiled kernel directly
    (``launch_direct``): the plan's key fixes every specialization Triton makes."""

    __slots__ = ("kernel", "grid", "constexprs", "options", "binder", "direct", "launched")

    def __init__(self, kernel, grid: tuple, constexprs: dict, options: dict, binder=None):
        check_grid(kernel, grid)
        self.kernel, self.grid = kernel, grid
        self.constexprs, self.options = constexprs, options
        self.binder = binder  # the kernel's arguments by name (flexfa.runtime.binding)
        self.direct: DirectState | None = None
        self.launched = False  # a first launch ran: descriptors may skip their checks

    def launch_with(self, values: dict, device, grid: tuple | None = None) -> None:
        """Launch with the arguments ``values`` names (the rest fixed by the plan); ``grid``:
        this launch's grid instead of the plan's (a kernel launched over parts of a call)."""
        self.launch(self.binder.bind(values), device, grid)

    def launch(self, args: list, device, grid: tuple | None = None, stream=None) -> None:
        """Launch with the bound ``args``; ``stream``: a torch.cuda.Stream to launch on (None:
        the current stream; the launch does not make it current: no stream context per
        launch where a call launches on two streams in turn)."""
        if grid is None:
            grid = self.grid
        else:
            check_grid(self.kernel, grid)
        if device.type != "cuda":
            self.kernel[grid](*args, **self.constexprs, **self.options)
            self.launched = True
            return
        if self.direct is not None and device.index == torch.cuda.current_device():
            launch_direct(self.direct, grid, device.index, args, stream)
            return
        ensure_allocator()
        with torch.cuda.device(device), (contextlib.nullcontext() if stream is None
                                         else torch.cuda.stream(stream)):
            compiled = self.kernel[grid](*args, **self.constexprs, **self.options)
        self.direct = direct_state(self.kernel, compiled, args, self.constexprs)
        self.launched = True

    def __repr__(self) -> str:
        return f"Step({_kernel_name(self.kernel)}, grid={self.grid})"
