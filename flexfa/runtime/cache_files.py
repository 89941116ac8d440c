"""Which files in a cache directory are flexfa's, and deleting them: ``clear``, ``prune``, the
size bound and the pruning of another build's kernels.

flexfa writes, in its cache directory, only: the marker ``.flexfa-cache`` (the build that last
used the directory), kernel sources ``flexfa_*.py`` whose first line is a flexfa header, their
empty lock files ``flexfa_*.lock``, the bytecode Python wrote for them before kernels were
compiled from their checked text (``__pycache__/flexfa_*.pyc``), the autotuning store ``autotune.json`` and ``autotune.lock``,
and short-lived temporary files (``.flexfa_*.tmp``, ``.autotune.*.tmp``, ``.flexfa-probe.*``).
Nothing else is ever deleted, symbolic links are never followed or removed, and a directory
with neither the marker nor a flexfa kernel is refused as "not a flexfa cache".

Bounds (docs/caching.md): the first time a process uses a writable cache directory whose
marker names another build (flexfa, Triton or torch version, or flexfa's kernel-generating
sources), it deletes the kernels of every other build. Each process that writes kernels keeps
an estimate of the directory's size (one scan at its first write, then its own writes added);
past ``max_bytes()`` it deletes the least recently used kernels (by modification time, which
a load refreshes hourly) down to three quarters of the bound.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import tempfile
import threading
import time
from pathlib import Path

from ..codegen.versions import build_tag
from .cache_location import max_bytes

MARKER = ".flexfa-cache"
HEADER_PREFIX = "# flexfa-kernel "
ORPHAN_AGE_S = 3600.0  # a lock, bytecode or temp file without a kernel is left this long
RECENT_S = 60.0  # the size bound spares kernels this new: they may be about to be imported
_AUTOTUNE = frozenset({"autotune.json", "autotune.lock"})
_SOURCE = re.compile(r"flexfa_\w+\.py")  # and the header, checked by reading the first line
_BYTECODE = re.compile(r"(flexfa_\w+)\.[\w-]+\.pyc")  # in __pycache__
# (pattern of a file name, kind) for the directory itself
_PATTERNS = ((_SOURCE, "source"), (re.compile(r"flexfa_\w+\.lock"), "lock"),
             (re.compile(r"\.(flexfa_\w+|autotune|\.flexfa-cache)\.\w+\.tmp|\.flexfa-probe\.\w+"),
              "temp"))
_STATE_LOCK = threading.Lock()
_CLAIMED: set[Path] = set()  # directories this process has checked the marker of
_SIZES: dict[Path, int] = {}  # estimated bytes of kernels per directory, after a first write


@dataclasses.dataclass(frozen=True)
class CacheFile:
    path: Path
    kind: str  # "source", "lock", "bytecode", "temp" or "autotune"
    stem: str  # the kernel's name ("" for temp and autotune files)
    size: int
    mtime: float
    build: str | None = None  # a source's build tag (None: written before tags existed)


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


def header_build(path: Path) -> tuple[bool, str | None]:
    """(whether ``path`` starts with a flexfa header, the build tag it names)."""
    try:
        with open(path, "rb") as handle:
            line = handle.readline(1024).decode("utf-8", "replace")
    except OSError:
        return False, None
    if not line.startswith(HEADER_PREFIX):
        return False, None
    build = re.search(r" build=(\w+)", line)
    return True, build.group(1) if build else None


def _entry(entry: os.DirEntry, kind: str, stem: str = "") -> CacheFile | None:
    try:
        info = entry.stat(follow_symlinks=False)
    except OSError:  # removed meanwhile
        return None
    build = None
    if kind == "source":
        flexfa_written, build = header_build(Path(entry.path))
        if not flexfa_written:
            return None
    if kind == "lock" and info.st_size:  # flexfa's locks stay empty
        return None
    return CacheFile(Path(entry.path), kind, stem, info.st_size, info.st_mtime, build)


def _regular_files(directory: Path | None):
    """The plain files (no links) in ``directory``; none for a missing one or None."""
    if directory is None:
        return
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        with os.scandir(directory) as entries:
            yield from (e for e in entries if e.is_file(follow_symlinks=False))


def flexfa_files(directory: Path) -> list[CacheFile]:
    """Every file in ``directory`` that flexfa wrote, the marker excepted."""
    found = []
    for entry in _regular_files(directory):
        kind = "autotune" if entry.name in _AUTOTUNE else next(
            (kind for pattern, kind in _PATTERNS if pattern.fullmatch(entry.name)), None)
        stem = entry.name.rsplit(".", 1)[0] if kind in ("source", "lock") else ""
        found.append(_entry(entry, kind, stem) if kind else None)
    for entry in _regular_files(_bytecode_dir(directory)):
        match = _BYTECODE.fullmatch(entry.name)
        found.append(_entry(entry, "bytecode", match.group(1)) if match else None)
    return [f for f in found if f is not None]


def _bytecode_dir(directory: Path) -> Path | None:
    """``directory``'s ``__pycache__``, or None for a link (never followed: its target is
    not flexfa's)."""
    bytecode = directory / "__pycache__"
    return None if bytecode.is_symlink() else bytecode


