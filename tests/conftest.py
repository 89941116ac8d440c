"""Shared pytest setup: the interpreter for CPU kernels, hypothesis profiles, the gpu marker."""
import inspect
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before any kernel is decorated

import pytest
import torch
import triton.language as tl
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=15, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", max_examples=50, deadline=None)
settings.register_profile("thorough", max_examples=500, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# what the Triton interpreter patches while a kernel runs; a test that leaves it patched (a
# compile calling interpreted @jit functions such as tl.zeros does) would break every later
# compile in the process, so the check below restores it and fails that test. Values are
# compared as found on the object or its classes: Triton's own restore copies inherited ones
_TRITON_LANGUAGE = (tl, tl.core, tl.math, tl.tensor, tl.dtype, tl.core.tensor_descriptor_base)
_ABSENT = object()
_TRITON_STATE = [{name: inspect.getattr_static(obj, name) for name in dir(obj)}
                 for obj in _TRITON_LANGUAGE]


@pytest.fixture(autouse=True)
def torch_seeded():
    """Each test starts from one global RNG state: its torch.randn draws do not depend on the
    tests that ran before it in the process (scripts/test.sh deals whole files to processes
    as they come free, so which ran before differs from run to run)."""
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def triton_language_left_intact():
    yield
    changed = []
    for obj, saved in zip(_TRITON_LANGUAGE, _TRITON_STATE):
        for name, value in list(vars(obj).items()):
            # (__warningregistry__: Python's record of a warning the module emitted, made
            # by whichever test of the process meets it first; not a patch)
            if name not in ("__annotations__", "__warningregistry__") and \
                    saved.get(name, _ABSENT) is not value:
                changed.append(f"{getattr(obj, '__name__', obj)}.{name}")
                setattr(obj, name, saved[name]) if name in saved else delattr(obj, name)
    if changed:
        pytest.fail(f"the test left triton.language patched (restored now): {changed[:5]}")


@pytest.fixture(autouse=True)
def gpu_memory_returned(request):
    """After a GPU test, the blocks torch's caching allocator keeps go back to the device: GPU
    suites run 8 processes on one GPU, and the blocks one process caches after its large
    references are memory the others cannot have (two GPU files over 8 processes reached
    76.6 of an H100's 79.6 GiB)."""
    yield
    if "gpu" in request.node.keywords and torch.cuda.is_available():
        torch.cuda.empty_cache()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing GPU test's report carries the process's and the device's memory at that
    point (allocated, reserved and peak by this process; free and total on the device): GPU
    suites run several processes on one GPU, where one process's cached blocks are memory the
    others cannot have."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and "gpu" in item.keywords and torch.cuda.is_available():
        try:
            free, total = torch.cuda.mem_get_info()
            mib = 2 ** 20
            report.sections.append(("GPU memory", (
                f"this process: allocated {torch.cuda.memory_allocated() // mib} MiB, "
                f"reserved {torch.cuda.memory_reserved() // mib} MiB, peak allocated "
                f"{torch.cuda.max_memory_allocated() // mib} MiB; device: "
                f"{free // mib} of {total // mib} MiB free")))
        except RuntimeError as error:  # (a failed context: the report keeps its own error)
            report.sections.append(("GPU memory", f"not read: {error}"))
