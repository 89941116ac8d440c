"""``python -m flexfa info``: versions, GPU, interpreter mode, cache location and size."""
from __future__ import annotations

import os
import platform
import sys
import warnings

from . import config


def _version(module_name: str) -> str:
    try:
        module = __import__(module_name)
    except Exception as exc:  # an optional package missing or broken is information too
        return f"not available ({type(exc).__name__})"
    return getattr(module, "__version__", "unknown")


def _gpu_lines() -> list[str]:
    import torch
    if not torch.cuda.is_available():
        return ["gpu:        none (CPU tensors run through Triton's interpreter: slow, for "
                "small sizes)"]
    lines = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        lines.append(f"gpu {index}:      {props.name}, sm_{props.major}{props.minor}, "
                     f"{props.total_memory / 2**30:.0f} GiB")
    lines.append(f"cuda:       {torch.version.cuda}")
    return lines


def _interpreter_line() -> str:
    """flexfa interprets kernels for CPU tensors whatever ``TRITON_INTERPRET`` says (it sets
    Triton's mode itself while loading each kernel, on the loading thread only), so the line
    says both."""
    value = config.triton_interpret()
    here = "unset" if value is None else f"TRITON_INTERPRET={value}"
    return (f"interpret:  kernels for CPU tensors (flexfa sets the mode per kernel; "
            f"this environment: {here})")


def _numpy_line() -> str:
    """numpy's version and whether Triton's interpreter can use it."""
    from .loader import check_interpreter_numpy

    version = _version("numpy")
    if version.startswith("not available"):
        return f"numpy:      {version}; CPU tensors need it: pip install \"numpy<2.3\""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            check_interpreter_numpy()
        except Exception as exc:
            return f"numpy:      {version} ({exc})"
    return f"numpy:      {version}" + (f" ({caught[0].message})" if caught else "")


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
        _numpy_line(),
        f"platform:   {platform.platform()}",
        *_gpu_lines(),
        _interpreter_line(),
        f"cache:      {where}",
    ]
    settings = config.settings().items()
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
