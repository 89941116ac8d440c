"""The host side of varlen_block_mask's CUDA path, counted on the CPU: the path CUDA offsets
take (kernels=True with offsets on the mask's device; the kernels interpreted) makes at most
the kernel launches, device syncs and torch operations counted here, and its device checks
flag every bad offsets tensor the host checks reject.

Counted before the checks moved into the kernels (16 documents, causal): 2 Triton launches,
1 sync (``.tolist`` of torch-made stats) and 65 torch ops, 25 of them launching a CUDA kernel
(diff, comparisons, reductions, stack, cat, int32 copies) and 40 views and splits; 0.57 ms
end to end on the H200 (0.15 ms of it the two table kernels and the BlockMask). Now: 3
launches (``varlen_check``, ``varlen_rows``, ``varlen_columns``), 1 sync, and 19 torch ops,
none launching a kernel (2 allocations, 17 ``as_strided`` cuts); with the totals given
(``Q_LEN`` / ``KV_LEN``, and every ``varlen_attention`` call) 2 launches and 18 ops: the
checks run inside ``varlen_rows``.
"""
import collections
import contextlib
from unittest import mock

import numpy
import pytest
import torch
import triton
from hypothesis import given, strategies as st
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from triton.runtime import interpreter

import flexfa
from flexfa.blockmask import checks, varlen_tables
from flexfa.blockmask.offsets import check_offsets
from flexfa.blockmask.validate import TABLES
from flexfa.blockmask.varlen import checked_block_mask, document_block_mask
from flexfa.memo import BoundedMemo

KERNELS = ("varlen_check", "varlen_rows", "varlen_columns")
SYNCS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__index__")
# torch ops that make no device work (metadata only) and the one allocation kind allowed
FREE = {"aten.as_strided.default", "aten.empty.memory_format", "aten.view.default",
        "aten.slice.Tensor", "aten.alias.default"}


class Counts(TorchDispatchMode):
    """Torch ops, kernel launches and device syncs (Tensor methods that read values on the
    host) outside the kernels (the interpreter's own copies are not the CUDA path's)."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.ops, self.launches, self.syncs = collections.Counter(), [], collections.Counter()
        self.inside = False
        module = varlen_tables.kernels(interpret=True)
        for name in KERNELS:
            monkeypatch.setattr(module, name, self._counted(name, getattr(module, name)))
        for name in SYNCS:
            monkeypatch.setattr(torch.Tensor, name, self._sync(name, getattr(torch.Tensor, name)))

    def _counted(self, name, kernel):
        counts = self

        class Launcher:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    counts.launches.append(name)
                    counts.inside = True
                    try:
                        with _disable_current_modes():
                            return kernel[grid](*args, **kwargs)
                    finally:
                        counts.inside = False
                return launch
        return Launcher()

    def _sync(self, name, method):
        def counted(tensor, *args, **kwargs):
            if not self.inside:
                self.syncs[name] += 1
            return method(tensor, *args, **kwargs)
        return counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def issue_offsets(documents=16, tokens=1024, seed=0):
    """Random documents as in the issue's benchmark (there 32k tokens)."""
    generator = torch.Generator().manual_seed(seed)
    cuts = (torch.randperm(tokens - 1, generator=generator)[:documents - 1] + 1).sort().values
    return torch.cat([torch.tensor([0]), cuts, torch.tensor([tokens])]).int()


@pytest.mark.parametrize("totals,launches", [
    ((None, None), ["varlen_check", "varlen_rows", "varlen_columns"]),
    ((1024, 1024), ["varlen_rows", "varlen_columns"]),
])
def test_cuda_path_counts(monkeypatch, totals, launches):
    cu, cpu = issue_offsets(), torch.device("cpu")
    checked_block_mask("t", cu, cu, cpu, totals, True, None, (128, 128), kernels=True)  # warm
    with Counts(monkeypatch) as counts:
        mask = checked_block_mask("t", cu, cu, cpu, totals, True, None, (128, 128),
                                  kernels=True)
    assert counts.launches == launches
    assert dict(counts.syncs) == {"tolist": 1}  # the checks' flags, totals, longest documents
    assert set(counts.ops) <= FREE, counts.ops  # nothing that launches a CUDA kernel
    assert counts.ops["aten.empty.memory_format"] == (2 if None in totals else 1)
    assert counts.ops["aten.as_strided.default"] <= 17, counts.ops  # 17 outputs cut
    expected = document_block_mask(check_offsets("t", cu, cu, cpu), True, None, (128, 128),
                                   kernels=False)
    for name in TABLES:
        assert torch.equal(getattr(mask, name), getattr(expected, name)), name
    assert mask.documents.offsets.max_q == int(cu.diff().max())