def _delete(files) -> tuple[int, int]:
    """Unlink ``files``; (count, bytes) of those removed (another process may be first)."""
    count = size = 0
    for file in files:
        with contextlib.suppress(FileNotFoundError):
            file.path.unlink()
            count, size = count + 1, size + file.size
    return count, size


def _drop_empty_bytecode_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # missing, not empty, or a link: left alone
        if not (directory / "__pycache__").is_symlink():
            (directory / "__pycache__").rmdir()


def clear(directory: Path) -> tuple[int, int, int]:
    """Delete flexfa's files in ``directory`` (the directory and its marker stay); returns
    (files removed, bytes removed, other entries left alone)."""
    resolved = directory.resolve()
    if resolved == Path(resolved.anchor) or resolved == Path.home().resolve():
        raise ValueError(f"refusing to clear {resolved}: FLEXFA_CACHE_DIR points at a root or "
                         "home directory, not a cache")
    files = flexfa_files(resolved)
    ours = {MARKER, "__pycache__"} | {f.path.name for f in files}
    others = [p for p in (resolved.iterdir() if resolved.is_dir() else ()) if p.name not in ours]
    if others and not (resolved / MARKER).is_file() and not any(f.kind == "source" for f in files):
        raise ValueError(f"refusing to clear {resolved}: it has no {MARKER} marker and no flexfa "
                         f"kernel, so it does not look like a flexfa cache ({len(others)} other "
                         "entries, e.g. " + ", ".join(sorted(p.name for p in others)[:3]) + ")")
    removed = _delete(files)
    _drop_empty_bytecode_dir(resolved)
    with _STATE_LOCK:
        _SIZES.pop(resolved, None)
        _SIZES.pop(directory, None)
    return (*removed, len(others))


@dataclasses.dataclass(frozen=True)
class PruneResult:
    removed_files: int
    removed_bytes: int
    kept_kernels: int
    kept_bytes: int


def prune(directory: Path, limit: int | None = None, older_than_s: float | None = None,
          now: float | None = None) -> PruneResult:
    """Delete from ``directory`` the kernels of other builds, those unused for
    ``older_than_s`` seconds, then the least recently used ones beyond ``limit`` bytes
    (default ``max_bytes()``; kernels written in the last minute are spared), with their lock
    and bytecode files; lock, bytecode and temp files left without a kernel for an hour go
    too. The autotuning store stays."""
    limit = max_bytes() if limit is None else limit
    now = time.time() if now is None else now
    files = flexfa_files(directory)
    kernels = {f.stem: f for f in files if f.kind == "source"}
    groups = {stem: [] for stem in kernels}  # a kernel's source, lock and bytecode
    for file in files:
        groups.get(file.stem, []).append(file)
    doomed = [stem for stem, source in kernels.items() if source.build != build_tag()
              or (older_than_s is not None and source.mtime < now - older_than_s)]
    kept = sorted((s for s in kernels if s not in doomed), key=lambda s: kernels[s].mtime)
    sizes = {stem: sum(f.size for f in group) for stem, group in groups.items()}
    total = sum(sizes[stem] for stem in kept)
    while kept and total > limit and kernels[kept[0]].mtime < now - RECENT_S:
        stem = kept.pop(0)  # the least recently used
        doomed.append(stem)
        total -= sizes[stem]
    orphans = [f for f in files if f.kind in ("lock", "bytecode", "temp")
               and f.stem not in kernels and f.mtime < now - ORPHAN_AGE_S]
    count, size = _delete([f for stem in doomed for f in groups[stem]] + orphans)
    _drop_empty_bytecode_dir(directory)
    with _STATE_LOCK:
        _SIZES[directory] = total
    return PruneResult(count, size, len(kept), total)


def claim(directory: Path) -> None:
    """Once per process and writable directory: write the marker for this build; when it
    named another build, first delete that build's kernels (``prune``)."""
    if directory in _CLAIMED:
        return
    with _STATE_LOCK:
        if directory in _CLAIMED:
            return
        _CLAIMED.add(directory)
    marker = directory / MARKER
    text = f"flexfa kernel cache (python -m flexfa cache --help)\nbuild={build_tag()}\n"
    try:
        if marker.read_text() == text:
            return
    except (OSError, UnicodeDecodeError):
        pass
    prune(directory)
    write_atomic(marker, text)


def _kernel_bytes(directory: Path) -> int:
    """Bytes of the kernel sources and their bytecode in ``directory``, by name only (a stat
    per file, no reads): the estimate ``note_written`` starts from."""
    total = 0
    for folder, pattern in ((directory, _SOURCE), (_bytecode_dir(directory), _BYTECODE)):
        for entry in _regular_files(folder):
            if pattern.fullmatch(entry.name):
                with contextlib.suppress(OSError):
                    total += entry.stat(follow_symlinks=False).st_size
    return total


def note_written(directory: Path, size: int) -> None:
    """Count ``size`` new bytes in ``directory`` (whose first count is a scan that includes
    them); prune it past the size bound."""
    with _STATE_LOCK:
        known = _SIZES.get(directory)
    known = _kernel_bytes(directory) if known is None else known + size
    with _STATE_LOCK:
        _SIZES[directory] = known
    limit = max_bytes()
    if known > limit:
        prune(directory, limit * 3 // 4)
