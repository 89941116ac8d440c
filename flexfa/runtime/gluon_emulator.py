"""Runs flexfa's generated Gluon kernels on CPU tensors: the sm_90 source as the GPU compiles
it, executed through the Triton interpreter with Gluon's hardware pieces written out here.

The Triton interpreter runs ``@triton.jit`` code on numpy but knows nothing of Gluon. This
module loads a generated Gluon module with ``gluon.jit`` read as the interpreter's ``jit`` and
``gl``, the Hopper ``tma``, ``mbarrier`` and ``warpgroup_mma`` names bound to emulations:

- distributed layouts are bookkeeping only: a register tensor is the interpreter's tensor
  whatever its layout (``convert_layout`` returns its input);
- shared memory is a numpy array per allocation; ``index``, ``slice``, ``permute`` and
  ``reshape`` are views of it, so a store through one view is read through another;
- an mbarrier counts arrivals and expected transaction bytes and completes phases as the
  hardware does (a fresh barrier has completed phase "-1", parity 1);
- a TMA load is queued on its barrier and lands (the box read with zero fill past the
  tensor's shape, the barrier's bytes completed) only when a partition waits for the phase
  it completes: a partition that reads the buffer without that wait (none, or one for a
  phase already past) reads stale data, as it could on a GPU;
- a TMA store or reduce-add inside a warp-specialized region reads its shared memory only
  when ``tma.store_wait`` retires it; a store or TMA load into that shared memory before
  then raises ``GluonRace`` (a buffer rewritten before the TMA read it), and so does a
  partition that ends with one in flight (the program's shared memory may be gone, or
  another program's, when the TMA reads it);
- ``warpgroup_mma`` multiplies in float32 (16-bit and fp8 inputs are exact in float32); an
  asynchronous one is formed only when ``warpgroup_mma_wait`` retires it, and a TMA load
  issued or a store made into shared memory it reads before then raises ``GluonRace`` (a
  buffer released before the wgmma reading it retired);
- ``gl.warp_specialize`` runs each partition in its own thread, one at a time: a partition runs
  until it waits on a barrier phase that has not completed, and after each of its arrivals
  the others run as far as they can (each until it waits or yields); a wait that no partition
  can ever complete (every live partition waiting, nothing queued) raises ``GluonDeadlock``
  naming the barriers instead of hanging;
- the kernels' inline PTX is replaced by exact equivalents (``tanh.approx.f32`` by tanh, the
  ``%ctaid`` reads by the program ids, ``mov.b32`` by its input);
- a ``range()`` loop in a kernel yields int32 tensors, as a compiled loop's variable is
  (``gl.static_range`` stays Python ints).

What it checks: a kernel's index arithmetic, its data flow through shared memory and its
barrier protocol in the interleavings its scheduling produces, against the float64
reference at small shapes (tests/kernels/test_gluon_emulated.py; mistakes written into the
templates fail there: tests/reliability/test_gluon_emulator.py). What it does not: register
pressure, the hardware's layouts and swizzles, and any speed. Triton's integer ``//`` and
``%`` semantics are the interpreter's.
"""
from __future__ import annotations

import builtins
import linecache
import threading
import types

import numpy as np
import torch
import triton.language as tl
from triton.runtime import interpreter as interp

from ..codegen.template import INTERPRETED_FLAGS
from ..loader import (INTERPRETER_LOCK, check_interpreter_numpy, interpret_mode, keep_rewritten,
                      serialized)

# seconds a partition may wait for another's progress before the emulation gives up (a
# partition computing a tile between two barrier operations takes well under a second)
WAIT_TIMEOUT = 120.0


class GluonDeadlock(RuntimeError):
    """Every live partition of a warp-specialized region waits on a barrier phase that none
    of them can complete."""


# ---------------------------------------------------------------------------------------
# values


def _value(x):
    """A Python scalar from a constexpr, a scalar tensor or a Python value."""
    if isinstance(x, tl.constexpr):
        x = x.value
    if isinstance(x, tl.tensor):
        return x.handle.data.reshape(-1)[0].item()
    return x


