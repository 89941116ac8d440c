"""Importing generated kernel sources as modules, interpreted or compiled.

Triton decides at decoration time whether ``@triton.jit`` makes an interpreted function
(``TRITON_INTERPRET=1``) or a compiled one, so a module is imported with that variable set
for the duration of the import: CPU tensors get an interpreted copy, CUDA tensors a compiled
one, from the same file, and the two copies live side by side under different module names.

Interpreted launches are serialized by ``INTERPRETER_LOCK``: Triton's interpreter keeps the
current program id in one process-wide builder and patches ``triton.language`` while a kernel
runs, so two threads launching at once would read each other's program ids (wrong results or
crashes). Compiled launches are not affected.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import threading
from pathlib import Path

_ENV_LOCK = threading.Lock()
INTERPRETER_LOCK = threading.RLock()


@contextlib.contextmanager
def triton_mode(interpret: bool):
    """Set ``TRITON_INTERPRET`` for the block (Triton reads it when a kernel is decorated)."""
    with _ENV_LOCK:
        old = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
        try:
            yield
        finally:
            if old is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = old


def load_module(path: str | Path, interpret: bool, module_name: str | None = None):
    """Import the Python file at ``path``; its kernels are interpreted iff ``interpret``."""
    path = Path(path)
    name = module_name or f"flexfa_generated.{path.stem}_{'interp' if interpret else 'jit'}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, f"cannot import {path}"
    module = importlib.util.module_from_spec(spec)
    with triton_mode(interpret):
        spec.loader.exec_module(module)
    if interpret:
        _serialize_launches(module)
    # Triton's compiled path looks kernels' modules up by name (for their globals/source)
    sys.modules[name] = module
    return module


def _serialize_launches(module) -> None:
    """Make ``kernel[grid](...)`` of each interpreted kernel in ``module`` hold
    ``INTERPRETER_LOCK``. Only the launch (``run``) is wrapped, on the instance: calls from one
    kernel to another stay plain, and module globals keep their Triton types."""
    from triton.runtime.interpreter import InterpretedFunction

    for value in list(vars(module).values()):
        if isinstance(value, InterpretedFunction) and "run" not in vars(value):
            value.run = _locked(value.run)


def _locked(run):
    def locked_run(*args, **kwargs):
        with INTERPRETER_LOCK:
            return run(*args, **kwargs)
    return locked_run
