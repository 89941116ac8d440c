"""``python -m flexfa cache <path|size|clear|prune>``: look at, empty or trim flexfa's disk
cache. Only files flexfa wrote are ever deleted (``cache_files``)."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .cache_location import cache_dir, max_bytes

__all__ = ["cache_dir", "cache_size", "main"]
_UNITS = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}


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


def _byte_count(text: str) -> int:
    """``text`` as bytes: an integer with an optional K, M or G (powers of 1024)."""
    unit = text[-1:].upper() if text[-1:].upper() in _UNITS else ""
    try:
        value = int(text[:len(text) - len(unit)]) * _UNITS[unit]
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"--max-bytes {text!r} is not a byte count such as "
                                         "268435456, 256M or 1G")
    return value


def _days(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"--older-than {text!r} is not a number of days >= 0")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flexfa cache",
        description="flexfa's disk cache of generated kernel sources ($FLEXFA_CACHE_DIR, "
                    "default ~/.cache/flexfa). Only files flexfa wrote are deleted.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="<command>")
    commands.add_parser("path", help="print the cache directory")
    commands.add_parser("size", help="print the directory's file count and size, and flexfa's "
                                     "share of it")
    commands.add_parser("clear", help="delete every file flexfa wrote there (refused for a "
                                      "directory that does not look like a flexfa cache)")
    prune = commands.add_parser(
        "prune", help="delete other builds' kernels, then the least recently used ones "
                      "beyond the size bound")
    prune.add_argument("--max-bytes", type=_byte_count, default=None,
                       help="size bound (default: $FLEXFA_CACHE_MAX_BYTES or 256M)")
    prune.add_argument("--older-than", type=_days, default=None, metavar="DAYS",
                       help="also delete kernels unused for this many days")
    return parser


def _run(args: argparse.Namespace, directory: Path) -> int:
    from . import cache_files

    if args.command == "path":
        print(directory)
        return 0
    if directory.exists() and not directory.is_dir():  # not "0 files": it is no cache at all
        raise ValueError(f"{directory} is not a directory (FLEXFA_CACHE_DIR names a file)")
    if args.command == "size":
        files, size = cache_size(directory)
        kernels = [f for f in cache_files.flexfa_files(directory) if f.kind == "source"]
        print(f"{directory}: {files} files, {size} bytes; {len(kernels)} flexfa kernels, "
              f"{sum(f.size for f in kernels)} bytes (bound {max_bytes()} bytes)")
    elif args.command == "clear":
        files, size, others = cache_files.clear(directory)
        left = f"; left {others} other entries alone" if others else ""
        print(f"cleared {directory}: removed {files} files, {size} bytes{left}")
    else:
        older = None if args.older_than is None else args.older_than * 86400
        result = cache_files.prune(directory, args.max_bytes, older)
        print(f"pruned {directory}: removed {result.removed_files} files, "
              f"{result.removed_bytes} bytes; kept {result.kept_kernels} kernels, "
              f"{result.kept_bytes} bytes")
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(list(argv or []))
    except SystemExit as exc:  # --help (0) or a usage error (2)
        return int(exc.code or 0)
    try:
        return _run(args, cache_dir())
    except (ValueError, OSError) as exc:
        print(f"flexfa cache {args.command}: {exc}", file=sys.stderr)
        return 1
