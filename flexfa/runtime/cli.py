"""``python -m flexfa cache <path|size|clear>``: look at or empty flexfa's disk cache."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

USAGE = """usage: python -m flexfa cache <command>

commands:
  path    print the cache directory
  size    print the cache directory, its file count and size
  clear   delete everything in the cache directory (generated kernel sources)"""


def cache_dir() -> Path:
    """flexfa's disk cache: ``$FLEXFA_CACHE_DIR``, else ``~/.cache/flexfa``."""
    configured = os.environ.get("FLEXFA_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "flexfa"


def cache_size(directory: Path) -> tuple[int, int]:
    """(file count, total bytes) under ``directory``; (0, 0) when it does not exist."""
    files = size = 0
    for root, _, names in os.walk(directory):
        for name in names:
            try:
                size += os.path.getsize(os.path.join(root, name))
                files += 1
            except OSError:  # removed while walking
                continue
    return files, size


def clear(directory: Path) -> tuple[int, int]:
    """Delete the contents of ``directory`` (kept itself); returns what was removed."""
    resolved = directory.resolve()
    if resolved == Path(resolved.anchor) or resolved == Path.home().resolve():
        raise ValueError(f"refusing to clear {resolved}: FLEXFA_CACHE_DIR points at a root or "
                         "home directory, not a cache")
    removed = cache_size(resolved)
    if resolved.is_dir():
        for entry in resolved.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    return removed


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    if not argv or argv[0] in ("-h", "--help", "help") or len(argv) > 1:
        print(USAGE, file=sys.stdout if argv and argv[0] in ("-h", "--help", "help") else sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help", "help") else 2
    directory = cache_dir()
    command = argv[0]
    if command == "path":
        print(directory)
    elif command == "size":
        files, size = cache_size(directory)
        print(f"{directory}: {files} files, {size} bytes")
    elif command == "clear":
        try:
            files, size = clear(directory)
        except ValueError as exc:
            print(f"flexfa cache clear: {exc}", file=sys.stderr)
            return 1
        print(f"cleared {directory}: removed {files} files, {size} bytes")
    else:
        print(f"unknown cache command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return 0
