"""Importing generated kernel sources as modules, interpreted or compiled.

Triton decides at decoration time whether ``@triton.jit`` makes an interpreted function
(``TRITON_INTERPRET=1``, read through ``triton.knobs.runtime.interpret``) or a compiled one,
so a module is imported with that mode set (``interpret_mode``): CPU tensors get an
interpreted copy, CUDA tensors a compiled one, from the same file, and the two copies live
side by side under different module names. The mode is set for the importing thread only:
setting the variable switched the whole process, so another thread decorating (or compiling)
a kernel of its own during the import got the other mode.

Interpreted launches are serialized by ``INTERPRETER_LOCK``: Triton's interpreter keeps the
current program id in one process-wide builder and patches ``triton.language`` while a kernel
runs, so two threads launching at once would read each other's program ids (wrong results or
crashes). Loading a module holds it too (CPython 3.11 fails when two threads build Python
ASTs at once, as a module's execution and an interpreted kernel's first launch both do).
Compiled launches are not affected.

The interpreter computes with numpy. numpy 2.4 made an error of the array-to-scalar conversion
Triton 3.6's interpreter does for every program id (deprecated since numpy 1.25: one
DeprecationWarning per program, ignored where Triton's interpreter issues it), so there
interpreted kernels need numpy < 2.4; flexfa is tested with numpy < 2.3 (the ``interpret``
and ``test`` extras). numpy is not a dependency of flexfa itself, so its version is checked
where an interpreted module is first loaded.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import linecache
import re
import sys
import threading
import warnings
from pathlib import Path

from .errors import FlexFAError

INTERPRETER_LOCK = threading.RLock()
NUMPY_TESTED_BELOW = (2, 3)  # the interpret/test extras pin numpy<2.3
NUMPY_BREAKS_FROM = (2, 4)  # int() of a 1-element array is an error from here on
_SCALAR_CONVERSION = "Conversion of an array with ndim > 0 to a scalar is deprecated"


class InterpreterNumpyError(FlexFAError, RuntimeError):
    """The installed numpy cannot run Triton's CPU interpreter."""


_MODE = threading.local()  # .interpret: this thread's mode inside interpret_mode, else absent
_MODE_INSTALL_LOCK = threading.Lock()


@contextlib.contextmanager
def interpret_mode(interpret: bool):
    """Triton's interpreter setting as ``interpret`` for this thread, for the block (Triton
    reads it when a kernel is decorated, and where a constexpr function is called); other
    threads see the process's setting all along."""
    _install_thread_mode()
    outer = getattr(_MODE, "interpret", None)
    _MODE.interpret = bool(interpret)
    try:
        yield
    finally:
        _MODE.interpret = outer


def _install_thread_mode() -> None:
    """Make Triton's ``knobs.runtime.interpret`` answer this thread's ``interpret_mode`` where
    one is set, and what it answered before (the environment, or a value set on the knob)
    elsewhere: the knob's descriptor is replaced by a subclass, once."""
    from triton import knobs

    knob_class = type(knobs.runtime)
    if getattr(vars(knob_class)["interpret"], "per_thread", False):
        return
    with _MODE_INSTALL_LOCK:
        knob = vars(knob_class)["interpret"]
        if not getattr(knob, "per_thread", False):
            knob_class.interpret = _per_thread(knobs.env_bool, knob)


def _per_thread(env_bool: type, knob):
    class PerThread(env_bool):
        per_thread = True

        def __get__(self, obj, objclass=None):
            mode = getattr(_MODE, "interpret", None)
            return super().__get__(obj, objclass) if mode is None or obj is None else mode

    replaced = PerThread(knob.key, knob.default)
    replaced.name = knob.name  # the attribute a value set on the knob is kept under
    return replaced


def load_module(path: str | Path, interpret: bool, module_name: str | None = None,
                source: str | None = None):
    """Import the Python file at ``path``; its kernels are interpreted iff ``interpret``.
    ``source``: the file's text as the caller verified it (default: read now). That text is
    what runs and what ``inspect`` (Triton) reads: Python's bytecode cache is not used, so a
    damaged or stale ``.pyc`` never runs, and a file pruned after the check does not matter."""
    path = Path(path)
    name = module_name or f"flexfa_generated.{path.stem}_{'interp' if interpret else 'jit'}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, f"cannot import {path}"
    module = importlib.util.module_from_spec(spec)
    if source is None:
        source = path.read_text(encoding="utf-8")
    if interpret:
        check_interpreter_numpy()
    remember_source(path, source)
    code = compile(source, str(path), "exec", dont_inherit=True)
    # under the interpreter's lock: executing the module compiles its source and rewrites
    # its functions (Python ASTs), and CPython 3.11 fails ("AST constructor recursion depth
    # mismatch") when two threads build ASTs at once, as a launch does on a kernel's first call
    with INTERPRETER_LOCK, interpret_mode(interpret):
        exec(code, module.__dict__)
    if interpret:
        keep_rewritten(module)
        _serialize_launches(module)
    # Triton's compiled path looks kernels' modules up by name (for their globals/source)
    sys.modules[name] = module
    return module


def remember_source(path: Path, source: str) -> None:
    """Make ``linecache`` (``inspect.getsource``, which Triton calls when it decorates a
    kernel and when its interpreter rewrites one) answer ``source`` for ``path`` without
    reading the file again (mtime None: ``linecache.checkcache`` keeps the entry; ``unload``
    drops it)."""
    linecache.cache[str(path)] = (len(source), None, source.splitlines(True), str(path))


