"""Where generated kernel sources live: the settings of the disk cache, and whether the
configured directory can be trusted, read and written.

The configured directory (``$FLEXFA_CACHE_DIR``, else ``~/.cache/flexfa``) is created
user-private (mode 0o700). It is trusted when it is a directory owned by this user or by root
and not writable by group or others: nobody else can plant a file flexfa would import (root
can do anything anyway). A trusted directory is written when it is writable by this user
according to its permission bits (checked even for root, who could otherwise write through a
read-only mode) and in fact (a probe file, which also catches read-only mounts). A trusted
read-only directory is still read: its valid kernels are imported, and the kernels it lacks
are written to a private fallback. An untrusted or missing-and-uncreatable directory is not
used at all. The fallback is one directory from ``tempfile.mkdtemp`` (0o700) per process,
removed when the process exits; ``warnings.warn`` says why it is used. A forked child (a
DataLoader worker) makes its own on first need, never writing into its parent's, which goes
when the parent exits, maybe while the child still runs; the child's goes at its exit
(``atexit``, and multiprocessing's exit for its children, which skip ``atexit``).
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing.util
import os
import shutil
import stat
import tempfile
import threading
import warnings
from pathlib import Path

from .. import config

log = logging.getLogger("flexfa")

_FALLBACK: list[Path] = []  # this process's private temporary cache, created on first need
_LOCK = threading.Lock()


def _forget_parents_fallback() -> None:
    """In a forked child: no private directory yet (the parent's is the parent's), and a
    lock no other thread of the parent can still hold."""
    global _LOCK
    _LOCK = threading.Lock()
    _FALLBACK.clear()


os.register_at_fork(after_in_child=_forget_parents_fallback)


def cache_dir() -> Path:
    """flexfa's disk cache (``flexfa.config``: ``$FLEXFA_CACHE_DIR``, else ~/.cache/flexfa)."""
    return config.cache_dir()


def max_bytes() -> int:
    """The disk cache's size bound (``flexfa.config``: ``$FLEXFA_CACHE_MAX_BYTES``)."""
    return config.cache_max_bytes()


def lock_timeout() -> float:
    """Seconds to wait for another process's lock on a kernel (``flexfa.config``)."""
    return config.cache_lock_timeout()


def untrusted(info: os.stat_result) -> str | None:
    """Why a file or directory with this ``stat`` may hold code flexfa did not write, or None."""
    if info.st_uid not in (os.geteuid(), 0):
        return f"is owned by uid {info.st_uid}, not by this user (uid {os.geteuid()}) or root"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by group or others (mode {oct(stat.S_IMODE(info.st_mode))})"
    return None


@dataclasses.dataclass(frozen=True)
class CacheDir:
    """The configured directory and what may be done with it."""

    path: Path
    problem: str | None  # why new kernels cannot be written there; None when they can
    readable: bool  # trusted: its valid kernels may be imported (read-only ones too)


def inspect_cache_dir(directory: Path | None = None) -> CacheDir:
    """Create ``directory`` (default: the configured one) 0o700 if missing, then check it."""
    directory = directory or cache_dir()
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = directory.stat()
    except OSError as exc:
        return CacheDir(directory, f"cannot be created ({exc.strerror or exc})", False)
    if not stat.S_ISDIR(info.st_mode):
        return CacheDir(directory, "is not a directory", False)
    problem = untrusted(info)
    if problem is not None:
        return CacheDir(directory, problem, False)
    if info.st_uid != os.geteuid() or not info.st_mode & stat.S_IWUSR:  # root too
        return CacheDir(directory, f"is read-only (mode {oct(stat.S_IMODE(info.st_mode))}, "
                                   f"owner uid {info.st_uid})", True)
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".flexfa-probe.")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return CacheDir(directory, f"is not writable ({exc.strerror or exc})", True)
    return CacheDir(directory, None, True)


def directory_problem(directory: Path) -> str | None:
    """None if ``directory`` (created 0o700 when missing) is a trusted, writable cache
    directory; else a phrase saying why not."""
    return inspect_cache_dir(directory).problem


def fallback_dir() -> Path:
    """This process's private temporary cache directory (0o700), created once (again if
    something removed it meanwhile)."""
    with _LOCK:
        if not _FALLBACK or not _FALLBACK[0].is_dir():
            path = Path(tempfile.mkdtemp(prefix="flexfa-cache-"))
            atexit.register(_remove, path, os.getpid())
            # a multiprocessing child ends in os._exit, after its finalizers, not atexit's
            multiprocessing.util.Finalize(None, _remove, (path, os.getpid()), exitpriority=0)
            _FALLBACK[:] = [path]
        return _FALLBACK[0]


def _remove(path: Path, creator: int) -> None:
    if os.getpid() == creator:  # a forked child exiting must not remove its parent's cache
        shutil.rmtree(path, ignore_errors=True)


def fall_back(directory: Path, problem: str, what: str = "") -> Path:
    """Warn that ``directory`` cannot be used (for ``what``, default: anything) and return
    the private temporary one."""
    fallback = fallback_dir()
    warnings.warn(f"flexfa: cache directory {directory} {problem}; using the private temporary "
                  f"directory {fallback}{what} for this process (set FLEXFA_CACHE_DIR to a "
                  "writable directory of your own to keep kernels across runs)", RuntimeWarning,
                  stacklevel=4)
    log.debug("flexfa: cache directory %s %s; falling back to %s", directory, problem, fallback)
    return fallback


def usable_cache_dir() -> Path:
    """The configured cache directory if it can be written, else the private temporary one."""
    configured = inspect_cache_dir()
    if configured.problem is None:
        return configured.path
    return fall_back(configured.path, configured.problem)
