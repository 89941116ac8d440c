"""``flexfa.runtime.launch``: the direct C launch of a cached plan against Triton's launcher.

Triton 3.6's CUDA launcher is rebuilt here around a recording C function (its own
``wrap_handle_tensordesc`` and ``CudaLauncher.__call__``, with the TMA encoding stubbed: no
GPU), so the test checks that the direct path hands the C function exactly the arguments
Triton's path does, encodes a descriptor once per base address, and falls back to Triton's
launcher wherever its assumptions do not hold.
"""
from __future__ import annotations

import contextlib
import types

import pytest
import torch
import triton
from triton.backends.nvidia import driver
from triton.tools.tensor_descriptor import TensorDescriptor

from flexfa.runtime import launch

SIGNATURE = {"q": "tensordesc<bf16[64, 64]>", "out": "*bf16", "k": "tensordesc<bf16[64, 64]>",
             "n": "i32", "scale": "fp32", "BLOCK": "constexpr", "MODE": "constexpr"}
PARAMS = list(SIGNATURE)
METAS = [dict(swizzle=3, elem_size=2, elem_type=9, block_size=[64, 64], fp4_padded=False),
         dict(swizzle=3, elem_size=2, elem_type=9, block_size=[64, 64], fp4_padded=False)]


class _Recorder:
    """Stands in for the compiled C launch function (a builtin: no ``__code__``)."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


def _fake_compiled(recorder, metas=METAS, scratch=0):
    launcher = types.SimpleNamespace(
        launch=driver.wrap_handle_tensordesc(recorder, SIGNATURE, metas),
        global_scratch_size=scratch, global_scratch_align=1, profile_scratch_size=0,
        profile_scratch_align=1, launch_cooperative_grid=False, launch_pdl=True, num_ctas=1)
    compiled = types.SimpleNamespace(_run=launcher, function=0xF00, packed_metadata=(4, 1, 0))
    compiled.run = lambda *a: driver.CudaLauncher.__call__(launcher, *a)
    compiled.launch_metadata = lambda grid, stream, *args: None
    return compiled


@pytest.fixture
def encoded(monkeypatch):
    """make_tensordesc_arg without a GPU: a recognisable stand-in for the TMA descriptor."""
    calls = []

    def fake(desc, meta):
        calls.append(desc.base.data_ptr())
        return [("tma", desc.base.data_ptr(), meta["swizzle"]), *desc.shape, *desc.strides]
    monkeypatch.setattr(driver, "make_tensordesc_arg", fake)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 77, raising=False)
    return calls


def _args(q, k, out):
    return [TensorDescriptor(q, [q.shape[0], 64], [64, 1], [64, 64]), out,
            TensorDescriptor(k, [k.shape[0], 64], [64, 1], [64, 64]), 5, 0.5]


def _state(compiled):
    kernel = types.SimpleNamespace(params=[types.SimpleNamespace(name=n) for n in PARAMS])
    return launch.direct_state(kernel, compiled, _args(*[torch.zeros(128, 64)] * 3),
                               {"MODE": 2, "BLOCK": 64})


def _triton_args(q, k, out, grid=(3, 2, 1)):
    """What Triton's own launcher passes to the C function for the same launch."""
    recorder = _Recorder()
    compiled = _fake_compiled(recorder)
    compiled.run(*grid, 77, compiled.function, compiled.packed_metadata, None, None, None,
                 *_args(q, k, out), 64, 2)
    return recorder.calls[0]


def test_direct_launch_passes_what_tritons_launcher_passes(encoded):
    q, k, out = torch.randn(128, 64), torch.randn(256, 64), torch.randn(128, 64)
    recorder = _Recorder()
    state = _state(_fake_compiled(recorder))
    assert state.c_launch is recorder and [d[0] for d in state.descriptors] == [0, 2]
    launch.launch_direct(state, (3, 2), 0, _args(q, k, out))
    assert recorder.calls == [_triton_args(q, k, out)]
    assert recorder.calls[0][:7] == (3, 2, 1, 77, 0xF00, False, True)


@pytest.mark.parametrize("grid", [(5,), (5, 2), (5, 2, 3)])
def test_grids_of_one_to_three_dims_reach_the_launcher_as_three(encoded, grid):
    """The decode family's combine kernel has a 1-D grid (seen on the H200: 'function takes
    exactly 33 arguments (31 given)')."""
    q, k, out = torch.randn(128, 64), torch.randn(256, 64), torch.randn(128, 64)
    padded = (*grid, 1, 1)[:3]
    recorder = _Recorder()
    state = _state(_fake_compiled(recorder))
    launch.launch_direct(state, grid, 0, _args(q, k, out))
    assert recorder.calls == [_triton_args(q, k, out, padded)]
    state.c_launch = None  # Triton's launcher (it passes its launch hooks on)
    launch.launch_direct(state, grid, 0, _args(q, k, out))
    assert len(recorder.calls) == 2 and recorder.calls[1][:3] == padded