def unload(module) -> None:
    """Drop what importing ``module`` left outside it: its ``sys.modules`` entry and its
    ``linecache`` text (its interpreted kernels were rewritten at import: ``keep_rewritten``;
    nothing reads the text again)."""
    if sys.modules.get(module.__name__) is module:
        del sys.modules[module.__name__]
    linecache.cache.pop(str(module.__file__), None)


def keep_rewritten(module) -> None:
    """Rewrite each interpreted kernel of ``module`` now, keeping the copy on the kernel's
    own InterpretedFunction, and take every function of ``module`` out of Triton's
    interpreter's process-wide ``InterpretedFunction.rewritten_fn``: that dict, keyed by
    function, holds each function's globals (its whole module) for the life of the process,
    whatever bound the kernel memo has; held by the module's own objects, the copies go with
    it. Rewriting reads the source (``inspect``, from ``linecache``), registered by the
    loader: done now, a kernel never needs it again (``unload`` drops it)."""
    from triton.runtime.interpreter import InterpretedFunction

    namespace = vars(module)
    with INTERPRETER_LOCK:  # a launch rewrites, then reads the entry back
        for value in list(namespace.values()):
            if isinstance(value, InterpretedFunction) and "rewrite" not in vars(value) \
                    and getattr(value.fn, "__globals__", None) is namespace:
                value.rewrite = functools.partial(_same, value.rewrite())
        # the kernels' entries, and those of the functions the module itself replaced by
        # their rewritten copies (codegen.template's _INTERPRETED_CALLS)
        # (a copy: an interpreted kernel of another library may add entries meanwhile)
        rewritten = InterpretedFunction.rewritten_fn
        for fn in [f for f in list(rewritten) if getattr(f, "__globals__", None) is namespace]:
            rewritten.pop(fn, None)


def _same(value):
    return value


def _serialize_launches(module) -> None:
    """Make ``kernel[grid](...)`` of each interpreted kernel in ``module`` hold
    ``INTERPRETER_LOCK``. Only the launch (``run``) is wrapped, on the instance: calls from one
    kernel to another stay plain, and module globals keep their Triton types."""
    from triton.runtime.interpreter import InterpretedFunction

    for value in list(vars(module).values()):
        if isinstance(value, InterpretedFunction) and "run" not in vars(value):
            value.run = serialized(value.run)


def serialized(run):
    """``run`` (an interpreted kernel's launch) holding ``INTERPRETER_LOCK``, the numpy
    scalar-conversion warnings of Triton's interpreter filtered."""
    def locked_run(*args, **kwargs):
        ignore_scalar_conversion()
        with INTERPRETER_LOCK:
            return run(*args, **kwargs)
    return locked_run


# this message, as a DeprecationWarning, from Triton's interpreter module only (the entry
# warnings.filterwarnings makes of it)
_IGNORED = ("ignore", re.compile(re.escape(_SCALAR_CONVERSION), re.I), DeprecationWarning,
            re.compile(r"triton\.runtime\.interpreter\Z"), 0)


def ignore_scalar_conversion() -> None:
    """Put the narrow filter of the interpreter's scalar-conversion warning first in the
    process's filters where it is not (a ``catch_warnings`` reset drops it, pytest's per test
    or a user's; a filter added since goes before it). Moved, never swapped:
    ``warnings.catch_warnings`` around each launch saved and restored the whole process-wide
    list, so a filter another thread added during a launch was lost when the launch returned."""
    if warnings.filters[:1] != [_IGNORED]:
        warnings.filterwarnings("ignore", message=re.escape(_SCALAR_CONVERSION),
                                category=DeprecationWarning,
                                module=r"triton\.runtime\.interpreter\Z")


def _release(version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else (0, 0)


def check_interpreter_numpy(numpy_version: str | None = None,
                            triton_version: str | None = None) -> None:
    """Raise InterpreterNumpyError where numpy breaks Triton's interpreter (numpy missing, or
    numpy >= 2.4 with a Triton whose interpreter converts arrays to scalars: 3.6 and older; 3.8
    has the fix), warn where flexfa's tests have not run it (numpy >= 2.3). Defaults: the
    installed versions."""
    import triton

    fix = 'pip install "numpy<2.3" (in a flexfa checkout: pip install -e ".[interpret]")'
    if numpy_version is None:
        try:
            import numpy
        except ImportError:
            raise InterpreterNumpyError(f"numpy is not installed, and Triton's CPU interpreter "
                                        f"(used for CPU tensors) needs it: {fix}") from None
        numpy_version = numpy.__version__
    triton_version = triton_version or triton.__version__
    numpy_release = _release(numpy_version)
    if numpy_release >= NUMPY_BREAKS_FROM and _release(triton_version) <= (3, 6):
        raise InterpreterNumpyError(
            f"numpy {numpy_version} is installed, but the CPU interpreter of Triton "
            f"{triton_version} (used for CPU tensors) fails with numpy >= "
            f"{'.'.join(map(str, NUMPY_BREAKS_FROM))}: {fix}")
    if numpy_release >= NUMPY_TESTED_BELOW:
        warnings.warn(f"numpy {numpy_version}: flexfa runs CPU tensors through Triton's "
                      f"interpreter and is tested with numpy < "
                      f"{'.'.join(map(str, NUMPY_TESTED_BELOW))}; if a kernel fails, {fix}",
                      RuntimeWarning, stacklevel=3)