def outcome(build):
    """(int32 offsets, totals, longest documents) of the checked offsets, or the error."""
    try:
        offsets = build()
    except flexfa.InputError as error:
        return str(error)
    return (offsets.cu_q.tolist(), offsets.cu_k.tolist(), offsets.total_q, offsets.total_k,
            offsets.max_q, offsets.max_k)


any_offsets = st.lists(st.integers(-3, 40), min_size=2, max_size=6)


@contextlib.contextmanager
def bounds_checked():
    """Every load and store of the varlen kernels (interpreted) inside one of the launch's
    tensor arguments (its own elements, not its storage), else an AssertionError."""
    module, ranges = varlen_tables.kernels(interpret=True), []
    builder = interpreter.InterpreterBuilder
    load, store = builder.create_masked_load, builder.create_masked_store

    def checked(name, kernel):
        class Launcher:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    ranges[:] = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                                 for t in args if isinstance(t, torch.Tensor)]
                    return kernel[grid](*args, **kwargs)
                return launch
        return Launcher()

    def check(ptrs, mask):
        size = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
        addresses = numpy.broadcast_to(ptrs.data, numpy.shape(mask.data))[mask.data]
        inside = numpy.zeros(addresses.shape, dtype=bool)
        for low, high in ranges:
            inside |= (addresses >= low) & (addresses + size <= high)
        assert inside.all(), f"{(~inside).sum()} accesses outside the arguments"

    def checked_load(self, ptrs, mask, other, *rest):
        check(ptrs, mask)
        return load(self, ptrs, mask, other, *rest)

    def checked_store(self, ptrs, value, mask, *rest):
        check(ptrs, mask)
        return store(self, ptrs, value, mask, *rest)
    with contextlib.ExitStack() as stack:
        for name in KERNELS:
            stack.enter_context(mock.patch.object(module, name,
                                                  checked(name, getattr(module, name))))
        stack.enter_context(mock.patch.object(builder, "create_masked_load", checked_load))
        stack.enter_context(mock.patch.object(builder, "create_masked_store", checked_store))
        yield


@given(values=st.one_of(any_offsets, any_offsets.map(sorted), any_offsets.map(
           lambda v: [0, *sorted(map(abs, v))])),
       total=st.one_of(st.integers(1, 40), st.just("last")),
       dtype=st.sampled_from([torch.int32, torch.int64]))
def test_device_checks_agree_with_the_host_checks(values, total, dtype):
    """Whatever the offsets, the kernels' checks (alone or inside varlen_rows) raise the host
    checks' InputError or accept with the same totals, longest documents and copies; the
    kernels never access memory outside their arguments, on bad offsets neither."""
    cu, cpu = torch.tensor(values, dtype=dtype), torch.device("cpu")
    keys = cu.clone()  # another tensor, same values
    total = max(1, values[-1]) if total == "last" else total
    for totals in ((None, None), (total, total)):
        want = outcome(lambda: check_offsets("t", cu, keys, cpu, *totals))
        with bounds_checked():
            got = outcome(lambda: checked_block_mask("t", cu, keys, cpu, totals, False, None,
                                                     (16, 16), kernels=True).documents.offsets)
        assert got == want


def test_int64_offsets_past_int32_fail_before_the_tables():
    cu = torch.tensor([0, 5, 2 ** 33])
    with pytest.raises(flexfa.InputError, match=r"cu_seqlens_q\[-1\] is 8589934592; offsets "
                                                r"must fit in int32"):
        checked_block_mask("t", cu, cu, torch.device("cpu"), (None, None), False, None,
                           (16, 16), kernels=True)


@pytest.mark.gpu
def test_cuda_offsets_checked_on_the_gpu_and_compiled_once():
    """CUDA offsets (int32 and int64; with and without the totals) give the torch path's
    tables; new lengths and document counts compile nothing new; bad ones raise the host's
    InputError."""
    module = varlen_tables.kernels(interpret=False)

    def compiled():
        return [sum(len(cache[0]) for cache in getattr(module, name).device_caches.values())
                for name in KERNELS]
    cuda = torch.device("cuda")
    seen = None
    for seed, documents in enumerate((16, 16, 5)):
        cu = issue_offsets(documents, 32768, seed)
        expected = document_block_mask(check_offsets("t", cu, cu, cuda), True, None,
                                       (128, 128), kernels=False)
        for totals in ((None, None), (32768, 32768)):
            mask = flexfa.varlen_block_mask(cu.cuda(), causal=True, Q_LEN=totals[0],
                                            KV_LEN=totals[1])
            for name in TABLES:
                assert torch.equal(getattr(mask, name), getattr(expected, name)), name
        seen = seen or compiled()
        assert compiled() == seen
    for dtype in (torch.int32, torch.int64):
        bad = torch.tensor([0, 5, 3, 9], dtype=dtype, device=cuda)
        for totals in ((None, None), (9, 9)):
            with pytest.raises(flexfa.InputError, match=r"decreases at index 2 \(5 -> 3\)"):
                flexfa.varlen_block_mask(bad, Q_LEN=totals[0], KV_LEN=totals[1])


