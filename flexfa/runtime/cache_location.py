"""Where generated kernel sources are written: the configured cache directory if it can be
trusted and written, else a private temporary directory (with a warning).

The configured directory (``$FLEXFA_CACHE_DIR``, else ``~/.cache/flexfa``) is created
user-private (mode 0o700). It is used only if it is a directory owned by this user, not
writable by group or others (nobody else can plant a file flexfa would import), and writable
by this user according to its permission bits (checked even for root, who could otherwise
write through a read-only mode) and in fact (a probe file, which also catches read-only
mounts). Otherwise the process uses one directory from ``tempfile.mkdtemp`` (0o700), and
``warnings.warn`` says why; the temporary directory is removed when the process exits.
"""
from __future__ import annotations

import atexit
import logging
import os
import shutil
import stat
import tempfile
import threading
import warnings
from pathlib import Path

from .cli import cache_dir

log = logging.getLogger("flexfa")

_FALLBACK: list[Path] = []  # this process's private temporary cache, created on first need
_LOCK = threading.Lock()


def untrusted(info: os.stat_result) -> str | None:
    """Why a file or directory with this ``stat`` may hold code flexfa did not write, or None."""
    if info.st_uid != os.geteuid():
        return f"is owned by uid {info.st_uid}, not by this user (uid {os.geteuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by group or others (mode {oct(stat.S_IMODE(info.st_mode))})"
    return None


def directory_problem(directory: Path) -> str | None:
    """None if ``directory`` (created 0o700 when missing) is a trusted, writable cache
    directory; else a phrase saying why not."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = directory.stat()
    except OSError as exc:
        return f"cannot be created ({exc.strerror or exc})"
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    problem = untrusted(info)
    if problem is not None:
        return problem
    if not info.st_mode & stat.S_IWUSR:  # owned by this user (checked above); root too
        return f"is read-only (mode {oct(stat.S_IMODE(info.st_mode))})"
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".probe.")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"is not writable ({exc.strerror or exc})"
    return None


def fallback_dir() -> Path:
    """This process's private temporary cache directory (0o700), created once."""
    with _LOCK:
        if not _FALLBACK:
            path = Path(tempfile.mkdtemp(prefix="flexfa-cache-"))
            atexit.register(_remove, path, os.getpid())
            _FALLBACK.append(path)
        return _FALLBACK[0]


def _remove(path: Path, creator: int) -> None:
    if os.getpid() == creator:  # a forked child exiting must not remove its parent's cache
        shutil.rmtree(path, ignore_errors=True)


def is_fallback(directory: Path) -> bool:
    return bool(_FALLBACK) and directory == _FALLBACK[0]


def fall_back(directory: Path, problem: str) -> Path:
    """Warn that ``directory`` cannot be used and return the private temporary one."""
    fallback = fallback_dir()
    warnings.warn(f"flexfa: cache directory {directory} {problem}; using the private temporary "
                  f"directory {fallback} for this process (set FLEXFA_CACHE_DIR to a writable "
                  "directory of your own to keep kernels across runs)", RuntimeWarning,
                  stacklevel=4)
    log.debug("flexfa: cache directory %s %s; falling back to %s", directory, problem, fallback)
    return fallback


def usable_cache_dir() -> Path:
    """The configured cache directory if usable, else the private temporary one."""
    directory = cache_dir()
    problem = directory_problem(directory)
    return directory if problem is None else fall_back(directory, problem)
