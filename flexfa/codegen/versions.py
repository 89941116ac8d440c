"""The versions every generated-kernel cache key includes.

Besides the flexfa, Triton and torch versions, the key hashes the source text of everything
that decides what a generated kernel says: the renderer and kernel builders
(``flexfa/codegen/*.py``), the templates, and the IR and its tracing, simplification and
differentiation (``flexfa/frontend/*.py``). An edited renderer therefore never reuses a kernel
written by the old one, with no version number to remember to bump.
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]  # the flexfa package directory
# (folder, file pattern) under PACKAGE whose files shape generated kernel sources
HASHED_SOURCES = (("codegen", "*.py"), ("codegen/templates", "*"), ("frontend", "*.py"))


def read_sources(package: Path) -> list[tuple[str, bytes]]:
    """(path relative to ``package``, content) of every hashed file, in a fixed order."""
    files = sorted(path for folder, pattern in HASHED_SOURCES
                   for path in (package / folder).glob(pattern) if path.is_file())
    return [(path.relative_to(package).as_posix(), path.read_bytes()) for path in files]


@functools.cache
def sources_hash(package: Path = PACKAGE) -> str:
    """sha256 over the hashed sources' names and contents (read once per process)."""
    digest = hashlib.sha256()
    for name, content in read_sources(package):
        digest.update(f"{name}\0{len(content)}\0".encode())
        digest.update(content)
    return digest.hexdigest()


@functools.cache
def versions_key() -> str:
    import torch
    import triton

    from ..version import __version__
    return (f"flexfa={__version__}|sources={sources_hash()}|triton={triton.__version__}"
            f"|torch={torch.__version__}")


@functools.cache
def build_tag() -> str:
    """16 hex digits naming this build (versions and sources): written into every cached
    kernel's header, so files of another build can be found and pruned without their keys."""
    return hashlib.sha256(versions_key().encode()).hexdigest()[:16]
