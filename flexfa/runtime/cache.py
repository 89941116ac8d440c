"""The kernel cache: in-process memo -> generated source on disk -> imported module.

Disk layout: ``$FLEXFA_CACHE_DIR/<kernel name>.py`` (default ``~/.cache/flexfa``); the name
carries 12 hex digits of the cache key, and the first line of the file carries the full key
and a sha256 of the rest, so a truncated or garbage file is detected and regenerated with a
warning. Writers take an fcntl lock on ``<name>.lock``, look again after getting it, and
write a temp file then ``os.replace`` it: readers never see a torn file. Triton's own cache
then keeps the compiled binaries.

The directory is ``cache_location.usable_cache_dir()``: the configured one, created 0o700, when it
is owned by this user, not writable by others and writable; else a private temporary one,
with a warning. A file not owned by this user, or writable by others, is never imported (it
is regenerated with a warning); so is one whose header does not match its content.

``get_module(name, key, interpret, generate)`` is the one entry point; ``STATS`` counts what
happened (tests use it to see that a second call or a second process skips code generation).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import tempfile
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

from .cache_location import fall_back, is_fallback, untrusted, usable_cache_dir
from .debug import debug
from .loader import load_module

log = logging.getLogger("flexfa")

_HEADER = "# flexfa-kernel key={key} sha256={digest}\n"


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
_MEMO: dict[tuple[str, bool], object] = {}
_LOCK = threading.RLock()
_DERIVED_MEMOS: list[dict] = []  # per-signature memos built on top of this one


def register_memo(memo: dict) -> dict:
    """Register a memo of things derived from loaded modules, cleared with ``clear_memo``."""
    _DERIVED_MEMOS.append(memo)
    return memo


def kernel_path(name: str, directory: Path | None = None) -> Path:
    return (directory or usable_cache_dir()) / f"{name}.py"


def _with_header(key: str, source: str) -> str:
    digest = hashlib.sha256(source.encode()).hexdigest()
    return _HEADER.format(key=key, digest=digest) + source


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
    if not header.startswith("# flexfa-kernel "):
        return None, "no flexfa header"
    if f"key={key} " not in header + " ":
        return None, "written for another cache key"
    return None, "checksum mismatch (truncated or modified)"


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temp file in the same directory, then rename it over ``path``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def file_lock(path: Path):
    """An exclusive fcntl lock on ``path`` (created if missing) across processes."""
    import fcntl
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def ensure_source(name: str, key: str, generate: Callable[[], str]) -> Path:
    """The path of a valid source file for ``key``, generating it if needed; a directory
    that fails a write (full, made read-only meanwhile) is replaced by the private one."""
    directory = usable_cache_dir()
    try:
        return _ensure_source_in(directory, name, key, generate)
    except OSError as exc:
        if is_fallback(directory):
            raise
        fallback = fall_back(directory, f"failed a write ({exc})")
        return _ensure_source_in(fallback, name, key, generate)


def _ensure_source_in(directory: Path, name: str, key: str, generate: Callable[[], str]) -> Path:
    path = kernel_path(name, directory)
    source, problem = read_source(path, key)
    if source is not None:
        STATS.disk_hits += 1
        return path
    if problem is not None:
        warnings.warn(f"flexfa: cached kernel {path} is invalid ({problem}); regenerating it",
                      RuntimeWarning, stacklevel=4)
    with file_lock(path.with_suffix(".lock")):
        source, problem_now = read_source(path, key)  # another process may have written it
        if source is not None:
            STATS.disk_hits += 1
            return path
        source = generate()
        STATS.codegen += 1
        if problem is not None or problem_now is not None:
            STATS.regenerated += 1
        write_atomic(path, _with_header(key, source))
    log.debug("flexfa: generated %s", path)
    return path


def get_module(name: str, key: str, interpret: bool, generate: Callable[[], str]):
    """The imported kernel module ``name`` (interpreted or compiled), from memo, disk or
    ``generate()``; the interpreted and compiled copies are separate memo entries."""
    memo_key = (key, interpret)
    module = _MEMO.get(memo_key)
    if module is not None:
        STATS.memo_hits += 1
        return module
    with _LOCK:
        module = _MEMO.get(memo_key)
        if module is None:
            path = ensure_source(name, key, generate)
            debug(f"kernel {name}", f"source: {path}")
            mode = "interp" if interpret else "jit"
            module = load_module(path, interpret, module_name=f"flexfa_kernels.{name}_{mode}")
            _MEMO[memo_key] = module
        else:
            STATS.memo_hits += 1
    return module


def clear_memo() -> None:
    """Forget the modules loaded in this process (the disk cache stays)."""
    with _LOCK:
        _MEMO.clear()
        for memo in _DERIVED_MEMOS:
            memo.clear()
