"""Process-wide settings: the only module of flexfa that reads the environment.

What a call runs (kernel family, tiles, TMA, split-KV, the dS workspace, ...) is chosen per
call through ``kernel_options`` (``flexfa.runtime.options``), never here. The environment sets
only what belongs to the process:

| variable | default | meaning |
| --- | --- | --- |
| ``FLEXFA_CACHE_DIR`` | ``~/.cache/flexfa`` | the disk cache of generated kernel sources |
| ``FLEXFA_CACHE_MAX_BYTES`` | 256 MiB | its size bound (least recently used kernels go) |
| ``FLEXFA_CACHE_LOCK_TIMEOUT`` | 30 s | wait for another process's lock, then generate privately |
| ``FLEXFA_DEBUG`` | off | log the IR after each step and the generated sources' paths |
| ``FLEXFA_AUTOTUNE`` | on | time candidate tiles on a GPU the first time a class is met |
| ``FLEXFA_BACKEND`` | ``AUTO`` | the default of ``kernel_options["BACKEND"]`` |

``TRITON_INTERPRET`` is Triton's own switch; flexfa never sets it: a generated module is
imported with the mode it needs on its own thread only (``loader.interpret_mode``).
"""
from __future__ import annotations

import os
from pathlib import Path

from .errors import InputError

DEFAULT_CACHE_MAX_BYTES = 256 * 2 ** 20  # about 10,000 kernel sources of 20-40 kB
DEFAULT_LOCK_TIMEOUT_S = 30.0  # generating a source takes well under a second
_OFF = ("", "0", "false", "no", "off")


def _working_directory() -> str | None:
    try:
        return os.getcwd()
    except OSError:  # removed from under the process
        return None


# a relative FLEXFA_CACHE_DIR is taken from here: the directory the process was in when it
# imported flexfa (where a command line setting the variable was run)
_START_DIRECTORY = _working_directory()


def cache_dir() -> Path:
    """flexfa's disk cache: ``$FLEXFA_CACHE_DIR``, else ``~/.cache/flexfa``; absolute. A
    relative value is taken from the directory the process was in when it imported flexfa,
    not from the current one: a kernel generated after an ``os.chdir`` goes where the kernels
    before it went (the paths of imported kernels, and other processes' locks, name it)."""
    configured = os.environ.get("FLEXFA_CACHE_DIR")
    if not configured:
        return Path.home() / ".cache" / "flexfa"
    path = Path(configured).expanduser()
    return Path(os.path.normpath(Path(_START_DIRECTORY or os.getcwd()) / path))


def _positive(name: str, default: float, kind: type) -> float:
    text = os.environ.get(name)
    if text is None or not text.strip():
        return default
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not value > 0:
        raise InputError(f"{name}={text!r} is not a positive {kind.__name__} "
                         f"(default {default!r})")
    return value


def cache_max_bytes() -> int:
    """The disk cache's size bound: ``$FLEXFA_CACHE_MAX_BYTES``, else 256 MiB."""
    return _positive("FLEXFA_CACHE_MAX_BYTES", DEFAULT_CACHE_MAX_BYTES, int)


def cache_lock_timeout() -> float:
    """Seconds to wait for another process's lock on a kernel: ``$FLEXFA_CACHE_LOCK_TIMEOUT``."""
    return _positive("FLEXFA_CACHE_LOCK_TIMEOUT", DEFAULT_LOCK_TIMEOUT_S, float)


def debug_enabled() -> bool:
    return os.environ.get("FLEXFA_DEBUG", "0").strip().lower() not in _OFF


def autotune_enabled() -> bool:
    return os.environ.get("FLEXFA_AUTOTUNE", "1").strip().lower() not in _OFF


def default_backend() -> str:
    """``$FLEXFA_BACKEND`` (validated with the kernel_options), else ``"AUTO"``."""
    return os.environ.get("FLEXFA_BACKEND", "").strip().upper() or "AUTO"


def settings() -> dict[str, str]:
    """The FLEXFA_* variables set in this process (``python -m flexfa info``)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("FLEXFA_")}


def triton_interpret() -> str | None:
    """Triton's ``TRITON_INTERPRET`` as this process has it (None: unset)."""
    return os.environ.get("TRITON_INTERPRET")


def environment(name: str, default: str | None = None) -> str | None:
    """A variable that tools (benchmarks, their output folder ``OUT``) read; never one that
    chooses a kernel."""
    return os.environ.get(name, default)