class FakeCompiled:
    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.runs = []

    def run(self, *args):
        self.runs.append(args)


class FakeKernel:
    """A JIT kernel on a fake CUDA device: ``kernel[grid](...)`` is Triton's launch."""
    arg_names = ["cu", "n", "out", "A", "B"]

    def __init__(self):
        self.jit_launches = []

    def __getitem__(self, grid):
        def run(*args, **constexprs):
            self.jit_launches.append((grid, args, constexprs))
            return FakeCompiled()
        return run


def test_cuda_launches_after_the_first_skip_tritons_binding(monkeypatch):
    """On CUDA a launch whose key (constexprs, the offsets' dtype and alignment) launched
    before calls the compiled kernel with every argument and the constexprs in parameter
    order; a new key, or a launch hook (a profiler), goes through Triton."""
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 7, raising=False)
    monkeypatch.setattr(varlen_tables, "_COMPILED", BoundedMemo(8, register=False))
    kernel, cuda = FakeKernel(), torch.device("cuda", 0)
    cu, out = torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
    for n in (3, 5):  # new ints: the same compiled kernel
        varlen_tables.launch(kernel, 2, (cu, n, out), {"B": True, "A": 4}, (cu,), cuda)
    assert len(kernel.jit_launches) == 1
    (compiled, _), = varlen_tables._COMPILED.values()
    assert compiled.runs == [(2, 1, 1, 7, "function", "metadata", None, None, None,
                              cu, 5, out, 4, True)]
    varlen_tables.launch(kernel, 2, (cu[1:], 3, out), {"B": True, "A": 4}, (cu[1:],), cuda)
    varlen_tables.launch(kernel, 2, (cu.long(), 3, out), {"B": True, "A": 4}, (cu.long(),),
                         cuda)
    varlen_tables.launch(kernel, 2, (cu, 3, out), {"B": False, "A": 4}, (cu,), cuda)
    assert len(kernel.jit_launches) == 4  # unaligned, int64 offsets, another constexpr
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda metadata: None)
    varlen_tables.launch(kernel, 2, (cu, 3, out), {"B": True, "A": 4}, (cu,), cuda)
    assert len(kernel.jit_launches) == 5 and len(compiled.runs) == 1



def test_interpreted_table_kernels_launch_under_the_interpreter_lock():
    """The table kernels' module is loaded as every kernel module is (``flexfa.loader``):
    each interpreted launch holds INTERPRETER_LOCK (the interpreter's program ids are
    process-wide: a varlen call beside another thread's CPU attention read each other's)."""
    from triton.runtime.interpreter import InterpretedFunction

    module = varlen_tables.kernels(True)
    kernels = [v for v in vars(module).values() if isinstance(v, InterpretedFunction)]
    assert kernels
    for kernel in kernels:
        assert kernel.run.__qualname__ == "serialized.<locals>.locked_run", kernel


def test_a_mask_of_cuda_offsets_is_refused_while_capturing(monkeypatch):
    """Inside a CUDA graph capture the host read of the offsets (or their copy to the GPU)
    failed deep in torch and broke the capture: a clear error names what to do instead.
    CPU masks need no device: they still build (the capture simulated, as in
    tests/reliability/test_capture.py)."""
    from flexfa.blockmask import varlen as varlen_module

    monkeypatch.setattr(varlen_module, "capturing", lambda: True, raising=False)
    cu, cuda = torch.tensor([0, 5, 9], dtype=torch.int32), torch.device("cuda", 0)
    with pytest.raises(flexfa.InputError, match="CUDA graph is being captured.*before capturing"):
        checked_block_mask("varlen_block_mask", cu, cu, cuda, (None, None), True, None,
                           (16, 16))
    mask = checked_block_mask("varlen_block_mask", cu, cu, torch.device("cpu"), (None, None),
                              True, None, (16, 16))
    assert mask.seq_lengths == (9, 9)


def test_table_launches_make_the_offsets_gpu_current(monkeypatch):
    """Triton launches on the current CUDA device: ``checks.on_device`` makes the offsets' GPU
    current for the launches (fakes: no GPU here) and is nothing where it is already
    current or for CPU tensors."""
    entered = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda device: entered.append(device) or
                        contextlib.nullcontext())
    for device in (torch.device("cuda", 0), torch.device("cpu")):
        with checks.on_device(device):
            pass
    assert entered == []
    with checks.on_device(torch.device("cuda", 1)):
        pass
    assert entered == [torch.device("cuda", 1)]