def _tensor(data: np.ndarray, dtype) -> tl.tensor:
    """An interpreter tensor of ``data`` (the interpreter's storage: bf16 as uint16, fp8 as
    uint8) with element type ``dtype``."""
    data = np.ascontiguousarray(data)
    return tl.tensor(interp.TensorHandle(data, dtype), tl.block_type(dtype, list(data.shape)))


def _storage_dtype(dtype) -> np.dtype:
    return interp._get_np_dtype(dtype)


def _as_float32(data: np.ndarray, dtype) -> np.ndarray:
    """The values of interpreter storage ``data`` of element type ``dtype`` as float32."""
    if dtype == tl.bfloat16:
        return (data.astype(np.uint32) << 16).view(np.float32)
    if dtype.is_fp8():
        return interp._convert_float(data, dtype, tl.float16, None).view(np.float16) \
            .astype(np.float32)
    return data.astype(np.float32)


_TORCH_TO_TL = {torch.float32: tl.float32, torch.float16: tl.float16,
                torch.bfloat16: tl.bfloat16, torch.float8_e4m3fn: tl.float8e4nv,
                torch.float8_e5m2: tl.float8e5, torch.int32: tl.int32, torch.int64: tl.int64}


def _from_torch(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values in the interpreter's storage (a copy)."""
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16).copy()
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8).numpy().copy()
    return t.numpy().copy()


