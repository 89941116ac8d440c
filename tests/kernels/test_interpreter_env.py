"""Triton's CPU interpreter and numpy: no DeprecationWarning flood from interpreted launches,
and a clear error (or warning) where the installed numpy breaks (or is untested with) the
interpreter. numpy is not a dependency of flexfa, so nothing else stops a wrong one."""
import sys
import warnings

import numpy
import pytest
import torch
import triton

import flexfa
from flexfa import config, loader

# range() over a program id calls the interpreter's tensor.__index__, int() of a 1-element
# numpy array: deprecated since numpy 1.25, so one DeprecationWarning per program
KERNEL = '''
import triton
import triton.language as tl


@triton.jit
def count_kernel(out_ptr, n):
    pid = tl.program_id(0)
    total = 0
    for i in range(pid, n):
        total += 1
    tl.store(out_ptr + pid, total)
'''


def _scalar_conversions(caught) -> list:
    return [w for w in caught if issubclass(w.category, DeprecationWarning)
            and "to a scalar is deprecated" in str(w.message)]


def _load(tmp_path, name: str, interpret: bool = True):
    path = tmp_path / f"{name}.py"
    path.write_text(KERNEL)
    return loader.load_module(path, interpret=interpret, module_name=f"flexfa_test_env.{name}")


def test_an_interpreted_launch_emits_no_deprecation_warning(tmp_path):
    module = _load(tmp_path, "count")
    out = torch.zeros(4, dtype=torch.int32)
    filters_before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module.count_kernel[(4,)](out, 4)
        assert out.tolist() == [4, 3, 2, 1]
        assert _scalar_conversions(caught) == []
        # the filter holds during launches only: the same conversion elsewhere still warns
        int(numpy.ones(1))
        assert len(_scalar_conversions(caught)) == 1
    assert list(warnings.filters) == filters_before, "no filter left behind"


def test_flex_attention_on_cpu_emits_no_deprecation_warning():
    q, k, v = (torch.randn(1, 1, 64, 16) for _ in range(3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flexfa.flex_attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s * 0.5)
    assert _scalar_conversions(caught) == []


@pytest.mark.parametrize("numpy_version, triton_version, outcome", [
    ("2.2.6", "3.6.0", None),
    ("1.26.4", "3.4.0", None),
    ("2.3.5", "3.6.0", RuntimeWarning),  # runs, but flexfa's CI does not test it
    ("2.4.0", "3.6.0", loader.InterpreterNumpyError),
    ("2.4.6", "3.5.1", loader.InterpreterNumpyError),
    ("3.0.0.dev0+git1", "3.6.0+gitabc", loader.InterpreterNumpyError),
    ("2.4.6", "3.8.0", RuntimeWarning),  # Triton 3.8's interpreter converts safely
])
def test_numpy_versions_the_interpreter_checks(numpy_version, triton_version, outcome):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if outcome is loader.InterpreterNumpyError:
            with pytest.raises(loader.InterpreterNumpyError) as error:
                loader.check_interpreter_numpy(numpy_version, triton_version)
            assert numpy_version in str(error.value) and triton_version in str(error.value)
            assert 'pip install "numpy<2.3"' in str(error.value)
            assert isinstance(error.value, RuntimeError)
        else:
            loader.check_interpreter_numpy(numpy_version, triton_version)
    warned = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    if outcome is RuntimeWarning:
        assert len(warned) == 1 and numpy_version in str(warned[0].message)
    else:
        assert warned == []


def test_loading_an_interpreted_module_checks_numpy(tmp_path, monkeypatch):
    monkeypatch.setattr(numpy, "__version__", "2.4.0")
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    with pytest.raises(loader.InterpreterNumpyError, match="numpy 2.4.0 is installed"):
        _load(tmp_path, "checked")
    # compiled modules (CUDA tensors) do not need numpy at all
    module = _load(tmp_path, "compiled", interpret=False)
    assert hasattr(module, "count_kernel")


def test_missing_numpy_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "numpy", None)  # import numpy raises ImportError
    with pytest.raises(loader.InterpreterNumpyError, match="numpy is not installed"):
        loader.check_interpreter_numpy()


def test_a_filter_added_during_a_launch_outlives_it():
    """Another thread's filter added while a launch runs stays (catch_warnings around each
    launch restored the process's list as it was before the launch, dropping it)."""
    def run():
        warnings.filterwarnings("error", message="flexfa test marker")
        return "ran"

    with warnings.catch_warnings():
        assert loader.serialized(run)() == "ran"
        assert any(entry[1] is not None and entry[1].pattern == "flexfa test marker"
                   for entry in warnings.filters)


def test_the_interpreters_warning_is_ignored_before_filters_added_since():
    """A filter put first after an earlier launch (here: always show) does not bring the
    interpreter's warning back; the same warning from another module is still shown."""
    def warn_from(module):
        warnings.warn_explicit(loader._SCALAR_CONVERSION, DeprecationWarning, "x.py", 1,
                               module=module, registry={})

    with warnings.catch_warnings(record=True) as caught:
        loader.serialized(lambda: None)()
        warnings.simplefilter("always")
        loader.serialized(lambda: warn_from("triton.runtime.interpreter"))()
        assert caught == []
        warn_from("user_code")
        assert len(_scalar_conversions(caught)) == 1


def _identity(x):
    return x


@pytest.mark.parametrize("process_interprets", [True, False])
def test_loading_a_module_sets_the_mode_for_its_own_thread_only(tmp_path, monkeypatch,
                                                                process_interprets):
    """flexfa loaded a module with TRITON_INTERPRET switched for the whole process: a kernel
    another thread decorated meanwhile got the loader's mode, not the process's."""
    import threading

    from triton.runtime.interpreter import InterpretedFunction
    monkeypatch.setenv("TRITON_INTERPRET", "1" if process_interprets else "0")
    loading, decorated = threading.Event(), threading.Event()

    def other_thread():
        loading.wait(10)
        kernels.append(triton.jit(_identity))
        decorated.set()

    kernels = []
    thread = threading.Thread(target=other_thread)
    thread.start()
    def exec_while_the_other_thread_decorates(code, namespace):
        loading.set()
        assert decorated.wait(10)  # the other thread decorates in the middle of the import
        exec(code, namespace)
    monkeypatch.setattr(loader, "exec", exec_while_the_other_thread_decorates, raising=False)
    module = _load(tmp_path, f"mode_{process_interprets}", interpret=not process_interprets)
    thread.join(10)
    assert isinstance(kernels[0], InterpretedFunction) == process_interprets
    assert isinstance(module.count_kernel, InterpretedFunction) != process_interprets
    assert config.triton_interpret() == ("1" if process_interprets else "0")
