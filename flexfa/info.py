"""``python -m flexfa info``: versions, GPU, interpreter mode, cache location and size."""
from __future__ import annotations

import os
import platform
import sys


def _version(module_name: str) -> str:
    try:
        module = __import__(module_name)
    except Exception as exc:  # an optional package missing or broken is information too
        return f"not available ({type(exc).__name__})"
    return getattr(module, "__version__", "unknown")


def _gpu_lines() -> list[str]:
    import torch
    if not torch.cuda.is_available():
        return ["gpu:        none (kernels run on the CPU through the Triton interpreter, "
                "TRITON_INTERPRET=1; slow, for small sizes)"]
    lines = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        lines.append(f"gpu {index}:      {props.name}, sm_{props.major}{props.minor}, "
                     f"{props.total_memory / 2**30:.0f} GiB")
    lines.append(f"cuda:       {torch.version.cuda}")
    return lines


def _size_text(size: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def report() -> str:
    """The text ``flexfa info`` prints."""
    import flexfa
    from .runtime.cli import cache_dir, cache_size

    directory = cache_dir()
    files, size = cache_size(directory)
    where = f"{directory} ({files} files, {_size_text(size)})" if directory.exists() \
        else f"{directory} (not created yet)"
    lines = [
        f"flexfa:     {flexfa.__version__} ({os.path.dirname(flexfa.__file__)})",
        f"python:     {platform.python_version()} ({sys.executable})",
        f"torch:      {_version('torch')}",
        f"triton:     {_version('triton')}",
        f"numpy:      {_version('numpy')}",
        f"platform:   {platform.platform()}",
        *_gpu_lines(),
        f"interpret:  TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '') or '(unset)'}",
        f"cache:      {where}",
    ]
    settings = sorted((k, v) for k, v in os.environ.items() if k.startswith("FLEXFA_"))
    lines += [f"env:        {k}={v}" for k, v in settings] or ["env:        no FLEXFA_* variables set"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print("usage: python -m flexfa info\n\nprint versions, GPU, cache location and size")
        return 0
    if argv:
        print(f"flexfa info takes no arguments, got {' '.join(argv)!r}", file=sys.stderr)
        return 2
    print(report())
    return 0