def test_a_descriptor_is_encoded_once_per_base_address(encoded):
    q, k, out = torch.randn(128, 64), torch.randn(256, 64), torch.randn(128, 64)
    recorder = _Recorder()
    state = _state(_fake_compiled(recorder))
    encoded.clear()
    for _ in range(3):
        launch.launch_direct(state, (3, 2), 0, _args(q, k, out))
    assert encoded == [q.data_ptr(), k.data_ptr()]
    other = torch.randn(128, 64)  # a new base: encoded again, and passed
    launch.launch_direct(state, (3, 2), 0, _args(other, k, out))
    assert encoded[-1] == other.data_ptr()
    assert recorder.calls[-1] == _triton_args(other, k, out)


def test_a_descriptor_of_another_shape_at_the_same_address_is_encoded_again(encoded):
    """The dS workspace's rows follow the block mask's contents, which a plan's key does not
    fix: after an in-place table edit the larger workspace came back from the caching
    allocator at the last one's address, and the descriptor cached by address alone kept
    the old row count: the TMA loads past it read zeros and the stores were dropped (dQ rows
    of zeros on the H100, tests/gpu/test_cached_plans_gpu.py). Shape and strides are part of
    what an entry is reused for."""
    storage = torch.randn(256, 64)
    small, large = storage[:128], storage  # one base address, 128 then 256 rows
    k, out = torch.randn(128, 64), torch.randn(128, 64)
    recorder = _Recorder()
    state = _state(_fake_compiled(recorder))
    encoded.clear()
    launch.launch_direct(state, (3, 2), 0, _args(small, k, out))
    launch.launch_direct(state, (3, 2), 0, _args(large, k, out))
    assert encoded == [storage.data_ptr(), k.data_ptr(), storage.data_ptr()]
    assert recorder.calls[-1] == _triton_args(large, k, out)
    strided = [TensorDescriptor(storage, [128, 64], [128, 1], [64, 64]),
               *_args(small, k, out)[1:]]
    encoded.clear()
    launch.launch_direct(state, (3, 2), 0, strided)  # the same address and shape, other strides
    launch.launch_direct(state, (3, 2), 0, strided)  # the same again: the cached entry
    assert encoded == [storage.data_ptr()]
    call = recorder.calls[-1]
    at = call.index(("tma", storage.data_ptr(), 3))
    assert call[at + 1:at + 5] == (128, 64, 128, 1)


def test_the_descriptor_cache_is_bounded(encoded):
    recorder = _Recorder()
    state = _state(_fake_compiled(recorder))
    k, out = torch.randn(128, 64), torch.randn(128, 64)
    keep = [torch.randn(128, 64) for _ in range(launch._MAX_DESCRIPTORS + 3)]
    for q in keep:
        launch.launch_direct(state, (3, 2), 0, _args(q, k, out))
    assert all(len(cache) <= launch._MAX_DESCRIPTORS for _, _, cache in state.descriptors)
    assert recorder.calls[-1] == _triton_args(keep[-1], k, out)


def test_hooks_scratch_and_other_layouts_take_tritons_launcher(encoded, monkeypatch):
    q, k, out = torch.randn(128, 64), torch.randn(256, 64), torch.randn(128, 64)
    # a launch hook (a profiler): Triton's launcher, which calls it
    recorder = _Recorder()
    state = _state(_fake_compiled(recorder))
    seen = []
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda *a: seen.append(a))
    launch.launch_direct(state, (3, 2), 0, _args(q, k, out))
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", None)
    assert len(recorder.calls) == 1 and recorder.calls[0][11] is not None  # the hook passed on
    # global scratch memory, descriptors lowered to pointers, an unknown wrapper: no C launch
    assert _state(_fake_compiled(_Recorder(), scratch=256)).c_launch is None
    assert _state(_fake_compiled(_Recorder(), metas=None)).c_launch is None
    with monkeypatch.context() as patch:  # a Triton whose C launch takes other arguments
        patch.setattr(driver, "_BASE_ARGS_FORMAT", "iiiKKppOOOOOOO")
        assert _state(_fake_compiled(_Recorder())).c_launch is None
    odd = _fake_compiled(_Recorder())
    odd._run.launch = lambda *args: None
    assert _state(odd).c_launch is None
    state = _state(odd)  # still launches, through Triton's launcher
    calls = []
    odd.run = lambda *a: calls.append(a)
    launch.launch_direct(state, (3, 2), 0, _args(q, k, out))
    assert len(calls) == 1 and calls[0][-2:] == (64, 2)