def _to_torch(data: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    data = np.ascontiguousarray(data)
    if dtype == torch.bfloat16:
        return torch.from_numpy(data.view(np.int16)).view(torch.bfloat16)
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return torch.from_numpy(data.view(np.uint8)).view(dtype)
    return torch.from_numpy(data)


# ---------------------------------------------------------------------------------------
# layouts: accepted and ignored


class _Layout:
    """Any Gluon layout: its arguments are kept for reading, nothing depends on them."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    @classmethod
    def get_default_for(cls, *args, **kwargs):
        return cls(*args, **kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(...)"


def _layout(name: str) -> type:
    return type(name, (_Layout,), {})


class MBarrierLayout(_Layout):
    pass


# ---------------------------------------------------------------------------------------
# warp-specialized regions and mbarriers


class _Region:
    """The partitions of one gl.warp_specialize: they run one at a time, each holding
    ``cv``'s lock; a partition whose wait cannot pass yet releases it in ``cv.wait``."""

    def __init__(self, partitions: int):
        self.cv = threading.Condition()
        self.alive = partitions
        self.waiting: dict[str, str] = {}  # partition -> what it waits for, since the last change
        self.error: BaseException | None = None
        self.yielding: set[str] = set()  # partitions letting the others run (_yield)

    def changed(self) -> None:
        """A barrier moved: every waiter checks again."""
        self.waiting.clear()
        self.cv.notify_all()

    def others_stopped(self) -> bool:
        """Whether every other live partition waits on a barrier or yields."""
        me = threading.current_thread().name
        return len((set(self.waiting) | self.yielding) - {me}) >= self.alive - 1


_LOCAL = threading.local()


def _region() -> _Region | None:
    return getattr(_LOCAL, "region", None)


def _changed() -> None:
    region = _region()
    if region is not None:
        region.changed()


class Barrier:
    """One mbarrier: ``count`` arrivals and the expected transaction bytes complete a phase;
    ``phases`` completed so far; TMA loads queued on it land when a partition waits on it."""

    def __init__(self, name: str):
        self.name = name
        self.count = None
        self.pending = 0
        self.tx = 0
        self.phases = 0
        self.queued: list = []

    def init(self, count: int) -> None:
        self.count, self.pending, self.tx, self.phases, self.queued = count, count, 0, 0, []

    def _check_init(self) -> None:
        if self.count is None:
            raise RuntimeError(f"mbarrier {self.name} used before mbarrier.init")

    def arrive(self, count: int = 1) -> None:
        self._check_init()
        self.pending -= count
        if self.pending < 0:
            raise RuntimeError(f"mbarrier {self.name}: {-self.pending} arrivals past its count "
                               f"{self.count} in one phase")
        self._complete()

    def expect(self, nbytes: int) -> None:
        self._check_init()
        self.tx += nbytes
        self.arrive(1)

    def transferred(self, nbytes: int) -> None:
        self.tx -= nbytes
        self._complete()

    def _complete(self) -> None:
        if self.pending == 0 and self.tx == 0:
            self.phases += 1
            self.pending = self.count
        _changed()

    def land(self) -> None:
        """Complete the TMA loads queued on this barrier."""
        queued, self.queued = self.queued, []
        for copy in queued:
            copy.land()

    def passed(self, parity: int) -> bool:
        """Whether a wait for ``parity`` passes: the barrier's current phase (``phases``
        completed) has the other parity."""
        return self.phases % 2 != parity


def _barrier(smem) -> Barrier:
    cell = smem.data.reshape(-1)
    if cell.size != 1 or not isinstance(cell[0], Barrier):
        raise TypeError(f"expected one mbarrier, got shared memory of shape {smem.shape}")
    return cell[0]


def _wait(bar: Barrier, parity: int) -> None:
    # the loads queued on the barrier land only when a wait needs them: a wait for a phase
    # that has completed already passes with the buffers as they are
    if bar.passed(parity):
        return
    bar.land()
    if bar.passed(parity):
        return
    region = _region()
    if region is None:
        raise GluonDeadlock(f"a wait for parity {parity} on mbarrier {bar.name} outside "
                            "gl.warp_specialize never passes (it has completed "
                            f"{bar.phases} phases)")
    me = threading.current_thread().name
    while not bar.passed(parity):
        if region.error is not None:
            raise GluonDeadlock("another partition failed") from region.error
        region.waiting[me] = f"{bar.name} parity {parity} (phases {bar.phases})"
        if len(region.waiting) >= region.alive:
            region.error = GluonDeadlock("every partition waits forever: " + "; ".join(
                f"{who} on {what}" for who, what in sorted(region.waiting.items())))
            region.cv.notify_all()
            raise region.error
        region.cv.notify_all()  # a partition yielding (_yield) may go on
        if not region.cv.wait(WAIT_TIMEOUT):
            region.error = GluonDeadlock(f"{me} waited {WAIT_TIMEOUT} s on {bar.name}")
            raise region.error
        region.waiting.pop(me, None)
        bar.land()


def _yield() -> None:
    """After an arrival: the other partitions run as far as they can (until each waits on a
    barrier or yields too) before this one goes on, so that what a partition does after
    releasing a buffer (a wgmma not yet retired reading it) meets the refill a producer
    issues at once, as it can on a GPU."""
    region = _region()
    if region is None:
        return
    me = threading.current_thread().name
    region.yielding.add(me)
    try:
        region.cv.notify_all()
        while not region.others_stopped() and region.error is None:
            if not region.cv.wait(WAIT_TIMEOUT):
                break
    finally:
        region.yielding.discard(me)
        region.cv.notify_all()


def _arrive(bar, count=1, pred=True) -> None:
    if _value(pred):
        _barrier(bar).arrive(_value(count))
        _yield()


def warp_specialize(functions_and_args, worker_num_warps, worker_num_regs):
    """The partitions, each in its own thread, one running at a time; returns the default
    partition's results."""
    if _region() is not None:
        raise RuntimeError("gl.warp_specialize inside a warp-specialized region")
    region = _Region(len(functions_and_args))
    results = {}
    _READERS.clear()  # (a kernel may leave some in flight at its end)

    def run(index, fn, args):
        _LOCAL.region, _LOCAL.wgmmas, _LOCAL.stores = region, [], []
        with region.cv:
            try:
                results[index] = fn(*args)
                _check_no_stores_in_flight()
            except BaseException as exc:  # reported by the default partition's thread
                if region.error is None:
                    region.error = exc
            finally:
                region.alive -= 1
                region.waiting.pop(threading.current_thread().name, None)
                region.cv.notify_all()
        _LOCAL.region = None

    workers = [threading.Thread(target=run, args=(i, fn, tuple(args)), daemon=True,
                                name=f"partition {i} ({getattr(fn, '__name__', fn)})")
               for i, (fn, args) in enumerate(functions_and_args) if i > 0]
    for thread in workers:
        thread.start()
    default_fn, default_args = functions_and_args[0]
    run(0, default_fn, tuple(default_args))
    for thread in workers:
        thread.join(WAIT_TIMEOUT)
        if thread.is_alive():
            raise GluonDeadlock(f"{thread.name} did not finish")
    if region.error is not None:
        raise region.error
    return results.get(0)


# ---------------------------------------------------------------------------------------
# shared memory


class SharedMemory:
    """A shared-memory descriptor: a numpy view (of the interpreter's storage) and its
    element type; mbarrier allocations hold Barrier objects."""

    def __init__(self, data: np.ndarray, dtype):
        self.data, self.dtype = data, dtype

    @property
    def shape(self) -> list[int]:
        return list(self.data.shape)

    @property
    def type(self):
        return tl.block_type(self.dtype, self.shape)

    @property
    def nbytes(self) -> int:
        return self.data.size * self.dtype.primitive_bitwidth // 8

    def index(self, i) -> "SharedMemory":
        return SharedMemory(self.data[_value(i)], self.dtype)

    def slice(self, start, length, dim=0) -> "SharedMemory":
        start, length, dim = _value(start), _value(length), _value(dim)
        index = [slice(None)] * self.data.ndim
        index[dim] = slice(start, start + length)
        view = self.data[tuple(index)]
        if any(n <= 0 or n & (n - 1) for n in view.shape):  # as Triton's compiler refuses
            raise ValueError(f"a shared-memory slice must have power-of-2 and non-zero "
                             f"dimensions; got {list(view.shape)}")
        return SharedMemory(view, self.dtype)

    def permute(self, order) -> "SharedMemory":
        return SharedMemory(self.data.transpose([_value(o) for o in order]), self.dtype)

    def reshape(self, shape) -> "SharedMemory":
        shape = [_value(s) for s in shape]
        view = self.data.view()
        view.shape = shape  # raises where a copy would be needed: a view must stay a view
        return SharedMemory(view, self.dtype)

    def _reinterpret(self, dtype, shape, layout) -> "SharedMemory":
        view = self.data.view(_storage_dtype(dtype))
        view.shape = [_value(s) for s in shape]
        return SharedMemory(view, dtype)

    def load(self, layout=None) -> tl.tensor:
        return _tensor(self.data.copy(), self.dtype)

    def store(self, value) -> None:
        _check_unread(self, "a store")
        if value.dtype != self.dtype:
            raise TypeError(f"storing {value.dtype} into {self.dtype} shared memory")
        data = value.handle.data
        if list(data.shape) != self.shape:
            raise ValueError(f"storing a {list(data.shape)} tensor into {self.shape} shared "
                             "memory")
        self.data[...] = data

    def _keep_alive(self) -> None:
        pass


_BARRIERS = iter(range(1 << 62))


def allocate_shared_memory(element_ty, shape, layout, value=None) -> SharedMemory:
    shape = [_value(s) for s in shape]
    if isinstance(layout, MBarrierLayout):
        cells = np.empty(shape, dtype=object)
        for i, _ in np.ndenumerate(cells):
            cells[i] = Barrier(f"#{next(_BARRIERS)}{list(i)}")
        return SharedMemory(cells, element_ty)
    smem = SharedMemory(np.zeros(shape, dtype=_storage_dtype(element_ty)), element_ty)
    if value is not None:
        smem.store(value)
    return smem


# ---------------------------------------------------------------------------------------
# asynchronous readers of shared memory (wgmmas, TMA stores)


class GluonRace(RuntimeError):
    """Shared memory written (a TMA load issued into it, a store) while an asynchronous
    operation that reads it (a wgmma, a TMA store) is in flight, or a partition ended with a
    TMA store in flight."""


# the asynchronous operations in flight that read shared memory (every partition's; reset
# per warp-specialized region)
_READERS: set = set()


class _Reader:
    """An asynchronous operation reading the shared memory ``reads`` until retired; a write
    into that memory before then raises GluonRace."""

    WHAT = HINT = ""

    def __init__(self, reads: list):
        self.reads = reads
        _READERS.add(self)

    def retire(self):
        _READERS.discard(self)


def _check_unread(smem: "SharedMemory", what: str) -> None:
    """GluonRace if an operation in flight reads any of ``smem``."""
    for pending in list(_READERS):
        if any(np.may_share_memory(smem.data, read) for read in pending.reads):
            raise GluonRace(f"{what} into shared memory that {pending.WHAT} in flight reads "
                            f"(shape {smem.shape}, {threading.current_thread().name})"
                            f"{pending.HINT}")


def _pending(kind: str) -> list:
    """The calling partition's operations of ``kind`` in flight, oldest first."""
    if not hasattr(_LOCAL, kind):
        setattr(_LOCAL, kind, [])
    return getattr(_LOCAL, kind)


def _retire_oldest(pending: list, keep: int) -> None:
    """Retire all but the ``keep`` newest of ``pending`` (oldest first)."""
    retired = pending[:len(pending) - keep] if keep else list(pending)
    for operation in retired:
        operation.retire()
    del pending[:len(retired)]


# ---------------------------------------------------------------------------------------
# TMA


class Descriptor:
    """The kernel's view of a host TensorDescriptor (gluon.nvidia.hopper): its box reads
    with zero fill past the shape, its writes and reduce-adds dropped there."""

    def __init__(self, host):
        self.base = host.base
        self.shape = [int(s) for s in host.shape]
        self.strides = [int(s) for s in host.strides]
        self.block_shape = [int(b) for b in host.block_shape]
        self.layout = host.layout
        self.dtype = _TORCH_TO_TL[self.base.dtype]
        self.block_type = tl.block_type(self.dtype, self.block_shape)

    def _view(self) -> torch.Tensor:
        return torch.as_strided(self.base, self.shape, self.strides,
                                self.base.storage_offset())

    def _ranges(self, coord) -> tuple[tuple, tuple]:
        """(box indices inside the tensor, tensor indices) per dim for a box at ``coord``."""
        box, src = [], []
        for c, b, n in zip((_value(c) for c in coord), self.block_shape, self.shape):
            lo, hi = max(c, 0), min(c + b, n)
            hi = max(hi, lo)
            box.append(slice(lo - c, hi - c))
            src.append(slice(lo, hi))
        return tuple(box), tuple(src)

    def read(self, coord) -> np.ndarray:
        out = np.zeros(self.block_shape, dtype=_storage_dtype(self.dtype))
        box, src = self._ranges(coord)
        out[box] = _from_torch(self._view()[src])
        return out

    def write(self, coord, data: np.ndarray, add: bool = False) -> None:
        box, src = self._ranges(coord)
        view = self._view()
        value = _to_torch(np.ascontiguousarray(data.reshape(self.block_shape)[box]),
                          self.base.dtype)
        with torch.no_grad():
            if add:
                view[src] += value
            else:
                view[src] = value


def _descriptor(desc) -> Descriptor:
    if isinstance(desc, Descriptor):
        return desc
    raise TypeError(f"expected a tensor descriptor argument, got {type(desc).__name__}")


class _Copy:
    """A TMA load issued and not yet landed."""

    def __init__(self, desc: "Descriptor", coord: list, bar: Barrier, result: SharedMemory):
        self.desc, self.coord, self.bar, self.result = desc, coord, bar, result
        self.landed = False

    def land(self) -> None:
        if not self.landed:
            self.landed = True
            self.result.data[...] = self.desc.read(self.coord).reshape(self.result.data.shape)
            self.bar.transferred(self.result.nbytes)


def _tma_load(desc, coord, barrier, result, pred=True) -> None:
    if not _value(pred):
        return
    _check_unread(result, "a TMA load")
    copy = _Copy(_descriptor(desc), [_value(c) for c in coord], _barrier(barrier), result)
    copy.bar.queued.append(copy)


class _Store(_Reader):
    """A TMA store or reduce-add issued and not yet retired by ``tma.store_wait``: it reads
    ``src`` (and writes global memory) when retired."""

    WHAT, HINT = "a TMA store", ": tma.store_wait first"

    def __init__(self, desc: Descriptor, coord: list, src: SharedMemory, add: bool):
        super().__init__([src.data])
        self.desc, self.coord, self.src, self.add = desc, coord, src, add

    def retire(self) -> None:
        super().retire()
        self.desc.write(self.coord, self.src.data, add=self.add)


def _issue_store(desc, coord, src, add: bool) -> None:
    desc, coord = _descriptor(desc), [_value(c) for c in coord]
    if _region() is None:  # outside a warp-specialized region: written at once
        desc.write(coord, src.data, add=add)
    else:
        _pending("stores").append(_Store(desc, coord, src, add))


def _tma_store(desc, coord, src) -> None:
    _issue_store(desc, coord, src, False)


def _tma_reduce_add(tensor_desc, coord, src, _semantic=None) -> None:
    _issue_store(tensor_desc, coord, src, True)


def _check_no_stores_in_flight() -> None:
    """GluonRace if the calling partition ends with TMA stores it never waited for."""
    pending = _pending("stores")
    if pending:
        raise GluonRace(f"{threading.current_thread().name} ended with {len(pending)} TMA "
                        f"store(s) in flight: tma.store_wait(0) before a partition ends")


def _store_wait(pendings) -> None:
    """Retire all but the ``pendings`` newest TMA stores of this partition."""
    _retire_oldest(_pending("stores"), _value(pendings))


# ---------------------------------------------------------------------------------------
# wgmma


def _operand(x) -> np.ndarray:
    if isinstance(x, SharedMemory):
        return _as_float32(x.data, x.dtype)
    return _as_float32(x.handle.data, x.dtype)


class InFlight(_Reader):
    """An asynchronous wgmma not yet retired: its product is formed when a
    warpgroup_mma_wait retires it, from the shared memory as it is then; meanwhile a write
    into the shared memory it reads raises GluonRace (a buffer released before its wgmma
    retired and refilled). It is no tensor until retired (using it as one fails)."""

    WHAT = "a wgmma"

    def __init__(self, compute, reads: list):
        super().__init__(reads)
        self._compute, self._value = compute, None

    def retire(self) -> tl.tensor:
        if self._value is None:
            super().retire()
            self._value = self._compute()
        return self._value


def warpgroup_mma(a, b, acc, *, use_acc=True, precision=None, max_num_imprecise_acc=None,
                  is_async=False):
    use = _value(use_acc)

    def compute() -> tl.tensor:
        base = acc.retire() if isinstance(acc, InFlight) else acc
        product = np.matmul(_operand(a), _operand(b))
        if use:
            product = product + _as_float32(base.handle.data, base.dtype)
        return _tensor(product.astype(_storage_dtype(base.dtype)), base.dtype)
    if not _value(is_async):
        return compute()
    pending = InFlight(compute, [x.data for x in (a, b) if isinstance(x, SharedMemory)])
    _pending("wgmmas").append(pending)
    return pending


def warpgroup_mma_wait(num_outstanding=0, deps=None):
    """Retire all but the ``num_outstanding`` newest wgmmas of this partition; ``deps`` come
    back as tensors where retired (one still in flight stays an InFlight)."""
    if deps is None:
        raise ValueError("warpgroup_mma_wait deps must be given")
    flight = _pending("wgmmas")
    _retire_oldest(flight, _value(num_outstanding))
    done = [d.retire() if isinstance(d, InFlight) and d not in flight else d for d in deps]
    return done[0] if len(done) == 1 else tuple(done)


# ---------------------------------------------------------------------------------------
# inline PTX


def inline_asm_elementwise(asm, constraints, args, dtype, is_pure, pack, _semantic=None,
                           **kwargs):
    """The kernels' inline PTX, exactly: each string flexfa's templates emit, else an
    error naming it."""
    asm = _value(asm)
    args = list(args)
    if asm.startswith("tanh.approx.f32"):
        x = args[0]
        return _tensor(np.tanh(_as_float32(x.handle.data, x.dtype)), tl.float32)
    if asm == "mov.b32 $0, $1;":
        return args[0]
    if asm == "mov.u32 $0, %ctaid.x;\n\tmov.u32 $1, %ctaid.z;":
        return tl.program_id(0), tl.program_id(2)
    raise NotImplementedError(f"the Gluon emulator has no equivalent of inline PTX {asm!r}")


# ---------------------------------------------------------------------------------------
# the namespaces a generated module imports


class _Forward(types.ModuleType):
    """A module whose missing names are read from ``base`` when looked up (so that the
    interpreter's patches of triton.language, made at launch, are the ones called)."""

    def __init__(self, name: str, base, **names):
        super().__init__(name)
        self.__dict__["_base"] = base
        self.__dict__.update(names)

    def __getattr__(self, name):
        return getattr(self.__dict__["_base"], name)


def _runtime_range(*args):
    """range() in kernel code: the values as int32 scalar tensors."""
    for i in builtins.range(*(_value(a) for a in args)):
        yield tl.tensor(interp.TensorHandle(np.array([i], dtype=np.int32), tl.int32), tl.int32)


def _language() -> types.ModuleType:
    """``gl``: triton.language's functions without their layout arguments, Gluon's own
    pieces emulated; the rest (static_range, static_assert, ...) is triton.language's as the
    interpreter patches it for a launch."""
    def arange(start, end, layout=None):
        return tl.arange(start, end)

    def full(shape, value, dtype, layout=None):
        return tl.full(shape, value, dtype)

    def zeros(shape, dtype, layout=None):
        return tl.full(shape, 0, dtype)

    def convert_layout(value, layout, assert_trivial=False):
        return value

    names = dict(
        arange=arange, full=full, zeros=zeros, convert_layout=convert_layout,
        allocate_shared_memory=allocate_shared_memory, warp_specialize=warp_specialize,
        thread_barrier=lambda: None, inline_asm_elementwise=inline_asm_elementwise,
        MBarrierLayout=MBarrierLayout,
        **{name: _layout(name) for name in (
            "BlockedLayout", "SliceLayout", "NVMMADistributedLayout", "DotOperandLayout",
            "DistributedLinearLayout", "SwizzledSharedLayout", "NVMMASharedLayout",
            "AutoLayout", "CoalescedLayout", "PaddedSharedLayout", "SharedLinearLayout")})
    return _Forward("flexfa_gluon_emulated_language", tl, **names)


def _hopper() -> types.ModuleType:
    mbarrier = types.SimpleNamespace(
        MBarrierLayout=MBarrierLayout,
        init=lambda bar, count: _barrier(bar).init(_value(count)),
        invalidate=lambda bar: None,
        expect=lambda bar, nbytes, pred=True: (
            _barrier(bar).expect(_value(nbytes)) if _value(pred) else None),
        arrive=lambda bar, *, count=1, pred=True: _arrive(bar, count, pred),
        wait=lambda bar, phase, pred=True, deps=(): (
            _wait(_barrier(bar), _value(phase)) if _value(pred) else None))
    tma = types.SimpleNamespace(async_copy_global_to_shared=_tma_load,
                                async_copy_shared_to_global=_tma_store,
                                store_wait=_store_wait)
    module = types.ModuleType("flexfa_gluon_emulated_hopper")
    module.__dict__.update(mbarrier=mbarrier, tma=tma, warpgroup_mma=warpgroup_mma,
                           warpgroup_mma_wait=warpgroup_mma_wait,
                           warpgroup_mma_init=lambda value: value,
                           fence_async_shared=lambda cluster=False: None)
    return module


# builtins written against Gluon's IR builder in the templates, by name
_BUILTINS = {"flexfa_tma_reduce_add": _tma_reduce_add}


def _builtin(fn):
    try:
        return _BUILTINS[fn.__name__]
    except KeyError:
        raise NotImplementedError(f"the Gluon emulator has no equivalent of the builtin "
                                  f"{fn.__name__}") from None


def _namespaces() -> dict[str, types.ModuleType]:
    from triton import jit

    language = _language()
    gluon = types.ModuleType("flexfa_gluon_emulated")
    gluon.__dict__.update(jit=jit, language=language)
    core = types.ModuleType("flexfa_gluon_emulated_core")
    core.__dict__.update(builtin=_builtin)
    hopper = _hopper()
    experimental = types.ModuleType("flexfa_gluon_emulated_experimental")
    experimental.__dict__.update(gluon=gluon)
    return {"triton.experimental": experimental, "triton.experimental.gluon": gluon,
            "triton.experimental.gluon.language": language,
            "triton.experimental.gluon.language._core": core,
            "triton.experimental.gluon.language.nvidia.hopper": hopper}


def load_emulated(path: str, module_name: str, source: str | None = None) -> types.ModuleType:
    """The generated Gluon module at ``path`` (the kernel cache's file; ``source``: its text
    as the cache checked it, default read now) with every kernel an interpreted function over
    the emulation above. Its ``@triton.jit`` helpers see a triton.language whose
    ``inline_asm_elementwise`` is the emulator's."""
    check_interpreter_numpy()
    if source is None:
        with open(path) as file:
            source = file.read()
    spaces = _namespaces()
    real_import = builtins.__import__

    def gluon_import(name, globals=None, locals=None, fromlist=(), level=0):
        if name in spaces and fromlist:
            return spaces[name]
        if name.startswith("triton.experimental") and name not in spaces:
            raise ImportError(f"the Gluon emulator does not provide {name}")
        return real_import(name, globals, locals, fromlist, level)

    # the module's flags stay constexprs while its body runs (the Gluon templates read their
    # .value there), and become plain values after it, as the interpreter hands them
    if source.count(INTERPRETED_FLAGS) != 1:
        raise ValueError(f"{path}: not a generated module (its flag block is missing)")
    source = source.replace(INTERPRETED_FLAGS, "\n" * INTERPRETED_FLAGS.count("\n"))
    # the interpreter finds a kernel's constexpr parameters by their annotations' text, and
    # knows "tl.constexpr" (gl.constexpr is the same class)
    source = source.replace(": gl.constexpr", ": tl.constexpr")
    # the interpreter reads each function's source again (inspect, through linecache) to
    # rewrite it: the edited source is registered under a name of its own
    path = f"{path} (emulated)"
    linecache.cache[path] = (len(source), None, source.splitlines(True), path)
    module = types.ModuleType(module_name)
    module.__file__ = path
    module.__dict__["__builtins__"] = {**builtins.__dict__, "__import__": gluon_import}
    with INTERPRETER_LOCK, interpret_mode(True):
        exec(compile(source, path, "exec", dont_inherit=True), module.__dict__)
    module.__dict__.update({name: value.value for name, value in list(vars(module).items())
                            if isinstance(value, tl.constexpr)})
    # in the kernels (the module's body has run), a loop over range() is a runtime loop: its
    # variable an int32 tensor (`t < walk[0]` a tensor, not a Python bool), as compiled
    module.__dict__["__builtins__"]["range"] = _runtime_range
    # helpers look triton.language up when called: give them the emulator's inline asm;
    # the interpreter's patching needs the real module among the globals
    module.__dict__["_flexfa_triton_language"] = tl
    module.__dict__["tl"] = _Forward("flexfa_gluon_emulated_tl", tl,
                                     inline_asm_elementwise=inline_asm_elementwise)
    # what is left of the interpreted functions are the kernels (the module made the others
    # plain functions): their launches hold the interpreter's lock and hand the kernel its
    # tensor descriptors as Descriptors
    keep_rewritten(module)
    for value in list(vars(module).values()):
        if isinstance(value, interp.InterpretedFunction) and "run" not in vars(value):
            value.run = _launch(value.run)
    return module


def _launch(run):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    def convert(value):
        return Descriptor(value) if isinstance(value, TensorDescriptor) else value

    locked = serialized(run)

    def emulated_run(*args, **kwargs):
        return locked(*map(convert, args), **{k: convert(v) for k, v in kwargs.items()})
    return emulated_run
