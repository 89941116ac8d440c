"""The kernel cache: in-process memo -> generated source on disk -> imported module.

Disk layout: ``$FLEXFA_CACHE_DIR/<kernel name>.py`` (default ``~/.cache/flexfa``); the name
carries 12 hex digits of the cache key, and the first line of the file carries the full key,
a sha256 of the rest and the build tag (``versions.build_tag``), so a truncated or garbage
file is detected and regenerated with a warning, and another build's files can be pruned.
Writers take an fcntl lock on ``<name>.lock`` (waiting at most ``lock_timeout()``; past it
the kernel is generated privately, with a warning), look again after getting it, and write
a temp file then ``os.replace`` it: readers never see a torn file. Triton's own cache then
keeps the compiled binaries. ``cache_files`` bounds the directory's size.

Directories (``cache_location``): the configured one when trusted and writable; a trusted
read-only one is read, and the kernels it lacks are written to a private temporary one;
anything else is replaced by the private one, with a warning; where no directory takes a
kernel (every disk full), its source is generated in memory, with a warning. A file not
owned by this user (or root), or writable by others, is never imported (it is regenerated
with a warning); so is one whose header does not match its content. The text that passed these checks is what
is imported (``loader.load_module``), never Python's bytecode of the file.

``get_module(name, key, interpret, generate)`` is the one entry point; ``STATS`` counts what
happened (tests use it to see that a second call or a second process skips code generation).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from ..codegen.spec import EMULATE
from ..codegen.versions import build_tag
from ..memo import BoundedMemo, clear_all
from .cache_files import HEADER_PREFIX, claim, note_written, write_atomic
from .cache_location import (fall_back, fallback_dir, inspect_cache_dir, lock_timeout, max_bytes,
                             untrusted, usable_cache_dir)
from .debug import debug
from ..loader import load_module, unload

log = logging.getLogger("flexfa")

_HEADER = HEADER_PREFIX + "key={key} sha256={digest} build={build}\n"
TOUCH_AFTER_S = 3600.0  # a load refreshes a file's mtime (its last use, for pruning) hourly


@dataclasses.dataclass
class CacheStats:
    codegen: int = 0  # sources generated (the expensive path)
    disk_hits: int = 0  # valid sources found on disk
    memo_hits: int = 0  # modules found in this process
    regenerated: int = 0  # corrupt files replaced

    def reset(self) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, 0)


STATS = CacheStats()
MAX_MODULES = 2048  # kernel modules kept imported in this process (least recently used go)


def _forget_module(key, module) -> None:
    """An evicted kernel module leaves sys.modules and linecache too (``loader.unload``;
    plans holding its kernels keep them alive while they live, and they run without its
    text; the disk cache still has the source)."""
    unload(module)


_MEMO = BoundedMemo(MAX_MODULES, "kernel modules", on_evict=_forget_module)
_LOCK = threading.RLock()


def kernel_path(name: str, directory: Path | None = None) -> Path:
    return (directory or usable_cache_dir()) / f"{name}.py"


def _with_header(key: str, source: str) -> str:
    digest = hashlib.sha256(source.encode()).hexdigest()
    return _HEADER.format(key=key, digest=digest, build=build_tag()) + source


def read_source(path: Path, key: str) -> tuple[str | None, str | None]:
    """(source, None) if ``path`` holds a complete file for ``key``; else (None, why)."""
    try:
        with open(path, encoding="utf-8") as handle:
            problem = untrusted(os.fstat(handle.fileno()))
            text = handle.read()
    except FileNotFoundError:
        return None, None
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"unreadable ({exc})"
    if problem is not None:
        return None, f"untrusted: it {problem}"
    header, _, source = text.partition("\n")
    expected = _with_header(key, source).partition("\n")[0]
    if header == expected:
        return source, None
    if not header.startswith(HEADER_PREFIX):
        return None, "no flexfa header"
    if f"key={key} " not in header + " ":
        return None, "written for another cache key"
    if f" build={build_tag()}" not in header:
        return None, "written by another build"
    return None, "checksum mismatch (truncated or modified)"


class LockTimeout(TimeoutError):
    """Another process held a cache lock longer than ``lock_timeout()``."""


@contextlib.contextmanager
def file_lock(path: Path, timeout: float | None = None):
    """An exclusive fcntl lock on ``path`` (created if missing) across processes; raises
    ``LockTimeout`` after ``timeout`` seconds (default ``lock_timeout()``) of waiting."""
    import fcntl
    timeout = lock_timeout() if timeout is None else timeout
    with open(path, "a+") as handle:
        deadline, pause = time.monotonic() + timeout, 0.001
        while True:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise LockTimeout(f"the lock {path} was held by another process for "
                                      f"{timeout:g} s") from None
                time.sleep(pause)
                pause = min(2 * pause, 0.05)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def ensure_source(name: str, key: str, generate: Callable[[], str]) -> tuple[Path, str]:
    """The path of a valid source file for ``key``, generating it if needed, and its text as
    checked (what is then imported: the file is not read again). A trusted
    read-only directory is only read; a directory that cannot be used, or fails a write
    (full, made read-only meanwhile), and a lock held too long by another process send the
    kernel to the private directory, with a warning."""
    # the settings first: a bad one then fails every call that needs the disk alike, not
    # once in claiming the directory, once after writing the kernel, and then never
    max_bytes(), lock_timeout()
    configured = inspect_cache_dir()
    generate = _once(generate)  # a failed write sends the same text to the next directory
    try:
        if configured.problem is None:
            try:
                claim(configured.path)
                return _ensure_source_in(configured.path, name, key, generate)
            except LockTimeout as exc:
                fallback = fallback_dir()
                warnings.warn(f"flexfa: {exc}; generating kernel {name} privately in "
                              f"{fallback} (FLEXFA_CACHE_LOCK_TIMEOUT sets the wait)",
                              RuntimeWarning, stacklevel=3)
            except OSError as exc:
                fallback = fall_back(configured.path, f"failed a write ({exc})")
        else:
            if configured.readable:
                path = kernel_path(name, configured.path)
                source = read_source(path, key)[0]
                if source is not None:
                    STATS.disk_hits += 1
                    return path, _with_header(key, source)
            fallback = fall_back(configured.path, configured.problem, f" for kernel {name}")
        return _ensure_source_in(fallback, name, key, generate)
    except OSError as exc:  # the private directory cannot be made or written either
        return _unwritten(kernel_path(name, configured.path), name, key, generate, exc)


def _unwritten(path: Path, name: str, key: str, generate: Callable[[], str],
               exc: OSError) -> tuple[Path, str]:
    """``path`` (not written) and the source generated in memory, for when no directory
    takes it (every disk full, no writable temporary directory): the call still runs (the
    loader imports the text, and ``inspect`` reads it from ``linecache``), and the kernel is
    generated again in each process, or after its module leaves this process's memo."""
    warnings.warn(f"flexfa: no cache directory could take kernel {name} ({exc}); it is "
                  "generated in memory for this process only", RuntimeWarning, stacklevel=4)
    return path, _with_header(key, generate())