def test_constexprs_other_than_the_tail_give_no_state():
    kernel = types.SimpleNamespace(params=[types.SimpleNamespace(name=n) for n in PARAMS])
    assert launch.direct_state(kernel, None, [1] * 5, {"BLOCK": 64}) is None


def test_a_launch_thread_gets_an_allocator_and_a_users_stays():
    """Kernels that need global scratch (device-side TMA descriptors, the concurrency
    sanitizer) ask triton.set_allocator's allocator, a context variable: the autograd
    engine's threads start with Triton's null one, which raised in the Gluon backward's first
    GPU run. ensure_allocator sets one where none is; a user's own allocator is kept."""
    import threading

    from triton.runtime import _allocation

    from flexfa.runtime.launch import ensure_allocator

    def user_allocator(size, alignment, stream):
        raise AssertionError("not called here")

    found = {}

    def fresh_thread():
        found["before"] = _allocation._allocator.get()
        ensure_allocator()
        found["after"] = _allocation._allocator.get()

    def users_thread():
        triton.set_allocator(user_allocator)
        ensure_allocator()
        found["user"] = _allocation._allocator.get()

    for target in (fresh_thread, users_thread):
        thread = threading.Thread(target=target)
        thread.start()
        thread.join()
    assert isinstance(found["before"], _allocation.NullAllocator)
    assert not isinstance(found["after"], _allocation.NullAllocator)
    assert found["user"] is user_allocator


def test_triton_launches_on_a_given_stream_with_that_stream_current(encoded, monkeypatch):
    """A launch on a given stream (the Gluon backward's side stream) that takes Triton's
    launcher (scratch memory, hooks) ran with the caller's stream current: the scratch
    memory Triton's launcher takes from the allocator (torch memory of the current stream,
    freed as the launch returns) could be handed out again there while the kernel ran on
    the other stream. Both launch paths pass the given stream to the kernel."""
    from triton.runtime import _allocation

    current = ["main"]

    @contextlib.contextmanager
    def stream_context(stream):
        before, current[0] = current[0], stream
        try:
            yield
        finally:
            current[0] = before
    monkeypatch.setattr(torch.cuda, "stream", stream_context)
    allocated_on = []
    token = _allocation._allocator.set(lambda size, alignment, stream: (
        allocated_on.append(current[0]), torch.empty(size, dtype=torch.int8))[1])
    try:
        side = types.SimpleNamespace(cuda_stream=99)
        q, k, out = torch.randn(128, 64), torch.randn(256, 64), torch.randn(128, 64)
        recorder = _Recorder()
        scratch = _state(_fake_compiled(recorder, scratch=256))
        launch.launch_direct(scratch, (3, 2), 0, _args(q, k, out), side)
        assert allocated_on == [side] and current == ["main"]
        launch.launch_direct(scratch, (3, 2), 0, _args(q, k, out))  # the current stream
        assert allocated_on == [side, "main"]
        direct = _state(_fake_compiled(recorder))
        launch.launch_direct(direct, (3, 2), 0, _args(q, k, out), side)
        assert [call[3] for call in recorder.calls] == [99, 77, 99]
    finally:
        _allocation._allocator.reset(token)


def test_a_step_launches_on_its_device_and_stream(monkeypatch):
    """A plan's step on CUDA (fakes: no GPU here): its first launch (Triton's, which
    compiles) runs with the step's device and the given stream current; later launches go
    direct on that stream while the device is current, through Triton again while another
    is."""
    contexts, direct = [], []
    monkeypatch.setattr(torch.cuda, "device", lambda device: contexts.append(device) or
                        contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contexts.append(stream) or
                        contextlib.nullcontext())
    current = [0]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(launch, "direct_state", lambda *a: "state")
    monkeypatch.setattr(launch, "launch_direct", lambda state, grid, index, args, stream=None:
                        direct.append((state, index, stream)))
    monkeypatch.setattr(launch, "ensure_allocator", lambda: None)

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: "compiled"
    gpu, side = torch.device("cuda", 1), types.SimpleNamespace(cuda_stream=99)
    step = launch.Step(Kernel(), (4,), {}, {})
    step.launch([1], gpu, stream=side)
    assert contexts == [gpu, side] and direct == []
    current[0] = 1
    step.launch([1], gpu, stream=side)
    assert direct == [("state", 1, side)] and len(contexts) == 2
    current[0] = 0
    step.launch([1], gpu)
    assert contexts[2:] == [gpu] and len(direct) == 1