def _once(generate: Callable[[], str]) -> Callable[[], str]:
    """``generate`` called at most once (counted in ``STATS.codegen``), its text kept."""
    made: list[str] = []

    def generate_once() -> str:
        if not made:
            made.append(generate())
            STATS.codegen += 1
        return made[0]
    return generate_once


def _touch(path: Path) -> None:
    """Mark ``path`` as used (its mtime orders pruning), at most once per ``TOUCH_AFTER_S``
    (not a write per load)."""
    with contextlib.suppress(OSError):
        if time.time() - path.stat().st_mtime > TOUCH_AFTER_S:
            os.utime(path)


def _ensure_source_in(directory: Path, name: str, key: str,
                      generate: Callable[[], str]) -> tuple[Path, str]:
    path = kernel_path(name, directory)
    source, problem = read_source(path, key)
    if source is not None:
        STATS.disk_hits += 1
        _touch(path)
        return path, _with_header(key, source)
    if problem is not None:
        warnings.warn(f"flexfa: cached kernel {path} is invalid ({problem}); regenerating it",
                      RuntimeWarning, stacklevel=4)
    with file_lock(path.with_suffix(".lock")):
        source, problem_now = read_source(path, key)  # another process may have written it
        if source is not None:
            STATS.disk_hits += 1
            return path, _with_header(key, source)
        source = generate()
        if problem is not None or problem_now is not None:
            STATS.regenerated += 1
        text = _with_header(key, source)
        write_atomic(path, text)
    note_written(directory, len(text))
    log.debug("flexfa: generated %s", path)
    return path, text


def get_module(name: str, key: str, interpret: bool | str, generate: Callable[[], str]):
    """The imported kernel module ``name`` (interpreted, compiled, or with ``interpret``
    EMULATE a Gluon module run by runtime.gluon_emulator), from memo, disk or ``generate()``;
    each mode's copy is its own memo entry."""
    memo_key = (key, interpret)
    module = _MEMO.get(memo_key)
    if module is not None:
        STATS.memo_hits += 1
        return module
    with _LOCK:
        module = _MEMO.get(memo_key)
        if module is None:
            suffix = {True: "interp", False: "jit", EMULATE: "emu"}[interpret]
            module_name = f"flexfa_kernels.{name}_{suffix}"
            # the checked text is what runs (another process may prune the file meanwhile)
            path, text = ensure_source(name, key, generate)
            module = _load(path, text, interpret, module_name)
            debug(f"kernel {name}", f"source: {path}")
            _MEMO[memo_key] = module
        else:
            STATS.memo_hits += 1
    return module


def _load(path, text: str, interpret: bool | str, module_name: str):
    if interpret == EMULATE:
        from .gluon_emulator import load_emulated
        return load_emulated(str(path), module_name, text)
    return load_module(path, interpret, module_name=module_name, source=text)


def clear_memo() -> None:
    """Forget the modules loaded in this process and every memo built on them (the disk
    cache stays)."""
    with _LOCK:
        for module in _MEMO.values():
            unload(module)
        _MEMO.clear()
        clear_all()
